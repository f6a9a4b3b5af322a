"""Identifiers and kubelet device IDs in fewer bytes, for body version 4 (``libs.store.compact``).

Every form is spelled back exactly, and each has an escape for values of another shape:

- an id of 32 lowercase hex digits (``alloc_id``, ``request_id``: ``uuid4().hex``), a UUID in its
  canonical 8-4-4-4-12 lowercase form (a pod UID) and a GPU UUID (``GPU-`` and such a UUID) are stored
  as their 16 bytes. Any other value is stored as its UTF-8 text, after a byte 0xff when the text is
  itself 16 bytes long (0xff never starts UTF-8, so the two cannot be confused): a field is packed when
  its stored value is exactly 16 bytes;
- kubelet vcore IDs (``tencent.com/vcuda-core-<n>``) in the kubelet's order as fixed-width numbers:
  one byte giving the width in bits (at least 8, so the padding of the last byte never holds a whole
  number), then the numbers, most significant bit first. The kubelet hands IDs in a scattered order;
  this keeps that order at ~9 bits an ID on a node of 4-5 GPUs, where a set (bitmap) and the order
  (a byte per ID) took ~14."""

from __future__ import annotations

import re

__all__ = [
    "gpu_text",
    "hex_text",
    "pack_gpu",
    "pack_hex",
    "pack_uuid",
    "pack_vcores",
    "unpack_vcores",
    "uuid_text",
]

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_ESCAPE = b"\xff"
_GPU = "GPU-"


def _escaped(text: str) -> bytes:
    raw = text.encode()
    return _ESCAPE + raw if len(raw) == 16 else raw


def _unescaped(raw: bytes) -> str:
    return (raw[1:] if raw[:1] == _ESCAPE else raw).decode()


def pack_hex(text: str) -> bytes:
    """32 lowercase hex digits as their 16 bytes; any other text escaped."""
    return bytes.fromhex(text) if _HEX32.match(text) else _escaped(text)


def hex_text(raw: bytes) -> str:
    return raw.hex() if len(raw) == 16 else _unescaped(raw)


def pack_uuid(text: str) -> bytes:
    """A canonical lowercase UUID as its 16 bytes; any other text escaped."""
    return bytes.fromhex(text.replace("-", "")) if _UUID.match(text) else _escaped(text)


def uuid_text(raw: bytes) -> str:
    if len(raw) != 16:
        return _unescaped(raw)
    return f"{raw[:4].hex()}-{raw[4:10].hex('-', 2)}-{raw[10:].hex()}"  # 8-4-4-4-12


def pack_gpu(text: str) -> bytes:
    """``GPU-<canonical UUID>`` as the UUID's 16 bytes; any other text (a MIG UUID...) escaped."""
    if text.startswith(_GPU) and _UUID.match(text[4:]):
        return bytes.fromhex(text[4:].replace("-", ""))
    return _escaped(text)


def gpu_text(raw: bytes) -> str:
    return _GPU + uuid_text(raw) if len(raw) == 16 else _unescaped(raw)


def pack_vcores(numbers: list[int]) -> bytes:
    """The numbers (>= 0) in their order, each in the same width; b"" for none."""
    if not numbers:
        return b""
    width = max(8, max(numbers).bit_length())
    value = 0
    for n in numbers:
        value = value << width | n
    bits = width * len(numbers)
    size = (bits + 7) // 8
    return bytes([width]) + (value << (size * 8 - bits)).to_bytes(size, "big")


def unpack_vcores(raw: bytes) -> list[int]:
    """The numbers ``pack_vcores`` stored, in their order."""
    if not raw:
        return []
    width, body = raw[0], raw[1:]
    if width < 8:
        raise ValueError(f"packed vcore IDs of width {width} (at least 8)")
    count = len(body) * 8 // width
    value = int.from_bytes(body, "big") >> (len(body) * 8 - count * width)
    mask = (1 << width) - 1
    return [value >> (width * (count - 1 - i)) & mask for i in range(count)]
