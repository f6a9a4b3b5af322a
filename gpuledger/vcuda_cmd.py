"""``gpuledger gpu-client`` (alias ``vcuda-client``): gpu-manager's gpu-client, with a timeout.

Same flags as gpu-manager's ``gpu-client`` (``--addr --bus-id --pod-uid --cont-id --cont-name``), so
it can stand in for it on the host for debugging and tests. Exit status 0 on success, 1 on any
failure (the interception library only checks for non-zero). It never waits longer than
``--timeout``: gpu-manager's dials without a deadline and hangs the CUDA program forever.
"""

from __future__ import annotations

import asyncio

import click

__all__ = ["gpu_client"]


@click.command("gpu-client")
@click.option("--addr", required=True, help="The pod's vcuda.sock.")
@click.option("--bus-id", default="", help="Ignored by the server (kept for gpu-client compatibility).")
@click.option("--pod-uid", required=True)
@click.option("--cont-id", default="", help="Register by container id (current library).")
@click.option("--cont-name", default="", help="Register by container name (legacy library).")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="Give up after this many seconds, dial included.")
def gpu_client(addr: str, bus_id: str, pod_uid: str, cont_id: str, cont_name: str, timeout: float) -> None:
    """gpu-manager's gpu-client: call RegisterVDevice on a pod's vcuda.sock (with a timeout)."""
    from libs.vcuda.client import VcudaClientError, register_vdevice

    try:
        asyncio.run(register_vdevice(addr, pod_uid=pod_uid, bus_id=bus_id, container_id=cont_id,
                                     container_name=cont_name, timeout=timeout))
    except (VcudaClientError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("registered")
