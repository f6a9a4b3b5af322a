"""``gpuledger health``: the DaemonSet's exec probe, against the real services on a real nats-server."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from gpuledger.health_cmd import check
from tests.e2e.helpers import Node

SERVICES = ("registrar", "allocator", "vmanager", "watchdog", "nats")


async def test_every_service_answers_its_probe(node: Node) -> None:
    for service in SERVICES:
        assert await check(service, node.settings, timeout=3) is None, service


async def test_a_probe_fails_when_the_service_is_not_there(node: Node) -> None:
    elsewhere = node.settings.replace(node_name="another-node", device_plugin_dir=str(node.settings.state_dir))
    for service in ("allocator", "vmanager", "watchdog"):
        problem = await check(service, elsewhere, timeout=1)
        assert problem is not None and "nothing answers" in problem, problem
    problem = await check("registrar", elsewhere, timeout=1)
    assert problem is not None and "vcore.sock does not exist" in problem
    problem = await check("nats", node.settings.replace(nats_url="nats://127.0.0.1:1"), timeout=1)
    assert problem is not None and "cannot reach NATS" in problem
    # the refusal itself, at once: not a timeout after retries (a restarted broker is seen sooner)
    assert "Connect call failed" in problem or "refused" in problem.lower(), problem


@pytest.mark.parametrize(("node_name", "code"), [(None, 0), ("another-node", 1)])
async def test_the_command_exit_code(node: Node, node_name: str | None, code: int) -> None:
    settings = node.settings if node_name is None else node.settings.replace(node_name=node_name)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", "health", "allocator", "--timeout", "2",
        env={**os.environ, **settings.to_env()}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == code, (out, err)
    assert (b"allocator: ok" in out) if code == 0 else (b"unhealthy" in err)
