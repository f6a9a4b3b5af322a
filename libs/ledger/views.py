"""Narrow views of the events that change holdings, for the readers that must be fast.

An audit needs much less than ``LedgerState`` keeps, and replaying a million events must stay under
two seconds, so the audit replay (``holdings``) and the timelines (``timeline``) read these views:
msgspec decodes only the fields listed below and skips the rest of each body (the stored response,
the kubelet device IDs) without building objects for it. Each view takes its fields, names and
types, from its event type in ``libs.events.schema`` (a test checks it); a view has the event's tag,
so the same bytes decode as either.

``iter_views`` reads them from the log; types without a view (and rows of an older schema version)
come as a full ``StoredEvent``, which ``view_of`` turns into a view where there is one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import TypeVar

import msgspec

from libs.events.codec import StoredEvent
from libs.events.schema import (
    EVENT_TYPES,
    AllocationCorrected,
    AllocationGranted,
    AllocationImported,
    AllocationReleased,
    ClaimPrepared,
    ClaimUnprepared,
    GpuHealthChanged,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.ledger.rules import health_reason
from libs.store.compact import COMPACT_V, COMPACT_V2, COMPACT_V2_TYPES, COMPACT_V3, PackedShare, reason_text, share_of
from libs.store.packed import hex_text, uuid_text
from libs.store.replay import LogReader, iter_row_chunks, stored_at

__all__ = [
    "VIEWS",
    "ClaimPreparedView",
    "ClaimUnpreparedView",
    "CorrectionView",
    "GrantView",
    "HealthView",
    "ImportView",
    "InventoryView",
    "ReleaseView",
    "View",
    "id_text",
    "iter_views",
    "plain",
    "request_id_in_row",
    "uid_text",
    "view_of",
    "view_tag",
]


class GrantView(msgspec.Struct, frozen=True, gc=False, tag="alloc.granted"):
    """An ``AllocationGranted`` without its response and kubelet device IDs."""

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


class ImportView(GrantView, frozen=True, gc=False, tag="alloc.imported"):
    """An ``AllocationImported``: a grant taken over from gpu-manager's checkpoint."""

    source: str = ""


class ReleaseView(msgspec.Struct, frozen=True, gc=False, tag="alloc.released"):
    alloc_id: str
    pod_uid: str
    container: str
    reason: str


class ClaimPreparedView(GrantView, frozen=True, gc=False, tag="claim.prepared"):
    """A ``ClaimPrepared``: a DRA claim's grant, with the claim it is for."""

    claim_uid: str = ""
    claim_namespace: str = ""
    claim_name: str = ""


class ClaimUnpreparedView(ReleaseView, frozen=True, gc=False, tag="claim.unprepared"):
    claim_uid: str = ""


class InventoryView(msgspec.Struct, frozen=True, gc=False, tag="inventory.recorded"):
    node: str
    gpus: tuple[GpuInfo, ...]


class CorrectionView(msgspec.Struct, frozen=True, gc=False, tag="alloc.corrected"):
    """An ``AllocationCorrected`` without the response and the container index."""

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


class HealthView(msgspec.Struct, frozen=True, gc=False, tag="gpu.health"):
    index: int
    uuid: str
    healthy: bool
    reason: str
    xid: int = 0
    detail: str = ""

    @property
    def why(self) -> str:
        """Why the GPU is unhealthy, as ``GpuUsage.health_reason`` spells it ("" when healthy)."""
        return health_reason(self)


# Each view next to the event type it is read from (the test of the views walks this).
VIEWS: dict[type[msgspec.Struct], type[msgspec.Struct]] = {
    GrantView: AllocationGranted,
    ImportView: AllocationImported,
    ClaimPreparedView: ClaimPrepared,
    ReleaseView: AllocationReleased,
    ClaimUnpreparedView: ClaimUnprepared,
    InventoryView: InventoryRecorded,
    CorrectionView: AllocationCorrected,
    HealthView: GpuHealthChanged,
}
_VIEW_TAGS = {cls.__struct_config__.tag for cls in VIEWS}
_decode_view = msgspec.msgpack.Decoder(
    GrantView | ImportView | ClaimPreparedView | ReleaseView | ClaimUnpreparedView | InventoryView | CorrectionView
    | HealthView).decode

View = GrantView | ReleaseView | InventoryView | CorrectionView | HealthView
T = TypeVar("T")


# The views of version 3 compact bodies (arrays, libs/store/compact.py): the same views, decoded from the
# array's first fields (the body puts them first, in the view's order), without a type tag.
class _GrantView3(GrantView, frozen=True, gc=False, array_like=True, tag=False):
    pass


class _ImportView3(ImportView, frozen=True, gc=False, array_like=True, tag=False):
    pass


class _CorrectionView3(CorrectionView, frozen=True, gc=False, array_like=True, tag=False):
    pass


class _ReleaseView3(ReleaseView, frozen=True, gc=False, array_like=True, tag=False):
    pass


VIEWS_3: dict[str, type[msgspec.Struct]] = {"alloc.granted": _GrantView3, "alloc.imported": _ImportView3,
                                            "alloc.corrected": _CorrectionView3, "alloc.released": _ReleaseView3}


# The views of version 4 bodies: version 3's, with the identifiers as the body stores them (bytes:
# ``libs.store.packed``) and each share a ``PackedShare``; decoding them costs what version 3's did. The
# audit fold keys on them as they are; ``plain`` spells a view out (text ids, ``GpuShare``) for output.
class _GrantView4(GrantView, frozen=True, gc=False, array_like=True, tag=False):
    alloc_id: bytes  # type: ignore[assignment]
    request_id: bytes  # type: ignore[assignment]
    pod_uid: bytes  # type: ignore[assignment]
    shares: tuple[PackedShare, ...]  # type: ignore[assignment]


class _ImportView4(ImportView, frozen=True, gc=False, array_like=True, tag=False):
    alloc_id: bytes  # type: ignore[assignment]
    request_id: bytes  # type: ignore[assignment]
    pod_uid: bytes  # type: ignore[assignment]
    shares: tuple[PackedShare, ...]  # type: ignore[assignment]


class _CorrectionView4(CorrectionView, frozen=True, gc=False, array_like=True, tag=False):
    alloc_id: bytes  # type: ignore[assignment]
    pod_uid: bytes  # type: ignore[assignment]
    shares: tuple[PackedShare, ...]  # type: ignore[assignment]
    previous_pod_uid: bytes  # type: ignore[assignment]


class _ReleaseView4(ReleaseView, frozen=True, gc=False, array_like=True, tag=False):
    alloc_id: bytes  # type: ignore[assignment]
    pod_uid: bytes  # type: ignore[assignment]
    reason: int | str  # type: ignore[assignment]


VIEWS_4: dict[str, type[msgspec.Struct]] = {"alloc.granted": _GrantView4, "alloc.imported": _ImportView4,
                                            "alloc.corrected": _CorrectionView4, "alloc.released": _ReleaseView4}
_BASES = {cls: cls.__mro__[1] for cls in VIEWS_4.values()}
_SPELL = {"alloc_id": hex_text, "request_id": hex_text, "pod_uid": uuid_text, "previous_pod_uid": uuid_text}


def id_text(raw: str | bytes) -> str:
    """An alloc or request id as text, whatever the body version (as ``plain`` spells it)."""
    return hex_text(raw) if type(raw) is bytes else raw


def uid_text(raw: str | bytes) -> str:
    """A pod UID as text, whatever the body version (as ``plain`` spells it)."""
    return uuid_text(raw) if type(raw) is bytes else raw


def plain(view: T) -> T:
    """``view`` with its identifiers as text and its shares as ``GpuShare`` (a version 4 view as its base
    view); itself when it has nothing packed. The fold keeps a version 4 view as decoded and spells
    out only what it prints."""
    if not isinstance(view, GrantView | CorrectionView | ReleaseView):
        return view
    # a version 3 view may hold packed values too: a grant of version 3 that a correction of version 4 moved
    cls = _BASES.get(type(view), type(view))
    fields = {f: getattr(view, f) for f in cls.__struct_fields__}
    changed = cls is not type(view)
    for name, spell in _SPELL.items():
        if type(value := fields.get(name)) is bytes:
            fields[name], changed = spell(value), True
    if type(reason := fields.get("reason")) is int:
        fields["reason"], changed = reason_text(reason), True
    shares = fields.get("shares")
    if shares and type(shares[0]) is PackedShare:
        fields["shares"], changed = tuple(share_of(s) for s in shares), True
    return cls(**fields) if changed else view  # type: ignore[return-value]


def request_id_in_row(view: object) -> bool:
    """Whether a grant's view leaves its request id to the row (a version 4 body whose request id is the
    row's ``command_id``): the reader that prints it takes the row's."""
    rid = getattr(view, "request_id", None)
    return type(rid) is bytes and not rid


def view_tag(view: msgspec.Struct) -> str:
    """The event type a view was read from (a version 3 view has no tag of its own: its class's base's)."""
    cls = type(view)
    tag = cls.__struct_config__.tag
    return tag if isinstance(tag, str) else cls.__mro__[1].__struct_config__.tag  # type: ignore[attr-defined]


def _view_decoders() -> dict[tuple[str, int], object]:
    """(type, body version) -> the decoder of its view, for every stored form a view reads."""
    found: dict[tuple[str, int], object] = {
        (tag, EVENT_TYPES[tag].SCHEMA): _decode_view for tag in _VIEW_TAGS if tag in EVENT_TYPES}
    found.update({(tag, COMPACT_V2): _decode_view for tag in COMPACT_V2_TYPES})  # maps with the viewed names
    found.update({(tag, COMPACT_V3): msgspec.msgpack.Decoder(cls).decode for tag, cls in VIEWS_3.items()})
    found.update({(tag, COMPACT_V): msgspec.msgpack.Decoder(cls).decode for tag, cls in VIEWS_4.items()})
    return found


VIEW_DECODERS = _view_decoders()


def iter_views(
    conn: sqlite3.Connection, *, after_seq: int = 0, upto_seq: int | None = None
) -> Iterator[tuple[int, int, View | StoredEvent]]:
    """(seq, recorded_at, view) in seq order; types without a view come as a full ``StoredEvent``."""
    # Only the columns the views need: each extra column costs ~10% of the scan. The rare row that
    # needs the full decode (an old schema version, a type without a view) is read again by seq.
    # Types are looked up by what the row stores: a log reader's live format 2 rows an id, named here
    # once, not in each row; archived rows and any other connection's ``events`` the name itself.
    # A type added after this read has no entry: its rows take the full decode below, as correct.
    decoders: dict[tuple[int | str, int], object] = dict(VIEW_DECODERS)
    if isinstance(conn, LogReader):
        for type_id, name in conn.layout.type_names(conn).items():
            decoders.update({(type_id, v): decode for (n, v), decode in VIEW_DECODERS.items() if n == name})
    for rows in iter_row_chunks(
        conn, "seq, recorded_at, type_code, schema_v, payload", after_seq=after_seq, upto_seq=upto_seq
    ):
        for seq, at, type_code, schema_v, payload in rows:
            decode = decoders.get((type_code, schema_v))
            if decode is not None:
                yield seq, at, decode(payload)  # type: ignore[operator]
            else:
                stored = stored_at(conn, seq)
                assert stored is not None  # the row was just read
                yield seq, at, stored


def _grant_view(ev: AllocationGranted) -> GrantView:
    """The view of a grant read on the full path (an older schema version, upcast)."""
    fields = {f: getattr(ev, f) for f in GrantView.__struct_fields__}
    if isinstance(ev, AllocationImported):
        return ImportView(**fields, source=ev.source)
    if isinstance(ev, ClaimPrepared):
        return ClaimPreparedView(**fields, claim_uid=ev.claim_uid, claim_namespace=ev.claim_namespace,
                                 claim_name=ev.claim_name)
    return GrantView(**fields)


def view_of(stored: StoredEvent) -> View | StoredEvent:
    """The view of a fully decoded event, or the event itself when its type has no view."""
    ev = stored.event
    if isinstance(ev, AllocationGranted):
        return _grant_view(ev)
    if isinstance(ev, ClaimUnprepared):
        return ClaimUnpreparedView(alloc_id=ev.alloc_id, pod_uid=ev.pod_uid, container=ev.container,
                                   reason=ev.reason, claim_uid=ev.claim_uid)
    if isinstance(ev, AllocationReleased):
        return ReleaseView(alloc_id=ev.alloc_id, pod_uid=ev.pod_uid, container=ev.container, reason=ev.reason)
    if isinstance(ev, InventoryRecorded):
        return InventoryView(node=ev.node, gpus=ev.gpus)
    if isinstance(ev, AllocationCorrected):
        return CorrectionView(**{f: getattr(ev, f) for f in CorrectionView.__struct_fields__})
    if isinstance(ev, GpuHealthChanged):
        return HealthView(**{f: getattr(ev, f) for f in HealthView.__struct_fields__})
    return stored
