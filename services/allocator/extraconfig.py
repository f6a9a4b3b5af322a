"""gpu-manager's ``--extra-config`` file (gpu-manager-reference.md section 1): a JSON map of
name -> ``{"devices": [paths]}``; only the ``default`` entry is used, its device nodes are added to
every Allocate response after /dev/nvidiactl and /dev/nvidia-uvm."""

from __future__ import annotations

from pathlib import Path

import msgspec

from libs.errors import ConfigError

__all__ = ["default_devices"]


class _Entry(msgspec.Struct, forbid_unknown_fields=False):
    devices: list[str] = []


def default_devices(path: str) -> tuple[str, ...]:
    """The ``default`` entry's device paths; () without a file. A bad file stops the allocator."""
    if not path:
        return ()
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the extra config {path}: {exc}") from exc
    try:
        entries = msgspec.json.decode(raw, type=dict[str, _Entry])
    except msgspec.DecodeError as exc:
        raise ConfigError(f"extra config {path} is not a map of name -> {{\"devices\": [paths]}}: {exc}") from exc
    devices = tuple(entries["default"].devices) if "default" in entries else ()
    for dev in devices:
        if not dev.startswith("/dev/"):
            raise ConfigError(f"extra config {path}: device {dev!r} is not a /dev path")
    return devices
