"""Every ``--json`` output validates against its committed schema (docs/schemas/cli/, events: docs/schemas/),
and gives its times in the one documented form: RFC 3339 with nine fractional digits."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gpuledger.json_schemas import OUT, render, schemas
from libs.events.jsonschema import DEFAULT_OUT as EVENT_SCHEMAS

FIXTURE = Path(__file__).parent.parent / "fixtures" / "ledger-v1.sqlite"
RFC3339_NS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{9}Z$")


def gpuledger(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("state")
    shutil.copy(FIXTURE, directory / "ledger.sqlite")
    return str(directory)


def _schema(name: str) -> dict[str, Any]:
    schema = json.loads((OUT / f"{name}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_the_committed_schemas_are_up_to_date() -> None:
    assert {p.name for p in OUT.glob("*.json")} == {f"{n}.json" for n in schemas()}, "python -m gpuledger.json_schemas"
    for name, schema in schemas().items():
        assert (OUT / f"{name}.json").read_text() == render(schema), "stale: run python -m gpuledger.json_schemas"


def test_replay_json(state: str) -> None:
    schema = _schema("replay")
    for args in ((), ("--seq", "0"), ("--seq", "3")):
        out = json.loads(gpuledger("replay", "--json", "--state-dir", state, *args))
        jsonschema.validate(out, schema)
    assert out["allocations"] and RFC3339_NS.match(out["time"]) and isinstance(out["time_ns"], int)
    held = out["allocations"][0]
    assert RFC3339_NS.match(held["since"]) and isinstance(held["since_ns"], int)
    with pytest.raises(jsonschema.ValidationError):  # the old form: nanoseconds where the time goes
        jsonschema.validate({**out, "time": out["time_ns"]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**out, "allocations": [{**held, "since": held["since_ns"]}]}, schema)


def test_history_json(state: str) -> None:
    schema = _schema("history")
    printed = gpuledger("history", "--json", "--gpu", "0", "--state-dir", state)
    lines = [json.loads(line) for line in printed.splitlines()]
    assert lines
    for line in lines:
        jsonschema.validate(line, schema)
        assert RFC3339_NS.match(line["time"]) and isinstance(line["recorded_at"], int)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**lines[0], "time": lines[0]["recorded_at"]}, schema)


def test_audit_verify_json(state: str) -> None:
    out = json.loads(gpuledger("audit", "verify", "--json", "--state-dir", state))
    jsonschema.validate(out, _schema("audit-verify"))
    assert out["ok"] is True


def test_events_json(state: str) -> None:
    for line in gpuledger("events", "--json", "--state-dir", state).splitlines():
        record = json.loads(line)
        jsonschema.validate(record, json.loads((EVENT_SCHEMAS / f"{record['type']}.json").read_text()))
        assert RFC3339_NS.match(record["time"]) and isinstance(record["recorded_at"], int)
