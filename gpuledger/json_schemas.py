"""JSON Schemas of what the commands print with ``--json`` (the events' own are libs/events/jsonschema.py).

Every time in ``--json`` output is one form: an RFC 3339 UTC string with nine fractional digits
(``2026-11-22T14:00:00.123456789Z``); where the raw value is useful, the same instant in unix
nanoseconds is beside it (``*_ns``, or ``recorded_at`` in event records and history lines, as in the
records themselves). Generated from the msgspec types, committed under ``docs/schemas/cli/``;
tests/unit/test_cli_json_schemas.py fails when they are stale and validates real output against them.

    python -m gpuledger.json_schemas
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import msgspec

from libs.ledger.holdings import AuditView
from libs.ledger.timeline import Entry
from libs.store.verify import Report

__all__ = ["OUT", "RFC3339", "render", "schemas"]

OUT = Path(__file__).resolve().parents[1] / "docs" / "schemas" / "cli"
RFC3339 = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{9}Z$",
           "description": "RFC 3339, UTC, nine fractional digits"}
UNIX_NS = {"type": "integer", "description": "the same instant in unix nanoseconds"}


def _schema(cls: type, title: str, description: str) -> dict[str, Any]:
    raw = msgspec.json.schema(cls)
    defs = copy.deepcopy(raw["$defs"])
    body = defs.pop(cls.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title,
            "description": description, **{k: v for k, v in body.items() if k != "title"}, "$defs": defs}


def _time(obj: dict[str, Any], name: str, raw: str | None, *, nullable: bool = False) -> None:
    obj["properties"][name] = {"anyOf": [RFC3339, {"type": "null"}]} if nullable else dict(RFC3339)
    if raw:
        obj["properties"][raw] = dict(UNIX_NS)
    obj["required"] = sorted({*obj.get("required", []), name, *([raw] if raw else [])})


def replay_schema() -> dict[str, Any]:
    out = _schema(AuditView, "gpuledger replay --json",
                  "Who held which GPU share as of a seq or time. time: the commit time of event `seq` "
                  "(null for an empty log).")
    _time(out, "time", "time_ns", nullable=True)
    _time(out["$defs"]["Holding"], "since", "since_ns")
    return out


def history_schema() -> dict[str, Any]:
    out = _schema(Entry, "gpuledger history --json", "One line per event of the pod's or GPU's timeline.")
    _time(out, "time", None)
    out["properties"]["recorded_at"] = dict(UNIX_NS)
    return out


def verify_schema() -> dict[str, Any]:
    return _schema(Report, "gpuledger audit verify --json", "How far the log's hash chain is intact.")


def schemas() -> dict[str, dict[str, Any]]:
    return {"replay": replay_schema(), "history": history_schema(), "audit-verify": verify_schema()}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        path = OUT / f"{name}.json"
        path.write_text(render(schema))
        print(path)


if __name__ == "__main__":
    main()
