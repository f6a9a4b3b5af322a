"""The runtime file of `gpuledger up` (agent.json): written, found from the state dirs, ignored when stale."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuledger import agent_file
from gpuledger.agent_file import find_agent, locate, read_agent, remove_agent_file, write_agent_file
from libs.config import Settings


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_written_read_and_removed(tmp_path: Path) -> None:
    settings = Settings(state_dir=str(tmp_path), node_name="n1", nats_url="nats://127.0.0.1:4999",
                        metrics_port=7000, metrics_host="0.0.0.0")
    write_agent_file(settings)
    info = read_agent(tmp_path)
    assert info is not None and (info.node, info.nats_url, info.pid) == ("n1", "nats://127.0.0.1:4999", os.getpid())
    assert info.metrics == {"allocator": "http://127.0.0.1:7000", "registrar": "http://127.0.0.1:7001",
                            "vmanager": "http://127.0.0.1:7002", "watchdog": "http://127.0.0.1:7003"}
    remove_agent_file(str(tmp_path), pid=os.getpid() + 1)  # not ours: kept
    assert read_agent(tmp_path) is not None
    remove_agent_file(str(tmp_path))
    assert read_agent(tmp_path) is None


def test_a_file_whose_up_is_gone_is_ignored(tmp_path: Path) -> None:
    write_agent_file(Settings(state_dir=str(tmp_path), node_name="n1"), pid=_dead_pid())
    assert (tmp_path / "agent.json").exists() and read_agent(tmp_path) is None


def test_the_default_state_dir_then_its_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_file, "default_state_dir", lambda: str(tmp_path))
    assert find_agent(None) is None
    write_agent_file(Settings(state_dir=str(tmp_path / "demo"), node_name="demo-node", nats_url="nats://h:1"))
    assert find_agent(None).node == "demo-node"  # type: ignore[union-attr]
    write_agent_file(Settings(state_dir=str(tmp_path), node_name="main", nats_url="nats://h:2"))
    assert find_agent(None).node == "main"  # type: ignore[union-attr]
    assert find_agent(str(tmp_path / "demo")).node == "demo-node"  # type: ignore[union-attr]


def test_flags_beat_the_file(tmp_path: Path) -> None:
    write_agent_file(Settings(state_dir=str(tmp_path), node_name="demo-node", nats_url="nats://h:1"))
    found = locate(nats_url=None, node_name=None, state_dir=str(tmp_path))
    assert (found.nats_url, found.node) == ("nats://h:1", "demo-node")
    named = locate(nats_url=None, node_name="other", state_dir=str(tmp_path))
    assert (named.nats_url, named.node) == ("nats://h:1", "other")
    elsewhere = locate(nats_url="nats://x:9", node_name=None, state_dir=str(tmp_path))
    assert elsewhere.nats_url == "nats://x:9" and elsewhere.node != "demo-node" and elsewhere.agent is None
    assert found.node_known and named.node_known and not elsewhere.node_known  # the host name is only a guess
