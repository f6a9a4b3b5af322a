"""The agent's services: one process each (``gpuledger run <service>``, one DaemonSet container each),
listed in the order ``gpuledger up`` starts them. The one list of their names: the CLI's choices, the
launcher and the health probe read it here (a module of its own, so the CLI starts without the launcher)."""

from __future__ import annotations

__all__ = ["ON_UVLOOP", "SERVICES"]

SERVICES = ("allocator", "watchdog", "vmanager", "registrar")
# The services a kubelet's or a container's request waits on run on uvloop: each hop of an Allocate
# (kubelet -> registrar -> NATS -> allocator and back) and of a registration through vcuda.sock is a
# process waking on a socket, which uvloop does in C (docs/benchmarks.md, "Lean and fast"). The
# watchdog, which watches the API server, stays on asyncio's loop: ~2.3 MB RSS per process saved.
ON_UVLOOP = ("allocator", "vmanager", "registrar")
