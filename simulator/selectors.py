"""Field and label selectors as the API server parses them for pods."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import ApiError

__all__ = ["Selector", "parse_field_selector", "parse_label_selector"]

Selector = Callable[[dict[str, Any]], bool]

# The pod fields the real API server lets you select on, and how to read them.
_POD_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda p: p.get("metadata", {}).get("name", ""),
    "metadata.namespace": lambda p: p.get("metadata", {}).get("namespace", ""),
    "spec.nodeName": lambda p: p.get("spec", {}).get("nodeName", "") or "",
    "spec.restartPolicy": lambda p: p.get("spec", {}).get("restartPolicy", "") or "",
    "spec.schedulerName": lambda p: p.get("spec", {}).get("schedulerName", "") or "",
    "spec.serviceAccountName": lambda p: p.get("spec", {}).get("serviceAccountName", "") or "",
    "spec.hostNetwork": lambda p: str(bool(p.get("spec", {}).get("hostNetwork", False))).lower(),
    "status.phase": lambda p: (p.get("status") or {}).get("phase", "") or "",
    "status.podIP": lambda p: (p.get("status") or {}).get("podIP", "") or "",
    "status.nominatedNodeName": lambda p: (p.get("status") or {}).get("nominatedNodeName", "") or "",
}

_NODE_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda n: n.get("metadata", {}).get("name", ""),
    "spec.unschedulable": lambda n: str(bool(n.get("spec", {}).get("unschedulable", False))).lower(),
}


def _split_terms(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (`env in (a,b),tier`)."""
    terms, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append("".join(current))
            current = []
        else:
            current.append(ch)
    terms.append("".join(current))
    return [t.strip() for t in terms if t.strip()]


def parse_field_selector(text: str | None, kind: str = "pods") -> Selector:
    """`key=value`, `key==value`, `key!=value`, comma-separated (all must hold)."""
    fields = _POD_FIELDS if kind == "pods" else _NODE_FIELDS
    checks: list[Selector] = []
    for term in _split_terms(text or ""):
        m = re.fullmatch(r"([^=!]+)(!=|==|=)(.*)", term)
        if not m:
            raise ApiError.bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        getter = fields.get(key)
        if getter is None:
            raise ApiError.bad_request(f'field label not supported: {key}')
        if op == "!=":
            checks.append(lambda obj, g=getter, v=value: g(obj) != v)
        else:
            checks.append(lambda obj, g=getter, v=value: g(obj) == v)
    return lambda obj: all(check(obj) for check in checks)


def parse_label_selector(text: str | None) -> Selector:
    """`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-separated."""
    checks: list[Selector] = []

    def labels(obj: dict[str, Any]) -> dict[str, str]:
        return obj.get("metadata", {}).get("labels") or {}

    for term in _split_terms(text or ""):
        set_match = re.fullmatch(r"([^\s!=()]+)\s+(in|notin)\s+\((.*)\)", term)
        if set_match:
            key, op = set_match.group(1), set_match.group(2)
            values = {v.strip() for v in set_match.group(3).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda o, k=key, vs=values: labels(o).get(k) in vs)
            else:
                checks.append(lambda o, k=key, vs=values: labels(o).get(k) not in vs)
            continue
        m = re.fullmatch(r"([^\s!=()]+)\s*(!=|==|=)\s*([^\s!=()]*)", term)
        if m:
            key, op, value = m.groups()
            if op == "!=":
                checks.append(lambda o, k=key, v=value: labels(o).get(k) != v)
            else:
                checks.append(lambda o, k=key, v=value: k in labels(o) and labels(o)[k] == v)
            continue
        m = re.fullmatch(r"(!?)\s*([^\s!=()]+)", term)
        if m:
            negate, key = m.groups()
            if negate:
                checks.append(lambda o, k=key: k not in labels(o))
            else:
                checks.append(lambda o, k=key: k in labels(o))
            continue
        raise ApiError.bad_request(f"unable to parse requirement: {term!r}")
    return lambda obj: all(check(obj) for check in checks)
