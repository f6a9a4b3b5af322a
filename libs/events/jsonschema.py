"""JSON Schema of each committed event as published on NATS, generated from the msgspec types.

One file per event type, ``docs/schemas/<type>.json``: the record envelope (seq, time, ...) with
``type`` and ``schema`` fixed to that type's name and version, and ``data`` = the event's fields.
The files are committed; ``tests/audit/test_schemas.py`` fails when they are out of date.

    python -m libs.events.jsonschema [--out docs/schemas]
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

import msgspec

from libs.events.codec import EventRecord
from libs.events.schema import EVENT_TYPES

__all__ = ["DEFAULT_OUT", "render", "schema_for", "schemas"]

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def _clean_descriptions(node: Any) -> Any:
    """Every ``description`` as ``inspect.cleandoc`` gives it: msgspec 0.22 copies docstrings with their
    indentation, 0.23 cleans them, and the committed files must not depend on which."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean_descriptions(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def schema_for(type_name: str) -> dict[str, Any]:
    cls = EVENT_TYPES[type_name]
    # _clean_descriptions builds new dicts and lists: what follows may change them in place.
    defs: dict[str, Any] = _clean_descriptions(msgspec.json.schema(cls))["$defs"]
    body = defs[cls.__name__]
    # On the wire the tag travels in the envelope's `type`, not inside `data`.
    body["properties"].pop("type", None)
    body["required"] = [f for f in body.get("required", []) if f != "type"]
    record = _clean_descriptions(msgspec.json.schema(EventRecord))["$defs"]["EventRecord"]
    record["title"] = f"{type_name} v{cls.SCHEMA}"
    record["description"] = (
        f"A committed `{type_name}` event as published on gpuledger.<node>.{type_name} and printed by "
        f"`gpuledger events --json`. data: {(cls.__doc__ or '').strip().splitlines()[0]}"
    )
    record["properties"]["type"] = {"const": type_name}
    record["properties"]["schema"] = {"const": cls.SCHEMA}
    record["properties"]["data"] = {"$ref": f"#/$defs/{cls.__name__}"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **record,
        "$defs": defs,
    }


def schemas() -> dict[str, dict[str, Any]]:
    return {name: schema_for(name) for name in sorted(EVENT_TYPES)}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        path = args.out / f"{name}.json"
        path.write_text(render(schema))
        print(path)


if __name__ == "__main__":
    main()
