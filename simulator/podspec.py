"""Reading the parts of a Pod manifest (a plain dict) that the simulated kubelet acts on."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "app_containers",
    "container_limits",
    "init_containers",
    "is_sidecar",
    "pod_key",
    "pod_uid",
    "quantity_value",
]

_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
_FACTORS = {
    None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
    "P": Decimal(10**15), "E": Decimal(10**18),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}


def quantity_value(raw: Any) -> int:
    """Kubernetes `Quantity.Value()`: the amount rounded up to a whole number."""
    if isinstance(raw, bool):
        raise ValueError(f"not a quantity: {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        return math.ceil(raw)
    m = _QUANTITY.match(str(raw).strip())
    if not m:
        raise ValueError(f"not a quantity: {raw!r}")
    try:
        value = Decimal(m.group(1)) * _FACTORS[m.group(2)]
    except InvalidOperation as err:
        raise ValueError(f"not a quantity: {raw!r}") from err
    return math.ceil(value)


def pod_uid(pod: dict[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def pod_key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata", {})
    return meta.get("namespace", "default"), meta.get("name", "")


def init_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("spec", {}).get("initContainers") or [])


def app_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("spec", {}).get("containers") or [])


def is_sidecar(container: dict[str, Any]) -> bool:
    """A restartable init container (`restartPolicy: Always`)."""
    return container.get("restartPolicy") == "Always"


def container_limits(container: dict[str, Any]) -> dict[str, int]:
    """Limits as whole numbers; unparsable ones are skipped (the API server would reject them)."""
    out: dict[str, int] = {}
    for name, raw in ((container.get("resources") or {}).get("limits") or {}).items():
        try:
            out[name] = quantity_value(raw)
        except ValueError:
            continue
    return out
