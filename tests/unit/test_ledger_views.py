"""The audit views (``libs.ledger.views``) are narrow readings of the events: each view's fields must
be fields of its event type, with the same names and types, and the same tag, so that the bytes of a
stored event decode as its view."""

from __future__ import annotations

import msgspec
import pytest

from libs.events.codec import StoredEvent, encode_body
from libs.events.schema import EVENT_TYPES, AllocationGranted, AllocationReleased, ContainerResponse, GpuShare
from libs.ledger.views import VIEW_DECODERS, VIEWS, VIEWS_3, VIEWS_4, plain, view_of
from libs.store.compact import BODIES_3, BODIES_4, COMPACT_V, COMPACT_V2, COMPACT_V3, compact_body, expand


@pytest.mark.parametrize("view", list(VIEWS), ids=lambda v: v.__name__)
def test_each_view_reads_fields_of_its_event(view: type[msgspec.Struct]) -> None:
    event = VIEWS[view]
    assert view.__struct_config__.tag == event.__struct_config__.tag
    assert EVENT_TYPES[event.__struct_config__.tag] is event
    full = {f.name: f.type for f in msgspec.structs.fields(event)}
    for field in msgspec.structs.fields(view):
        assert field.name in full, f"{view.__name__}.{field.name} is not a field of {event.__name__}"
        assert field.type == full[field.name], (
            f"{view.__name__}.{field.name} is {field.type}, {event.__name__}'s is {full[field.name]}")


def test_every_event_with_a_view_is_listed_once() -> None:
    tags = [v.__struct_config__.tag for v in VIEWS]
    assert len(tags) == len(set(tags))
    assert set(VIEWS.values()) <= set(EVENT_TYPES.values())


@pytest.mark.parametrize(("version", "tag"), [(3, t) for t in BODIES_3] + [(4, t) for t in BODIES_4])
def test_an_array_body_starts_with_its_view(version: int, tag: str) -> None:
    """A version 3 or 4 body (an array) decodes as its view only if the view's fields come first, in its
    order, with the same types."""
    view, body = (VIEWS_3, BODIES_3) if version == 3 else (VIEWS_4, BODIES_4)
    view, body = view[tag], body[tag]
    viewed = [(f.name, f.type) for f in msgspec.structs.fields(view)]
    assert [(f.name, f.type) for f in msgspec.structs.fields(body)][:len(viewed)] == viewed
    assert view.__struct_config__.array_like and body.__struct_config__.array_like


# Ids of the usual shapes (packed in version 4) and of others (kept as text there), 16 bytes long included.
_IDS = [("a1", "r1", "u1", "GPU-1"),
        ("0123456789abcdef" * 2, "fedcba9876543210" * 2, "a48bacd1-2648-4203-87e9-66c534c40e8c",
         "GPU-c5a438ad-b219-54fc-a1ab-92abbc41c347"),
        ("sixteen-bytes-id", "SIXTEEN-BYTES-ID", "pod-uid-16-bytes", "MIG-16-bytes-xyz")]


@pytest.mark.parametrize(("alloc_id", "request_id", "pod_uid", "gpu"), _IDS)
def test_the_views_read_each_stored_form_of_a_grant_and_a_release(alloc_id: str, request_id: str, pod_uid: str,
                                                                  gpu: str) -> None:
    share = GpuShare(index=1, uuid=gpu, minor=1, cores=30, memory=1 << 30)
    grant = AllocationGranted(alloc_id=alloc_id, request_id=request_id, pod_uid=pod_uid, namespace="ns",
                              pod_name="p", container="c", container_index=0, cores=30, memory=1 << 30,
                              device_ids=("tencent.com/vcuda-core-3",), shares=(share,), core_limit=40,
                              response=ContainerResponse(envs={"A": "1"}))
    release = AllocationReleased(alloc_id=alloc_id, pod_uid=pod_uid, container="c", reason="deleted")
    for version in (COMPACT_V, COMPACT_V3, COMPACT_V2, 1):
        for event in (grant, release):
            tag = event.__struct_config__.tag
            if version == 1:
                body = encode_body(event)
            else:
                body = compact_body(event, None, version)
                if body is None:  # a release had no version 2
                    continue
            decode = VIEW_DECODERS[(tag, version if version != 1 else event.SCHEMA)]
            view = plain(decode(body))  # type: ignore[operator]
            assert isinstance(view, type(view_of(StoredEvent(
                seq=1, recorded_at=1, stream_id="s", version=1, event_id="00", event=event))))
            assert view_of_fields(view) == view_of_fields(view_of(StoredEvent(
                seq=1, recorded_at=1, stream_id="s", version=1, event_id="00", event=event))), (tag, version)
            if version != 1:
                assert expand(tag, version, body, None) == event


def view_of_fields(view: object) -> dict[str, object]:
    return {f: getattr(view, f) for f in view.__struct_fields__}  # type: ignore[attr-defined]
