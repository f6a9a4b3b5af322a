"""The agent's services: one process each (``gpuledger run <service>``, one DaemonSet container each),
listed in the order ``gpuledger up`` starts them. The one list of their names: the CLI's choices, the
launcher and the health probe read it here (a module of its own, so the CLI starts without the launcher)."""

from __future__ import annotations

__all__ = ["SERVICES"]

SERVICES = ("allocator", "watchdog", "vmanager", "registrar")
