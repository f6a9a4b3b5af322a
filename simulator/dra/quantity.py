"""Kubernetes resource quantities ("80Gi", "100", "1500m", "2e3") as exact integers, and back.

Capacities and capacity requests in DRA are quantities; the simulator counts them as integers
(milli-units round up, as a request must never be granted less than it asked for).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["format_quantity", "parse_quantity"]

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1, "k": 10**3,
            "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_PATTERN = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")


def parse_quantity(value: str | int | float) -> int:
    """The integer value of a quantity; ValueError with the text for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return math.ceil(value)
    m = _PATTERN.fullmatch(str(value).strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = Fraction(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        scaled = number * _BINARY[suffix]
    elif suffix in _DECIMAL:
        scaled = number * _DECIMAL[suffix]
    else:
        scaled = number * Fraction(10) ** int(suffix[1:])
    return math.ceil(scaled)


def format_quantity(value: int) -> str:
    """Canonical form: the largest binary suffix that divides exactly, else the plain number."""
    for suffix, factor in reversed(_BINARY.items()):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)
