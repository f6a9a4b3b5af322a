"""Device selectors in CEL, evaluated by a real CEL implementation (cel-python, module ``celpy``).

The environment is the one the DRA scheduler plugin gives a selector: a ``device`` with ``driver``,
``attributes`` and ``capacity`` (both maps from a domain to a map of names), and
``allowMultipleAllocations``. Attribute names in a slice are qualified by a domain or belong to the
driver's own domain, so ``device.attributes["gpu.example.com"].model`` reads the attribute ``model``
that driver ``gpu.example.com`` published. Capacities are quantities: integers here, with the
quantity library's ``quantity("40Gi")``, ``compareTo``, ``isGreaterThan``, ``isLessThan`` and
``asInteger``. An expression that does not compile is a clear error; one that fails at evaluation
(a missing attribute) does not match, as in the scheduler, which also reports it.
"""

from __future__ import annotations

import functools
from typing import Any

import celpy
from celpy import celtypes

from .quantity import parse_quantity

__all__ = ["CelError", "device_activation", "matches"]


class CelError(ValueError):
    """A selector that is not valid CEL (or not a boolean expression)."""


def _quantity(text: Any) -> celtypes.IntType:
    try:
        return celtypes.IntType(parse_quantity(str(text)))
    except ValueError as err:
        raise celpy.CELEvalError(str(err)) from err


_FUNCTIONS = {
    "quantity": _quantity,
    "compareTo": lambda a, b: celtypes.IntType((a > b) - (a < b)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(a > b),
    "isLessThan": lambda a, b: celtypes.BoolType(a < b),
    "asInteger": lambda a: celtypes.IntType(a),
}

_ENV = celpy.Environment()


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> Any:
    try:
        return _ENV.program(_ENV.compile(expression), functions=_FUNCTIONS)
    except celpy.CELParseError as err:
        raise CelError(f"invalid CEL selector {expression!r}: {err}") from err


def _attribute_value(value: dict[str, Any]) -> Any:
    for key in ("int", "bool", "string", "version"):
        if key in value:
            return value[key]
    return None


def device_activation(driver: str, device: dict[str, Any]) -> dict[str, Any]:
    """The ``device`` variable for one device of a slice published by ``driver``."""
    attributes: dict[str, dict[str, Any]] = {driver: {}}
    for name, value in (device.get("attributes") or {}).items():
        domain, _, short = name.rpartition("/")
        attributes.setdefault(domain or driver, {})[short] = _attribute_value(value)
    capacity: dict[str, dict[str, Any]] = {driver: {}}
    for name, value in (device.get("capacity") or {}).items():
        domain, _, short = name.rpartition("/")
        capacity.setdefault(domain or driver, {})[short] = parse_quantity(value["value"])
    return {"device": celpy.json_to_cel({
        "driver": driver, "attributes": attributes, "capacity": capacity,
        "allowMultipleAllocations": bool(device.get("allowMultipleAllocations")),
    })}


def matches(expression: str, activation: dict[str, Any]) -> bool:
    """Whether the selector holds; CelError for an expression that is not CEL or not boolean."""
    program = _program(expression)
    try:
        result = program.evaluate(activation)
    except celpy.CELEvalError:
        return False  # e.g. a missing attribute: the device does not match
    if isinstance(result, celpy.CELEvalError):
        return False
    if not isinstance(result, celtypes.BoolType):
        raise CelError(f"CEL selector {expression!r} must evaluate to a bool, got {type(result).__name__}")
    return bool(result)
