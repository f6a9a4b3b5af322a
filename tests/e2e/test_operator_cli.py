"""The operator's first hour: `gpuledger up --demo` in the foreground, then the commands it suggests, run as
printed; the other commands finding the agent through its runtime file; metrics ports; a quiet Ctrl-C."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def gpuledger(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout}s:\n" + "\n".join(lines[-40:]))


def test_the_demo_suggests_commands_that_work_and_they_find_the_agent(short_dir: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]  # the configured metrics port is taken: the demo moves
    state = short_dir / "s"
    proc = subprocess.Popen([sys.executable, "-m", "gpuledger", "up", "--demo", "--state-dir", str(state),
                             "--metrics-port", str(busy)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        lines = _read_until(proc, "Press Ctrl-C to stop.", 180)
        demo = state / "demo"
        agent = json.loads((demo / "agent.json").read_text())
        assert agent["node"] == "demo-node" and agent["pid"] == proc.pid
        assert agent["nats_url"].startswith("nats://127.0.0.1:")
        allocator = agent["metrics"]["allocator"]
        assert allocator.startswith("http://127.0.0.1:") and not allocator.endswith(f":{busy}")
        with urllib.request.urlopen(f"{allocator}/metrics", timeout=5) as resp:
            assert resp.status == 200

        # The hint's commands, exactly as printed (the venv's script, relative to this directory).
        printed = [line.strip() for line in lines if "--state-dir" in line and "gpuledger" in line]
        assert [shlex.split(c)[1] for c in printed] == ["status", "events", "replay"], printed
        for command in printed:
            run = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (command, run.stderr)
        status = subprocess.run(shlex.split(printed[0]), capture_output=True, text=True, timeout=60)
        assert "node demo-node" in status.stdout and "GPU0" in status.stdout
        activate = next((line for line in lines if "activate" in line), None)
        if activate is not None:  # the other way the hint offers
            script = activate.split("`")[1]
            run = subprocess.run(["bash", "-c", f"{script} && gpuledger status --state-dir {demo}"],
                                 capture_output=True, text=True, timeout=60)
            assert run.returncode == 0 and "node demo-node" in run.stdout, run.stderr

        # The other commands find it through agent.json too.
        assert gpuledger("health", "allocator", "--state-dir", str(demo)).returncode == 0
        assert gpuledger("health", "registrar", "--state-dir", str(demo)).returncode == 0
        injected = gpuledger("gpu", "--state-dir", str(demo), "inject-xid", "3", "79")
        assert injected.returncode == 0 and "XID 79" in injected.stdout, injected.stderr

        # An address that answers for another node is an error naming both.
        for args in (("--state-dir", str(demo), "--node-name", "other-node"),
                     ("--url", allocator, "--node-name", "other-node"),
                     ("--nats-url", agent["nats_url"], "--node-name", "other-node")):
            wrong = gpuledger("status", *args)
            assert wrong.returncode == 1, args
            assert "'demo-node'" in wrong.stderr and "'other-node'" in wrong.stderr, wrong.stderr
            assert "nats error" not in wrong.stderr

        # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert not (demo / "agent.json").exists()
        for log in (demo / "logs").glob("*.log"):
            text = log.read_text()
            assert "nats disconnected" not in text and "nats error" not in text, log.name  # broker stopped last
    finally:
        taken.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_metrics_port_that_cannot_be_bound_is_an_error_on_the_terminal(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = gpuledger("up", "--state-dir", str(short_dir / "s"), "--metrics-port", str(port), timeout=30)
    assert run.returncode == 1
    assert f"127.0.0.1:{port}" in run.stderr and "--metrics-port" in run.stderr, run.stderr
    assert not (short_dir / "s" / "agent.json").exists()


def test_without_a_running_agent_the_error_says_how_to_name_one(short_dir: Path) -> None:
    run = gpuledger("status", "--state-dir", str(short_dir / "none"), "--nats-url", "nats://127.0.0.1:1",
                    "--timeout", "1")
    assert run.returncode == 1
    assert "cannot reach NATS at nats://127.0.0.1:1" in run.stderr
    assert "nats error" not in run.stderr  # the retries are not printed, the last error is
