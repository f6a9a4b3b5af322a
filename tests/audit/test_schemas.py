"""docs/schemas holds one JSON Schema per event type, generated from the msgspec types and kept up to date."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import msgspec

from libs.events.codec import to_record
from libs.events.jsonschema import DEFAULT_OUT, render, schemas
from libs.events.schema import EVENT_TYPES
from libs.store import iter_events, open_reader

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ledger-v1.sqlite"


def test_the_committed_schemas_are_up_to_date() -> None:
    committed = {p.name for p in DEFAULT_OUT.glob("*.json")}
    assert committed == {f"{name}.json" for name in EVENT_TYPES}, "run: python -m libs.events.jsonschema"
    for name, schema in schemas().items():
        assert (DEFAULT_OUT / f"{name}.json").read_text() == render(schema), (
            f"docs/schemas/{name}.json is stale: run python -m libs.events.jsonschema")


def test_records_validate_and_wrong_ones_do_not() -> None:
    conn = open_reader(FIXTURE)
    records = [json.loads(msgspec.json.encode(to_record(e))) for e in iter_events(conn)]
    conn.close()
    for record in records:
        schema = json.loads((DEFAULT_OUT / f"{record['type']}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(record, schema)
    granted = next(r for r in records if r["type"] == "alloc.granted")
    schema = json.loads((DEFAULT_OUT / "alloc.granted.json").read_text())
    for broken in ({**granted, "type": "alloc.released"}, {**granted, "data": {**granted["data"], "cores": "50"}},
                   {k: v for k, v in granted.items() if k != "seq"}):
        try:
            jsonschema.validate(broken, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {broken}")
