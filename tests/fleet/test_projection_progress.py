"""The recorder's projection says a node's events are stored only once their transaction committed:
the folds run ahead while a batch is folded, and a reader that then queries the database (the
recorder's tests, `fleet at`) must not see progress the database does not hold yet."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import sqlalchemy

from libs.events.codec import StoredEvent, to_record
from libs.events.schema import AllocationReleased
from libs.events.subjects import Subjects
from libs.fleet.naming import SOURCE_HEADER
from services.fleet.projection import FleetMessage, FleetProjection

NODE = "gpu-a"


def message(seq: int) -> FleetMessage:
    stored = StoredEvent(seq=seq, recorded_at=1_700_000_000_000_000_000 + seq, stream_id="s", version=seq,
                         event_id=f"{seq:032x}", command_id=None,
                         event=AllocationReleased(alloc_id=f"a{seq}", pod_uid="p", container="c", reason="deleted"))
    subjects = Subjects(NODE)
    return FleetMessage(fleet_seq=seq, subject=subjects.event(stored.type),
                        headers={SOURCE_HEADER: f"{subjects.stream} {seq}"},
                        data=msgspec.json.encode(to_record(stored)))


def test_progress_is_what_the_database_committed(tmp_path: Path) -> None:
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'fleet.sqlite'}")
    projection = FleetProjection(engine)
    assert projection.last_seqs() == {}
    projection.apply([message(1), message(2)])
    assert projection.last_seqs() == {NODE: 2}

    with engine.begin() as conn:  # the next transaction cannot commit: its insert fails
        conn.execute(sqlalchemy.text("DROP TABLE fleet_events"))
    with pytest.raises(sqlalchemy.exc.OperationalError):
        projection.apply([message(3)])
    assert projection.folds[NODE].last_seq == 3  # folded...
    assert projection.last_seqs() == {NODE: 2}  # ...but not stored: not reported
