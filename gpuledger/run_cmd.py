"""``gpuledger run SERVICE``: one service in the foreground (what each DaemonSet container runs).

A module of its own so that the entry point can start a service without importing the rest of the
CLI: every service is a separate process, and each module the CLI's other commands pull in (the
simulator, the GPU tools, the audit views) would be paid once per service.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from gpuledger.agent import ON_UVLOOP, SERVICES
from gpuledger.options import agent_options, settings_from

__all__ = ["run"]


@click.command()
@click.argument("service", type=click.Choice(SERVICES))
@agent_options
def run(service: str, **values: Any) -> None:
    """Run one service in the foreground (what each DaemonSet container runs)."""
    from libs.runtime import run_service

    settings = settings_from(values, nats_url=values.get("nats_url") or "nats://127.0.0.1:4222")
    # Only the service this process runs is imported (each pulls in its own gRPC, Kubernetes, NVML...).
    factory = importlib.import_module(f"services.{service}.app").service
    sys.exit(run_service(service, settings, factory, uvloop=service in ON_UVLOOP))
