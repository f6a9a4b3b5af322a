"""The audit view (narrow decoding) agrees with the allocator's full fold at every point of a log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.make_log import synthetic, write_log
from libs.ledger.holdings import audit_replay
from libs.ledger.state import LedgerState
from libs.ledger.timeline import gpu_history, pod_history
from libs.store import replay


def test_holdings_equal_the_full_fold(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_log(path, synthetic(600), progress=False)
    for seq in (0, 1, 2, 7, 100, 333, 600):
        view = audit_replay(path, upto_seq=seq)
        state = LedgerState()
        replay(path, state.apply, upto_seq=seq)
        snap = state.snapshot()
        assert view.seq == snap.seq == seq
        assert [(h.alloc_id, h.shares, h.since, h.granted_seq, h.request_id) for h in view.allocations] == [
            (a.alloc_id, a.shares, a.granted_at, a.granted_seq, a.request_id) for a in snap.allocations]
        assert [(g.index, g.cores_used, g.memory_used, sorted(g.holders)) for g in view.gpus] == [
            (g.index, g.cores_used, g.memory_used, g.alloc_ids) for g in snap.gpus]
        assert all(len(h.event_id) == 32 for h in view.allocations)


def test_timelines_of_a_pod_and_a_gpu(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_log(path, synthetic(60), progress=False)
    pod = pod_history(path, "bench/job-3")
    assert [e.type for e in pod] == ["alloc.granted", "alloc.released"]
    assert pod_history(path, pod[0].pod_uid) == pod
    gpu = gpu_history(path, "3")
    assert gpu[0].type == "inventory.recorded" and "GPU-00000003" in gpu[0].detail
    assert {e.type for e in gpu[1:]} == {"alloc.granted", "alloc.released"}
    assert all(s.index == 3 for e in gpu[1:] for s in e.shares)
    assert gpu_history(path, "GPU-00000003") == gpu


def test_the_replay_and_history_tables(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    write_log(path, synthetic(20), progress=False)

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "gpuledger", *args, "--state-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        return out.stdout

    table = run("replay", "--seq", "10")
    assert "state at seq 10" in table and "REQUEST" in table and "bench/job-" in table
    assert "req-00000005" in table and "GPU" in table
    history = run("history", "--gpu", "1")
    assert "alloc.granted" in history and "bench/job-1" in history
