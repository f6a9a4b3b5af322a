"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

Strategic merge patch is applied as a plain merge patch. The difference only shows for lists with
merge keys (containers, conditions ...), which a merge patch replaces whole; patches of
labels/annotations/status fields behave the same.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError

__all__ = ["PATCH_TYPES", "apply_patch", "json_patch", "merge_patch"]

PATCH_TYPES = (
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/json-patch+json",
    "application/apply-patch+yaml",
)


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ApiError.bad_request(f"invalid JSON pointer {pointer!r}")
    return [_unescape(t) for t in pointer[1:].split("/")]


def _resolve(doc: Any, tokens: list[str]) -> Any:
    for token in tokens:
        if isinstance(doc, dict):
            if token not in doc:
                raise ApiError(422, "Invalid", f"missing path element {token!r}")
            doc = doc[token]
        elif isinstance(doc, list):
            try:
                doc = doc[int(token)]
            except (ValueError, IndexError):
                raise ApiError(422, "Invalid", f"invalid index {token!r}") from None
        else:
            raise ApiError(422, "Invalid", f"cannot descend into {token!r}")
    return doc


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            try:
                index = int(last)
            except ValueError:
                raise ApiError(422, "Invalid", f"invalid index {last!r}") from None
            if not 0 <= index <= len(parent):
                raise ApiError(422, "Invalid", f"index {index} out of range")
            parent.insert(index, value)
    else:
        raise ApiError(422, "Invalid", f"cannot add at {last!r}")
    return doc


def _remove(doc: Any, tokens: list[str]) -> tuple[Any, Any]:
    if not tokens:
        raise ApiError(422, "Invalid", "cannot remove the whole document")
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise ApiError(422, "Invalid", f"unable to remove nonexistent key: {last}")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        try:
            return doc, parent.pop(int(last))
        except (ValueError, IndexError):
            raise ApiError(422, "Invalid", f"invalid index {last!r}") from None
    raise ApiError(422, "Invalid", f"cannot remove {last!r}")


def json_patch(doc: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise ApiError.bad_request("a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError.bad_request(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], _split_pointer(op["path"])
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            _resolve(doc, path)  # must exist
            doc, _ = _remove(doc, path) if path else (doc, None)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = _split_pointer(op.get("from", ""))
            value = copy.deepcopy(_resolve(doc, source))
            if kind == "move":
                doc, _ = _remove(doc, source)
            doc = _add(doc, path, value)
        elif kind == "test":
            if _resolve(doc, path) != op.get("value"):
                raise ApiError(422, "Invalid", f"test operation failed at {op['path']!r}")
        else:
            raise ApiError.bad_request(f"unknown JSON patch operation {kind!r}")
    return doc


def apply_patch(doc: dict[str, Any], content_type: str, body: Any) -> dict[str, Any]:
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json-patch+json":
        result = json_patch(doc, body)
    elif media in PATCH_TYPES:
        if not isinstance(body, dict):
            raise ApiError.bad_request("a merge patch must be a JSON object")
        result = merge_patch(doc, body)
    else:
        raise ApiError.unsupported_media(content_type)
    if not isinstance(result, dict):
        raise ApiError(422, "Invalid", "the patch did not produce an object")
    return result
