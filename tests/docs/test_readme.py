"""The README is true: every link in it and in docs/ resolves inside the repository, and every command
of its tour, run as printed after `gpuledger up --demo`, exits 0 and prints something."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.docs.helpers import ROOT, broken_links, documents, heading_anchors, links, tour

README = ROOT / "README.md"


def test_every_link_in_the_readme_and_docs_resolves_inside_the_repository() -> None:
    checked = [(path, links(path.read_text())) for path in documents()]
    assert sum(len(found) for _path, found in checked) >= 30  # the pattern does find the links
    assert [problem for path, _found in checked for problem in broken_links(path)] == []


def test_the_link_check_can_fail() -> None:
    text = "\n".join([
        "# Title", "## The `vcuda` form (gpu-manager's)",
        "[ok](#the-vcuda-form-gpu-managers) [ok](docs/configuration.md#configuration) [ok](deploy/)",
        "[missing](docs/nosuch.md) [bad anchor](docs/nats.md#nosuch) [out](https://example.com/x.md)",
        "[up](../outside.md) ![img](docs/nosuch.png) <https://example.com>",
        "`[in code](nosuch.md)`", "```", "[in a block](nosuch.md)", "```",
    ])
    problems = broken_links(README, text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/nosuch.md: no such file",
        "docs/nats.md#nosuch: no heading with anchor #nosuch",
        "https://example.com/x.md: links outside the repository",
        "../outside.md: points outside the repository",
        "docs/nosuch.png: no such file",
        "https://example.com: links outside the repository",
    ], problems
    assert heading_anchors("# A\n## A\n## Security model (vcuda.sock)\n") == {"a", "a-1", "security-model-vcudasock"}


def test_the_readme_keeps_the_two_commands_for_a_fresh_machine() -> None:
    text = README.read_text()
    assert "make demo    #" in text and "make test    #" in text  # the CI (.ci/run) and the Makefile rely on them


class _Lines:
    """A process's stdout read by a thread, so that every wait for a line has a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if marker in line:
                return
        raise AssertionError(f"no {marker!r} within {timeout}s:\n" + "\n".join(self.lines[-40:]))


@pytest.mark.slow
@pytest.mark.timeout(300)  # the demo starts in ~20 s, slower on a loaded machine; each command has its own 60 s
def test_the_tour_runs_as_printed_on_the_demo(short_dir: Path) -> None:
    """The demo with its default state directory under a HOME of the test's own, so that the tour's
    `~/.local/state/gpuledger/demo` is this demo's, and `.venv/bin/gpuledger` the running venv's."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "gpuledger").exists():
        pytest.skip(f"needs the gpuledger script of a virtual environment ({venv}/bin/gpuledger)")
    assignment, commands = tour(README.read_text())
    assert assignment.startswith("D=~/.local/state/gpuledger/demo ")
    assert len(commands) >= 8 and all(c.startswith(".venv/bin/gpuledger ") for c in commands), commands

    home = short_dir / "h"
    work = short_dir / "w"  # the reader's checkout: the venv and the docs the tour names
    work.mkdir()
    (work / ".venv").symlink_to(venv)
    (work / "docs").symlink_to(ROOT / "docs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEDGER_") and k != "XDG_STATE_HOME"}
    env["HOME"] = str(home)
    proc = subprocess.Popen([str(venv / "bin" / "gpuledger"), "up", "--demo",
                             "--state-dir", str(home / ".local" / "state" / "gpuledger")],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        output = _Lines(proc)
        output.wait_for("Press Ctrl-C to stop.", 150)
        for command in commands:
            run = subprocess.run(["bash", "-c", f"{assignment}\n{command}"], cwd=work, env=env,
                                 capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            assert run.returncode == 0, (command, run.stdout[-2000:], run.stderr[-2000:])
            assert run.stdout.strip(), (command, run.stderr[-2000:])
        # the tour's first command again, after its fault injection: the status it printed was this demo's
        last_status = subprocess.run(["bash", "-c", f"{assignment}\n{commands[0]}"], cwd=work, env=env,
                                     capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert "node demo-node" in last_status.stdout and "UNHEALTHY (xid 79)" in last_status.stdout

        if os.geteuid() != 0:  # as the README says, plain `status` finds the demo (root's default is /var/lib)
            plain = subprocess.run([".venv/bin/gpuledger", "status"], cwd=work, env=env, capture_output=True,
                                   text=True, timeout=60, stdin=subprocess.DEVNULL)
            assert plain.returncode == 0 and "node demo-node" in plain.stdout, plain.stderr

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the demo's terminal
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
