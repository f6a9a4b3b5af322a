"""The audit views (``libs.ledger.views``) are narrow readings of the events: each view's fields must
be fields of its event type, with the same names and types, and the same tag, so that the bytes of a
stored event decode as its view."""

from __future__ import annotations

import msgspec
import pytest

from libs.events.schema import EVENT_TYPES
from libs.ledger.views import VIEWS


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
