"""Entry point of ``gpuledger`` and ``python -m gpuledger``."""

import signal
import sys


def entry() -> None:
    # Until a command installs its own handlers, SIGTERM is a clean exit: nothing has started yet.
    # (A supervisor or the kubelet may stop a process that is still importing.)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if sys.argv[1:2] == ["run"]:  # a service process: only what `run` needs (see gpuledger/run_cmd.py)
        from gpuledger.run_cmd import run

        run(sys.argv[2:], prog_name="gpuledger run")
        return
    from gpuledger.cli import main

    main()


if __name__ == "__main__":
    entry()
