"""The allocator writes a snapshot at a clean stop and starts from it, replaying only the tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.make_log import synthetic, write_log
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.ledger import snapshot as snap
from libs.ledger.snapshot import read_header
from services.allocator import app as allocator_app


async def test_clean_stop_then_start_from_the_snapshot(
    nats_server: NatsServer, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(node_name="n1", state_dir=str(short_dir / "state"), nats_url=nats_server.url, gpus="fake")
    write_log(settings.log_path, synthetic(5_000), progress=False)

    async with allocator_app.service(settings) as first:
        before = first.handlers.state.snapshot()
        assert before.seq == 5_001  # the log, then this node's (different) inventory
    found = read_header(settings.log_path)
    assert found is not None and found[0].seq == 5_001

    replayed_from: list[int] = []
    real_replay = snap.replay

    def spy(path, fold, *, after_seq=0, **kw):  # type: ignore[no-untyped-def]
        replayed_from.append(after_seq)
        return real_replay(path, fold, after_seq=after_seq, **kw)

    monkeypatch.setattr(snap, "replay", spy)
    async with allocator_app.service(settings) as second:
        assert second.handlers.state.snapshot() == before
    assert replayed_from == [5_001]
