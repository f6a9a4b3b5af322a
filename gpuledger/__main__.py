"""Entry point of ``gpuledger`` and ``python -m gpuledger``."""

import signal
import sys


def entry() -> None:
    # Until a command installs its own handlers, SIGTERM is a clean exit: nothing has started yet.
    # (A supervisor or the kubelet may stop a process that is still importing.)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from gpuledger.cli import main

    main()


if __name__ == "__main__":
    entry()
