"""The kubelet's checks on a RegisterRequest: API version and extended resource name (spec 2.2)."""

from __future__ import annotations

import re

__all__ = ["SUPPORTED_VERSIONS", "is_extended_resource_name", "register_request_error"]

SUPPORTED_VERSIONS = ("v1beta1",)

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_REQUESTS_PREFIX = "requests."


def _is_qualified_name(value: str) -> bool:
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return False
    else:
        return False
    return 0 < len(name) <= 63 and _QUALIFIED_NAME_PART.fullmatch(name) is not None


def is_extended_resource_name(name: str) -> bool:
    """Upstream `IsExtendedResourceName`: not native, not a quota name, and a valid qualified name
    once prefixed with "requests." (which is how quota sees it)."""
    if "/" not in name or "kubernetes.io/" in name:
        return False  # native resource (unprefixed, or in the kubernetes.io namespace)
    if name.startswith(_REQUESTS_PREFIX):
        return False
    return _is_qualified_name(_REQUESTS_PREFIX + name)


def _go_quote(value: str) -> str:
    """Go's %q for the plain strings we meet here (escapes backslash, quote and control chars)."""
    out = []
    for ch in value:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode())
    return '"' + "".join(out) + '"'


def _go_quoted_list(values: tuple[str, ...]) -> str:
    return "[" + " ".join(_go_quote(v) for v in values) + "]"


def register_request_error(version: str, resource_name: str) -> str | None:
    """The upstream error text for an invalid RegisterRequest, or None when it is valid.

    Order matters and is upstream's: version first, then the name.
    """
    if version not in SUPPORTED_VERSIONS:
        return (
            f"requested API version {_go_quote(version)} is not supported by kubelet. "
            f"Supported version is {_go_quoted_list(SUPPORTED_VERSIONS)}"
        )
    if not is_extended_resource_name(resource_name):
        return f"the ResourceName {_go_quote(resource_name)} is invalid"
    return None
