"""CDI resolution done by the simulated kubelet: qualified device IDs -> concrete container edits.

A DRA driver answers NodePrepareResources with CDI device IDs (``vendor/class=name``); a kubelet
hands them to the runtime, which looks them up in the CDI spec directory and injects the device's
``containerEdits``. containerd 1.6 (Debian's package) does not do that (its CRI plugin has no CDI
support; a newer CRI's ``CDI_devices`` field is dropped unseen), so the simulator resolves the IDs
itself, before ``CreateContainer``, and passes plain device nodes, mounts and envs. The recorded
(no-runtime) path resolves the same way, so tests see exactly what the container would get.

Reads every ``*.json`` spec in the directory on each resolution (specs come and go with claims), in
the CDI schema: ``kind``, ``devices[].name``, ``devices[].containerEdits`` and the spec-wide
``containerEdits`` (applied once per spec used), edits ``env`` (``NAME=value``), ``deviceNodes``
(``path``, ``hostPath``, ``permissions``), ``mounts`` (``hostPath``, ``containerPath``, ``options``).
Hooks and other edits are not applied (logged). An ID no spec defines, or one defined twice, fails
the whole container with the runtime's wording ("unresolvable CDI devices ...").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..logger import logger

__all__ = ["CdiEdits", "CdiResolveError", "merge_into_options", "resolve"]

_logger = logger("cdi")
_APPLIED = {"env", "deviceNodes", "mounts"}


class CdiResolveError(Exception):
    """A container's CDI devices could not be resolved (what the runtime would refuse)."""


@dataclass
class CdiEdits:
    envs: dict[str, str] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)  # container_path, host_path, permissions
    mounts: list[dict[str, Any]] = field(default_factory=list)   # container_path, host_path, read_only

    def apply(self, edits: dict[str, Any], source: str) -> None:
        if not isinstance(edits, dict):
            raise CdiResolveError(f"{source}: containerEdits is not an object")
        for raw in edits.get("env") or []:
            key, sep, value = str(raw).partition("=")
            if not sep or not key:
                raise CdiResolveError(f"{source}: env entry {raw!r} is not NAME=value")
            self.envs[key] = value
        for node in edits.get("deviceNodes") or []:
            if not isinstance(node, dict) or not node.get("path"):
                raise CdiResolveError(f"{source}: a deviceNode without a path")
            self.devices.append({"container_path": node["path"], "host_path": node.get("hostPath") or node["path"],
                                 "permissions": node.get("permissions") or "rwm"})
        for mount in edits.get("mounts") or []:
            if not isinstance(mount, dict) or not mount.get("hostPath") or not mount.get("containerPath"):
                raise CdiResolveError(f"{source}: a mount without hostPath or containerPath")
            self.mounts.append({"container_path": mount["containerPath"], "host_path": mount["hostPath"],
                                "read_only": "ro" in (mount.get("options") or [])})
        ignored = set(edits) - _APPLIED
        if ignored:
            _logger.info("CDI edits not applied by the simulator", source=source, edits=sorted(ignored))


def _load_specs(directory: Path) -> tuple[dict[str, tuple[str, dict[str, Any], dict[str, Any]]], list[str]]:
    """qualified ID -> (spec file, device edits, spec-wide edits); and the IDs defined more than once."""
    devices: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    twice: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return devices, twice
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue  # temporary files of an atomic write start with a dot
        path = directory / name
        try:
            spec = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue  # removed between listing and reading (an unprepare)
        except (OSError, ValueError) as exc:
            _logger.warning("CDI spec file ignored: unreadable", file=str(path), error=str(exc))
            continue
        if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str) or "/" not in spec["kind"]:
            _logger.warning("CDI spec file ignored: no vendor/class kind", file=str(path))
            continue
        common = spec.get("containerEdits") or {}
        for device in spec.get("devices") or []:
            if not isinstance(device, dict) or not device.get("name"):
                continue
            qualified = f"{spec['kind']}={device['name']}"
            if qualified in devices:
                twice.append(qualified)
            devices[qualified] = (name, device.get("containerEdits") or {}, common)
    return devices, twice


def resolve(directory: Path, ids: list[str]) -> CdiEdits:
    """The edits of these CDI devices, in order (each spec's common edits once, first)."""
    edits = CdiEdits()
    if not ids:
        return edits
    known, twice = _load_specs(directory)
    missing = [i for i in ids if i not in known]
    if missing:
        raise CdiResolveError(f"failed to inject CDI devices: unresolvable CDI devices {', '.join(missing)}")
    clash = [i for i in ids if i in twice]
    if clash:
        raise CdiResolveError(f"failed to inject CDI devices: CDI devices defined twice in {directory}: "
                              f"{', '.join(clash)}")
    applied_common: set[str] = set()
    for qualified in dict.fromkeys(ids):
        file, device_edits, common = known[qualified]
        if file not in applied_common:
            applied_common.add(file)
            edits.apply(common, file)
        edits.apply(device_edits, f"{file}: {qualified}")
    return edits


def merge_into_options(opts: dict[str, Any], edits: CdiEdits) -> None:
    """Add resolved edits to a container's run options (the device plugins' merged responses).
    On a clash (same env name, same container path) the device plugins' entry is kept: the
    simulator's choice, so a claim never silently replaces what Allocate gave the container."""
    for key, value in edits.envs.items():
        opts["envs"].setdefault(key, value)
    for key, added in (("devices", edits.devices), ("mounts", edits.mounts)):
        have = {entry["container_path"] for entry in opts[key]}
        for entry in added:
            if entry["container_path"] not in have:
                have.add(entry["container_path"])
                opts[key].append(entry)
