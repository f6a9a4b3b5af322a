"""One real-runtime run per host (simulator/runtime/hostlock.py): another run is refused at once,
naming the holder; a process of the holder's own run (its descendant) is part of it; the host is free
once every take is let go, or once the holder dies. Each test uses a name of its own, so a real run on
the same host is not disturbed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from simulator.runtime import hostlock

_TRY = """
import sys
from simulator.runtime import hostlock
try:
    hostlock.take(sys.argv[1])
except hostlock.RuntimeBusy as exc:
    print("busy:", exc)
else:
    print("taken")
"""

_HOLD = """
import sys, time
from simulator.runtime import hostlock
hostlock.take(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def name() -> str:
    return f"gpuledger-test-{uuid.uuid4().hex}"


def child_tries(name: str) -> str:
    return subprocess.run([sys.executable, "-c", _TRY, name], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


@pytest.fixture
def other_run(name: str) -> Iterator[subprocess.Popen[str]]:
    """A process that holds the host: not our ancestor, so another run to us and to our children."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, name], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_another_run_is_refused_at_once_naming_its_holder(name: str, other_run: subprocess.Popen[str]) -> None:
    assert hostlock.holder_pid(name) == other_run.pid
    with pytest.raises(hostlock.RuntimeBusy, match="another real-runtime run holds this host") as refused:
        hostlock.take(name)
    assert f"pid {other_run.pid} (" in str(refused.value) and "run one at a time" in str(refused.value)
    said = child_tries(name)  # a sibling of the holder is another run too
    assert said.startswith("busy:") and f"pid {other_run.pid}" in said, said


def test_a_holder_that_dies_frees_the_host(name: str, other_run: subprocess.Popen[str]) -> None:
    with pytest.raises(hostlock.RuntimeBusy):
        hostlock.take(name)
    other_run.send_signal(signal.SIGKILL)
    other_run.wait(10)
    with hostlock.holding(name):  # the kernel let go of the name with the process: nothing to clean up
        assert hostlock.holder_pid(name) == os.getpid()
    assert hostlock.holder_pid(name) is None


def test_takes_nest_within_a_process(name: str) -> None:
    with hostlock.holding(name):  # the fake GPUs
        with hostlock.holding(name):  # containerd, inside them
            pass
        assert hostlock.holder_pid(name) == os.getpid()  # the outer take still holds the host
    assert hostlock.holder_pid(name) is None


def test_a_process_of_the_holders_own_run_is_part_of_it(name: str) -> None:
    with hostlock.holding(name):  # gpuledger up --demo's fake GPUs; its simulator child starts containerd
        assert child_tries(name) == "taken"
        assert hostlock.holder_pid(name) == os.getpid()  # the child's end took nothing from us


def test_a_release_without_a_take_changes_nothing(name: str) -> None:
    hostlock.release(name)
    assert hostlock.holder_pid(name) is None
    assert child_tries(name) == "taken"
