"""The compact stored form of grants, imports, corrections and releases (body version 4 in the log's
``schema_v``; versions 3 and 2 are still read).

Body version 1 (still read) kept every grant's whole Allocate response and every kubelet device ID
as a string (a 90-core share carried 90 IDs): about 1.6 KB a grant. Version 2 keeps only what cannot be derived:

- no response: it is reproduced (``libs.placement.recorded.reproduce``) from the grant, the recorded
  ``ResponseSettings`` it names by digest (``settings``; the settings themselves are in the log's
  ``meta`` table under ``response-settings:<hex digest>``, checked against the digest when read) and
  two per-container facts (``compat32``, HAMi-core's ``cache`` file name). The writer reproduces each
  response before it stores the grant and keeps ``response`` itself when the two differ, so what a
  reader gets is always the response really sent;
- kubelet device IDs (``tencent.com/vcuda-core-<n>``) as a set, ascending runs ``ids`` = [start,
  count, ...] or a bitmap ``bits`` from ``ids`` = [first] (whichever is shorter), plus ``perm``, the
  position of each ID in ascending order when the kubelet's order was another (one byte each up to
  256 IDs). IDs of another form stay strings in ``device_ids``.

Version 2 bodies are msgpack maps with the event's own field names and its type tag. Version 3 bodies
(releases too) are msgpack arrays: no field names, no type tag (the row's ``type`` says it), the fields
a narrow view reads first, in the view's order (``libs.ledger.views`` decodes that prefix and skips the
rest), about half the bytes. Version 4 bodies are version 3's arrays with ids, pod UIDs and GPU UUIDs
as 16 bytes, shares as arrays, the kubelet's IDs in order as fixed-width numbers and release reasons by
number (see the classes below and ``libs.store.packed``). Every reader gets the full event back
(``expand``), of schema 1 as before: the rest of the code, the CLI and the NATS records see what they saw.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from libs.errors import CorruptLog
from libs.events.schema import (
    AllocationCorrected,
    AllocationGranted,
    AllocationImported,
    AllocationReleased,
    ContainerResponse,
    Event,
    GpuShare,
)
from libs.placement.recorded import ResponseSettings, reproduce
from libs.store.packed import gpu_text, hex_text, pack_gpu, pack_hex, pack_uuid, pack_vcores, unpack_vcores, uuid_text

__all__ = [
    "COMPACT_TYPES",
    "COMPACT_V",
    "COMPACT_V2",
    "COMPACT_V2_TYPES",
    "COMPACT_V3",
    "RELEASE_REASONS",
    "SETTINGS_PREFIX",
    "MetaSource",
    "PackedShare",
    "compact_body",
    "decode_compact",
    "decode_ids",
    "expand",
    "reason_text",
    "remember",
    "settings_row",
    "share_of",
]

SETTINGS_PREFIX = "response-settings:"
_EMPTY = b"\xff"  # an empty text in a packed field (packed.hex_text spells it "")
_VCORE = "tencent.com/vcuda-core-"
_VCORE_ID = re.escape(_VCORE) + "(?:0|[1-9][0-9]{0,17})"  # < 10**18: fits the bodies' 64-bit integers
_VCORE_IDS = re.compile(f"{_VCORE_ID}(?:,{_VCORE_ID})*")
_LIB32 = "/usr/local/nvidia/lib"


class _Grant(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True, tag_field="type",
             tag="alloc.granted"):
    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int
    init_container: bool = False
    cores: int
    memory: int
    shares: tuple[GpuShare, ...]
    core_limit: int | None = None
    ids: tuple[int, ...] = ()
    bits: bytes = b""
    perm: bytes | tuple[int, ...] = b""
    device_ids: tuple[str, ...] = ()
    settings: bytes = b""
    compat32: bool = False
    cache: str = ""
    response: ContainerResponse | None = None


class _Imported(_Grant, frozen=True, gc=False, kw_only=True, tag="alloc.imported"):
    source: str


class _Corrected(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True, tag_field="type",
                 tag="alloc.corrected"):
    alloc_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    container_index: int
    init_container: bool = False
    memory: int
    shares: tuple[GpuShare, ...]
    core_limit: int | None = None
    previous_pod_uid: str
    previous_container: str
    reason: str = "pod-resources"
    settings: bytes = b""
    compat32: bool = False
    cache: str = ""
    response: ContainerResponse | None = None


# Version 3: arrays. The first fields of each are those of its narrow view (libs/ledger/views.py: GrantView,
# ImportView, CorrectionView, ReleaseView), in the view's order (a test checks it); then the rest, the
# rarely set last: trailing fields at their default are not written (``_array``), a reader fills them in.
class _Grant3(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    cores: int
    memory: int
    shares: tuple[GpuShare, ...]
    init_container: bool = False
    core_limit: int | None = None
    ids: tuple[int, ...] = ()
    settings: bytes = b""
    container_index: int = 0
    bits: bytes = b""
    perm: bytes | tuple[int, ...] = b""
    compat32: bool = False
    cache: str = ""
    device_ids: tuple[str, ...] = ()
    response: ContainerResponse | None = None


class _Imported3(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: str
    request_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    cores: int
    memory: int
    shares: tuple[GpuShare, ...]
    init_container: bool = False
    core_limit: int | None = None
    source: str = ""
    ids: tuple[int, ...] = ()
    settings: bytes = b""
    container_index: int = 0
    bits: bytes = b""
    perm: bytes | tuple[int, ...] = b""
    compat32: bool = False
    cache: str = ""
    device_ids: tuple[str, ...] = ()
    response: ContainerResponse | None = None


class _Corrected3(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: str
    pod_uid: str
    namespace: str
    pod_name: str
    container: str
    memory: int
    shares: tuple[GpuShare, ...]
    previous_pod_uid: str
    previous_container: str
    init_container: bool = False
    core_limit: int | None = None
    reason: str = "pod-resources"
    settings: bytes = b""
    container_index: int = 0
    compat32: bool = False
    cache: str = ""
    response: ContainerResponse | None = None


class _Released3(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: str
    pod_uid: str
    container: str
    reason: str


# Version 4: version 3's arrays with the identifiers as bytes (``libs.store.packed``: ids and UUIDs as their
# 16 bytes, an escape for any other value), each share an array with its GPU UUID as bytes, and the
# kubelet's vcore IDs, in the kubelet's order, as fixed-width numbers (``vcores``) when that is shorter
# than version 3's set and order. The views read the same leading fields (libs/ledger/views.py: VIEWS_4).
class PackedShare(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A ``GpuShare`` in a version 4 body: the GPU's UUID packed (``packed.gpu_text`` spells it)."""

    index: int
    uuid: bytes
    minor: int
    cores: int
    memory: int


class _Grant4(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: bytes
    request_id: bytes
    pod_uid: bytes
    namespace: str
    pod_name: str
    container: str
    cores: int
    memory: int
    shares: tuple[PackedShare, ...]
    init_container: bool = False
    core_limit: int | None = None
    vcores: bytes = b""
    settings: bytes = b""
    container_index: int = 0
    ids: tuple[int, ...] = ()
    bits: bytes = b""
    perm: bytes | tuple[int, ...] = b""
    compat32: bool = False
    cache: str = ""
    device_ids: tuple[str, ...] = ()
    response: ContainerResponse | None = None


class _Imported4(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: bytes
    request_id: bytes
    pod_uid: bytes
    namespace: str
    pod_name: str
    container: str
    cores: int
    memory: int
    shares: tuple[PackedShare, ...]
    init_container: bool = False
    core_limit: int | None = None
    source: str = ""
    vcores: bytes = b""
    settings: bytes = b""
    container_index: int = 0
    ids: tuple[int, ...] = ()
    bits: bytes = b""
    perm: bytes | tuple[int, ...] = b""
    compat32: bool = False
    cache: str = ""
    device_ids: tuple[str, ...] = ()
    response: ContainerResponse | None = None


class _Corrected4(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: bytes
    pod_uid: bytes
    namespace: str
    pod_name: str
    container: str
    memory: int
    shares: tuple[PackedShare, ...]
    previous_pod_uid: bytes
    previous_container: str
    init_container: bool = False
    core_limit: int | None = None
    reason: str = "pod-resources"
    settings: bytes = b""
    container_index: int = 0
    compat32: bool = False
    cache: str = ""
    response: ContainerResponse | None = None


class _Released4(msgspec.Struct, frozen=True, gc=False, array_like=True):
    alloc_id: bytes
    pod_uid: bytes
    container: str
    reason: int | str  # its position in RELEASE_REASONS, or the text of another


RELEASE_REASONS = ("deleted", "succeeded", "failed", "terminated", "holder gone at allocate", "prestart-check-failed")
"""The reasons the allocator and the watchdog release for, stored in version 4 by their position: append
only (a stored number must keep its meaning)."""
_REASON_CODE = {reason: i for i, reason in enumerate(RELEASE_REASONS)}


def reason_text(reason: int | str) -> str:
    """A version 4 release's reason as text."""
    if type(reason) is str:
        return reason
    if not 0 <= reason < len(RELEASE_REASONS):  # type: ignore[operator]
        raise ValueError(f"release reason number {reason} is not one this gpuledger knows")
    return RELEASE_REASONS[reason]  # type: ignore[index]


COMPACT_V = 4
"""The ``schema_v`` of a compact body as written now. The event's fields, and so its JSON record (``schema``
1), are the same as before: only the stored form changed, so the body version is the log's, not the record's."""
COMPACT_TYPES = frozenset({"alloc.granted", "alloc.imported", "alloc.corrected", "alloc.released"})
COMPACT_V3 = 3
"""Version 3 (arrays of text ids, still read; written again only where a copy must give an old row's hash back)."""
COMPACT_V2 = 2
"""Version 2 (maps, still read; written again only where a copy must give an old row's hash back)."""
COMPACT_V2_TYPES = frozenset({"alloc.granted", "alloc.imported", "alloc.corrected"})
BODIES_3: dict[str, type[msgspec.Struct]] = {"alloc.granted": _Grant3, "alloc.imported": _Imported3,
                                             "alloc.corrected": _Corrected3, "alloc.released": _Released3}
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Grant | _Imported | _Corrected).decode
BODIES_4: dict[str, type[msgspec.Struct]] = {"alloc.granted": _Grant4, "alloc.imported": _Imported4,
                                             "alloc.corrected": _Corrected4, "alloc.released": _Released4}
_DEFAULTS = {cls: tuple(f.default for f in msgspec.structs.fields(cls))
             for cls in (*BODIES_3.values(), *BODIES_4.values())}
_DECODE_ARRAYS = {(name, COMPACT_V3): msgspec.msgpack.Decoder(cls).decode for name, cls in BODIES_3.items()}
_DECODE_ARRAYS.update({(name, COMPACT_V): msgspec.msgpack.Decoder(cls).decode for name, cls in BODIES_4.items()})

# --- kubelet device IDs ---


def vcore_numbers(device_ids: tuple[str, ...]) -> list[int] | None:
    """The numbers N of IDs that are all ``tencent.com/vcuda-core-N`` (N in plain ASCII decimal, as
    we advertise them, below 10**18: spelled back, each is the same string); None when one is of
    another form."""
    if not device_ids:
        return []
    joined = ",".join(device_ids)  # one match for all: the IDs of a 90-core grant cost one call
    if joined.count(",") != len(device_ids) - 1 or _VCORE_IDS.fullmatch(joined) is None:
        return None
    cut = len(_VCORE)
    return [int(d[cut:]) for d in device_ids]


def _encode_numbers(nums: list[int]) -> dict[str, object] | None:
    """The set is ``ids`` = ascending runs [start, count, ...] or, when shorter (the kubelet picks IDs
    scattered over the free ones), ``bits`` = [first, bitmap from first]; ``perm`` keeps the kubelet's
    order (the position of each ID in ascending order) when it was not ascending. None for repeats."""
    ordered = sorted(nums)
    if len(set(ordered)) != len(ordered):
        return None
    runs: list[int] = []
    for n in ordered:
        if runs and runs[-2] + runs[-1] == n:
            runs[-1] += 1
        else:
            runs += [n, 1]
    found: dict[str, object] = {"ids": tuple(runs)}
    if ordered and (ordered[-1] - ordered[0]) // 8 + 4 < len(runs) * 2:
        first, bitmap = ordered[0], bytearray((ordered[-1] - ordered[0]) // 8 + 1)
        for n in ordered:
            bitmap[(n - first) >> 3] |= 1 << ((n - first) & 7)
        found = {"ids": (first,), "bits": bytes(bitmap)}
    if nums != ordered:
        rank = {n: i for i, n in enumerate(ordered)}
        positions = [rank[n] for n in nums]
        found["perm"] = bytes(positions) if len(positions) <= 256 else tuple(positions)
    return found


_BIT_OFFSETS = [tuple(i for i in range(8) if byte >> i & 1) for byte in range(256)]


_ID_TEXT: list[str] = []  # the ID strings, made once per process: a replay spells out millions of IDs
_ID_TEXT_MAX = 1 << 16  # numbers past this (never on a real node: 100 per GPU) are spelled one by one


class _SpelledIds:
    """IDs past the cache, spelled on each use, indexed like the cache (by number or slice): an odd ID
    in an import must not make every reader of its row build a list that long."""

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return [f"{_VCORE}{n}" for n in range(key.start, key.stop)]
        return f"{_VCORE}{key}"


_SPELLED_IDS = _SpelledIds()


def _id_texts(upto: int) -> Any:
    """The ID texts of numbers below ``upto``: the cache, grown as needed, or past it ``_SPELLED_IDS``."""
    if upto > _ID_TEXT_MAX:
        return _SPELLED_IDS
    if upto > len(_ID_TEXT):
        _ID_TEXT.extend(f"{_VCORE}{i}" for i in range(len(_ID_TEXT), max(upto, min(2 * len(_ID_TEXT), _ID_TEXT_MAX),
                                                                          1024)))
    return _ID_TEXT


def decode_ids(runs: tuple[int, ...], perm: bytes | tuple[int, ...], bits: bytes = b"") -> tuple[str, ...]:
    if not runs:
        return ()  # an import without the kubelet's checkpoint
    if bits:
        first = runs[0]
        texts = _id_texts(first + 8 * len(bits))
        ordered = [texts[first + (k << 3) + i] for k, byte in enumerate(bits) for i in _BIT_OFFSETS[byte]]
    elif len(runs) == 2:
        start, count = runs
        ordered = _id_texts(start + count)[start:start + count]
    else:
        pairs = list(zip(runs[::2], runs[1::2], strict=True))
        texts = _id_texts(max(s + c for s, c in pairs))
        ordered = [t for s, c in pairs for t in texts[s:s + c]]
    if not perm:
        return tuple(ordered)
    return tuple([ordered[i] for i in perm])


# --- recorded settings ---

_KNOWN: dict[bytes, ResponseSettings] = {}
MetaSource = sqlite3.Connection | Path | None
"""Where to read a ``response-settings:`` entry this process has not seen: the log's connection or path."""


def remember(settings: ResponseSettings) -> bytes:
    """Know ``settings`` in this process (a digest -> settings map is the same in every log); its digest."""
    digest = settings.digest
    _KNOWN[digest] = settings
    return digest


def settings_row(settings: ResponseSettings) -> tuple[str, str]:
    """The ``meta`` row (key, value) that records ``settings``."""
    return SETTINGS_PREFIX + settings.digest.hex(), msgspec.json.encode(settings).decode()


def _settings(digest: bytes, source: MetaSource, seq: int) -> ResponseSettings:
    known = _KNOWN.get(digest)
    if known is not None:
        return known
    key = SETTINGS_PREFIX + digest.hex()
    if source is None:
        raise CorruptLog(seq, f"the response settings {digest.hex()} are not known here (no log to read them from)")
    conn = sqlite3.connect(f"file:{source}?mode=ro", uri=True) if isinstance(source, Path) else source
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    finally:
        if isinstance(source, Path):
            conn.close()
    if row is None:
        raise CorruptLog(seq, f"the log's meta table lacks {key}: the responses of grants naming it cannot be "
                              "reproduced (a row removed from meta, or a log assembled from parts)")
    try:
        found = msgspec.json.decode(row[0], type=ResponseSettings)
    except msgspec.MsgspecError as exc:
        raise CorruptLog(seq, f"meta {key} is not readable: {exc}") from exc
    if found.digest != digest:
        raise CorruptLog(seq, f"meta {key} does not match its digest: the recorded response settings were edited")
    _KNOWN[digest] = found
    return found


# --- bodies ---


def _facts(response: ContainerResponse) -> tuple[bool, str]:
    """compat32 and the HAMi-core cache file name, read back from the response that was built."""
    compat32 = response.envs.get("LD_LIBRARY_PATH") == _LIB32
    cache = response.envs.get("CUDA_DEVICE_MEMORY_SHARED_CACHE", "")
    token = cache.rsplit("/", 1)[-1].removesuffix(".cache") if cache else ""
    return compat32, token


def compact_body(event: Event, settings: ResponseSettings | None, version: int = COMPACT_V,
                 command_id: str | None = None) -> bytes | None:
    """The compact body (of ``version``: 4, 3 or 2) of a grant, import, correction or (3 and 4) release;
    None for other types (subtypes included: a ``claim.prepared`` is a grant by inheritance but has its
    own schema, and is stored whole). ``command_id``: the row's; a version 4 grant whose request id is
    the same leaves it out (b"": the reader takes the row's)."""
    tag = type(event).__struct_config__.tag
    if tag not in (COMPACT_V2_TYPES if version == COMPACT_V2 else COMPACT_TYPES):
        return None
    body: msgspec.Struct
    if isinstance(event, AllocationGranted):
        body = _grant_body(event, settings, version, command_id)
    elif isinstance(event, AllocationCorrected):
        body = _corrected_body(event, settings, version)
    elif isinstance(event, AllocationReleased):
        body = (_Released4(alloc_id=pack_hex(event.alloc_id), pod_uid=pack_uuid(event.pod_uid),
                           container=event.container, reason=_REASON_CODE.get(event.reason, event.reason))
                if version == COMPACT_V else
                _Released3(alloc_id=event.alloc_id, pod_uid=event.pod_uid, container=event.container,
                           reason=event.reason))
    else:
        return None
    return _encode(body if version == COMPACT_V2 else _array(body))


def _array(body: msgspec.Struct) -> tuple[object, ...]:
    """An array body's fields without the trailing ones at their default (decoding gives them back)."""
    values, defaults = msgspec.structs.astuple(body), _DEFAULTS[type(body)]
    end = len(values)
    while end and values[end - 1] == defaults[end - 1]:
        end -= 1
    return values[:end]


def _response_part(event: AllocationGranted | AllocationCorrected, cores: int,
                   settings: ResponseSettings | None) -> dict[str, object]:
    if settings is None:
        return {"response": event.response}
    compat32, cache = _facts(event.response)
    again = reproduce(settings, shares=event.shares, cores=cores, memory=event.memory, pod_uid=event.pod_uid,
                      container=event.container, compat32=compat32, cache_token=cache)
    if again != event.response:
        return {"response": event.response}  # built some other way: kept as it was sent
    return {"settings": remember(settings), "compat32": compat32, "cache": cache}


def _packed_shares(shares: tuple[GpuShare, ...]) -> tuple[PackedShare, ...]:
    return tuple(PackedShare(index=s.index, uuid=pack_gpu(s.uuid), minor=s.minor, cores=s.cores, memory=s.memory)
                 for s in shares)


def share_of(s: PackedShare) -> GpuShare:
    """The ``GpuShare`` a version 4 body's share stands for."""
    return GpuShare(index=s.index, uuid=gpu_text(s.uuid), minor=s.minor, cores=s.cores, memory=s.memory)


def _ids_part(device_ids: tuple[str, ...], version: int) -> dict[str, object]:
    """The body fields of the kubelet's device IDs: version 3's set and order (``_encode_numbers``), or in
    version 4 the numbers in order (``vcores``) where that is shorter; the strings when not vcore IDs."""
    numbers = vcore_numbers(device_ids)
    coded = None if numbers is None else _encode_numbers(numbers)
    if coded is None:
        return {"device_ids": device_ids}
    if version != COMPACT_V or not numbers:
        return coded
    vcores = pack_vcores(numbers)
    return {"vcores": vcores} if len(vcores) < len(_encode(coded)) else coded


def _grant_body(ev: AllocationGranted, settings: ResponseSettings | None, version: int,
                command_id: str | None) -> msgspec.Struct:
    common = dict(namespace=ev.namespace, pod_name=ev.pod_name, container=ev.container,
                  container_index=ev.container_index, init_container=ev.init_container, cores=ev.cores,
                  memory=ev.memory, core_limit=ev.core_limit, **_ids_part(ev.device_ids, version),
                  **_response_part(ev, ev.cores, settings))
    imported = isinstance(ev, AllocationImported)
    if version == COMPACT_V:
        cls4 = _Imported4 if imported else _Grant4
        more = {"source": ev.source} if imported else {}  # type: ignore[attr-defined]
        # b"": the row's command_id; an empty request id of another row is stored as the escape alone
        request_id = b"" if ev.request_id == command_id else pack_hex(ev.request_id) or _EMPTY
        return cls4(alloc_id=pack_hex(ev.alloc_id), request_id=request_id,  # type: ignore[arg-type]
                    pod_uid=pack_uuid(ev.pod_uid), shares=_packed_shares(ev.shares), **common, **more)
    common.update(alloc_id=ev.alloc_id, request_id=ev.request_id, pod_uid=ev.pod_uid, shares=ev.shares)
    cls = (_Imported3 if imported else _Grant3) if version == COMPACT_V3 else (_Imported if imported else _Grant)
    if imported:
        return cls(**common, source=ev.source)  # type: ignore[arg-type, attr-defined]
    return cls(**common)  # type: ignore[arg-type]


def _corrected_body(ev: AllocationCorrected, settings: ResponseSettings | None, version: int) -> msgspec.Struct:
    common = dict(namespace=ev.namespace, pod_name=ev.pod_name, container=ev.container,
                  container_index=ev.container_index, init_container=ev.init_container, memory=ev.memory,
                  core_limit=ev.core_limit, previous_container=ev.previous_container, reason=ev.reason,
                  **_response_part(ev, _cores_of(ev.shares), settings))
    if version == COMPACT_V:
        return _Corrected4(alloc_id=pack_hex(ev.alloc_id), pod_uid=pack_uuid(ev.pod_uid),  # type: ignore[arg-type]
                           shares=_packed_shares(ev.shares), previous_pod_uid=pack_uuid(ev.previous_pod_uid),
                           **common)
    return (_Corrected3 if version == COMPACT_V3 else _Corrected)(  # type: ignore[arg-type]
        alloc_id=ev.alloc_id, pod_uid=ev.pod_uid, shares=ev.shares, previous_pod_uid=ev.previous_pod_uid, **common)


def decode_compact(type_name: str, schema_v: int, body: bytes, *, seq: int = 0) -> msgspec.Struct:
    """The stored form of a compact body (version 2, 3 or 4), as it is in the log."""
    try:
        if schema_v == COMPACT_V2:
            return _decode(body)
        return _DECODE_ARRAYS[(type_name, schema_v)](body)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptLog(seq, f"compact body of {type_name} (version {schema_v}): {exc}") from exc


def expand(type_name: str, schema_v: int, body: bytes, source: MetaSource, *, seq: int = 0,
           command_id: str | None = None) -> AllocationGranted | AllocationCorrected | AllocationReleased:
    """The full event of a compact body (its response reproduced, its device IDs spelled out);
    ``command_id``: the row's (a version 4 grant's request id when the body leaves it out)."""
    b = decode_compact(type_name, schema_v, body, seq=seq)
    try:
        if schema_v == COMPACT_V:
            return _expand_4(b, source, seq, command_id)  # type: ignore[arg-type]
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptLog(seq, f"compact body of {type_name} (version {schema_v}): {exc}") from exc
    if isinstance(b, _Released3):
        return AllocationReleased(alloc_id=b.alloc_id, pod_uid=b.pod_uid, container=b.container, reason=b.reason)
    if isinstance(b, _Corrected | _Corrected3):
        return AllocationCorrected(
            alloc_id=b.alloc_id, pod_uid=b.pod_uid, namespace=b.namespace, pod_name=b.pod_name,
            container=b.container, container_index=b.container_index, init_container=b.init_container,
            memory=b.memory, shares=b.shares, core_limit=b.core_limit,
            response=b.response or _reproduced(b, b.pod_uid, b.shares, _cores_of(b.shares), source, seq),
            previous_pod_uid=b.previous_pod_uid, previous_container=b.previous_container, reason=b.reason,
        )
    assert isinstance(b, _Grant | _Imported | _Grant3 | _Imported3)
    response = b.response or _reproduced(b, b.pod_uid, b.shares, b.cores, source, seq)
    device_ids = b.device_ids or decode_ids(b.ids, b.perm, b.bits)
    fields = dict(alloc_id=b.alloc_id, request_id=b.request_id, pod_uid=b.pod_uid, namespace=b.namespace,
                  pod_name=b.pod_name, container=b.container, container_index=b.container_index,
                  init_container=b.init_container, cores=b.cores, memory=b.memory, device_ids=device_ids,
                  shares=b.shares, core_limit=b.core_limit, response=response)
    if isinstance(b, _Imported | _Imported3):
        return AllocationImported(**fields, source=b.source)  # type: ignore[arg-type]
    return AllocationGranted(**fields)  # type: ignore[arg-type]


def _expand_4(b: _Grant4 | _Imported4 | _Corrected4 | _Released4, source: MetaSource, seq: int,
              command_id: str | None) -> AllocationGranted | AllocationCorrected | AllocationReleased:
    pod_uid = uuid_text(b.pod_uid)
    if isinstance(b, _Released4):
        return AllocationReleased(alloc_id=hex_text(b.alloc_id), pod_uid=pod_uid, container=b.container,
                                  reason=reason_text(b.reason))
    shares = tuple(share_of(s) for s in b.shares)
    if isinstance(b, _Corrected4):
        return AllocationCorrected(
            alloc_id=hex_text(b.alloc_id), pod_uid=pod_uid, namespace=b.namespace, pod_name=b.pod_name,
            container=b.container, container_index=b.container_index, init_container=b.init_container,
            memory=b.memory, shares=shares, core_limit=b.core_limit,
            response=b.response or _reproduced(b, pod_uid, shares, _cores_of(shares), source, seq),
            previous_pod_uid=uuid_text(b.previous_pod_uid), previous_container=b.previous_container,
            reason=b.reason,
        )
    if b.vcores:
        numbers = unpack_vcores(b.vcores)
        texts = _id_texts(max(numbers) + 1)
        device_ids = tuple([texts[n] for n in numbers])
    else:
        device_ids = b.device_ids or decode_ids(b.ids, b.perm, b.bits)
    if not b.request_id and command_id is None:
        raise CorruptLog(seq, "a grant whose request id is the row's command_id, in a row without one")
    request_id = hex_text(b.request_id) if b.request_id else command_id
    fields = dict(alloc_id=hex_text(b.alloc_id), request_id=request_id, pod_uid=pod_uid,
                  namespace=b.namespace, pod_name=b.pod_name, container=b.container,
                  container_index=b.container_index, init_container=b.init_container, cores=b.cores,
                  memory=b.memory, device_ids=device_ids, shares=shares, core_limit=b.core_limit,
                  response=b.response or _reproduced(b, pod_uid, shares, b.cores, source, seq))
    if isinstance(b, _Imported4):
        return AllocationImported(**fields, source=b.source)  # type: ignore[arg-type]
    return AllocationGranted(**fields)  # type: ignore[arg-type]


def _reproduced(b: msgspec.Struct, pod_uid: str, shares: tuple[GpuShare, ...], cores: int, source: MetaSource,
                seq: int) -> ContainerResponse:
    if not b.settings:  # type: ignore[attr-defined]
        raise CorruptLog(seq, "a compact body with neither a response nor the settings to reproduce it")
    settings = _settings(b.settings, source, seq)  # type: ignore[attr-defined]
    return reproduce(settings, shares=shares, cores=cores, memory=b.memory, pod_uid=pod_uid,  # type: ignore[attr-defined]
                     container=b.container, compat32=b.compat32, cache_token=b.cache)  # type: ignore[attr-defined]


def _cores_of(shares: tuple[GpuShare, ...]) -> int:
    """A correction keeps the grant's cores, which it does not repeat: a share's own, or 100 per whole GPU."""
    return sum(s.cores for s in shares)
