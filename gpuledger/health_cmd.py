"""``gpuledger health SERVICE``: the DaemonSet's liveness/readiness probe (an exec probe, no ports).

A service is healthy when it answers, within the timeout, on the interface it serves (``nats``: the
broker accepts a connection and answers a flush):
allocator, watchdog and vmanager a NATS request on their own subject (any answer counts, an error reply
included: the process is alive and its loop turns; "no responders" or silence does not), the registrar
GetDevicePluginOptions on both of its plugin sockets. Exit 0 when healthy, 1 otherwise, with the reason.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import click
import grpc
import grpc.aio
import msgspec
import nats
import nats.errors
from click.core import ParameterSource

from gpuledger.agent import SERVICES
from gpuledger.agent_file import DEFAULT_NATS_URL, find_agent
from gpuledger.options import agent_options, settings_from
from libs.commands import PodsRequest, PrepareRequest, StateRequest
from libs.config import Settings
from libs.events.subjects import Subjects
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.kubelet.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

__all__ = ["check", "health"]

PLUGIN_SOCKETS = ("vcore.sock", "vmemory.sock")


async def _connect(settings: Settings, timeout: float) -> tuple[Any, str]:
    errors: list[str] = []

    async def failed(exc: Exception) -> None:  # nats-py logs to stderr without an error callback
        errors.append(str(exc) or type(exc).__name__)

    # One attempt: a broker that is not up refuses at once, and the probe says so at once (nats-py
    # reads max_reconnect_attempts=0 as "no limit": it would retry until the timeout).
    try:
        nc = await asyncio.wait_for(
            nats.connect(settings.nats_url, connect_timeout=timeout, allow_reconnect=False,
                         max_reconnect_attempts=1, reconnect_time_wait=0.01, error_cb=failed, name="health-probe"),
            timeout)
    except Exception as exc:
        cause = errors[-1] if errors else str(exc) or type(exc).__name__
        return None, f"cannot reach NATS at {settings.nats_url}: {cause}"
    return nc, ""


async def _nats_answers(settings: Settings, subject: str, payload: Any, timeout: float) -> str | None:
    nc, problem = await _connect(settings, timeout)
    if nc is None:
        return problem
    try:
        await nc.request(subject, msgspec.json.encode(payload), timeout=timeout)
    except nats.errors.NoRespondersError:
        return f"nothing answers {subject}"
    except nats.errors.TimeoutError:
        return f"no answer on {subject} within {timeout:g}s"
    finally:
        await nc.close()
    return None


async def _plugins_answer(settings: Settings, timeout: float) -> str | None:
    for name in PLUGIN_SOCKETS:
        path = Path(settings.device_plugin_dir) / name
        if not path.is_socket():
            return f"{path} does not exist"
        try:
            async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
                await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return f"{path} does not answer: {exc.details()}"
    return None


async def _broker_answers(settings: Settings, timeout: float) -> str | None:
    nc, problem = await _connect(settings, timeout)
    if nc is None:
        return problem
    try:
        await nc.flush(timeout=timeout)
    except Exception as exc:
        return f"NATS at {settings.nats_url} does not answer: {exc or type(exc).__name__}"
    finally:
        await nc.close()
    return None


async def check(service: str, settings: Settings, timeout: float) -> str | None:
    """None when healthy, else why not."""
    subjects = Subjects(settings.node_name)
    if service == "registrar":
        return await _plugins_answer(settings, timeout)
    if service == "nats":
        return await _broker_answers(settings, timeout)
    probes = {
        "allocator": (subjects.state, StateRequest()),
        "watchdog": (subjects.pods, PodsRequest(uid="health-probe")),
        "vmanager": (subjects.prepare, PrepareRequest(pod_uid="health-probe")),  # refused at once: 400
    }
    subject, payload = probes[service]
    return await _nats_answers(settings, subject, payload, timeout)


@click.command()
@click.argument("service", type=click.Choice([*SERVICES, "nats"]))
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to wait for the answer.")
@agent_options
def health(service: str, timeout: float, **values: Any) -> None:
    """Exit 0 when SERVICE answers on its interface (a Kubernetes exec probe).

    Without --nats-url, a running `gpuledger up` of --state-dir (its agent.json) says where to ask."""
    settings = settings_from(values, nats_url=values.get("nats_url") or DEFAULT_NATS_URL)
    if values.get("nats_url") is None:
        settings = _from_agent_file(settings, values)
    problem = asyncio.run(check(service, settings, timeout))
    if problem:
        click.echo(f"{service}: unhealthy: {problem}", err=True)
        sys.exit(1)
    click.echo(f"{service}: ok")


def _from_agent_file(settings: Settings, values: dict[str, Any]) -> Settings:
    ctx = click.get_current_context()
    given = ctx.get_parameter_source("state_dir") not in (ParameterSource.DEFAULT, None)
    agent = find_agent(settings.state_dir if given else None)
    if agent is None:
        return settings
    changes: dict[str, Any] = {"nats_url": agent.nats_url}
    if values.get("node_name") is None:
        changes["node_name"] = agent.node
    if ctx.get_parameter_source("device_plugin_dir") in (ParameterSource.DEFAULT, None):
        changes["device_plugin_dir"] = agent.device_plugin_dir
    return settings.replace(**changes)
