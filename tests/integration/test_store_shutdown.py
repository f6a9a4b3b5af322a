"""A read cancelled mid-query leaves nothing behind once the EventLog is closed: the process can exit.

The reads go through one aiosqlite connection whose worker thread is not a daemon; a thread left
running would keep the interpreter alive after main() returns.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from tests.integration.helpers import filled_log

# Cancel at several points: before the connection is open, while it opens, mid-query.
CANCEL_AFTER_S = (0.0, 0.0005, 0.002, 0.01, 0.05)


def live_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
            and not t.name.startswith("asyncio_")]  # the default executor: asyncio.run joins it


def left_over(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` still alive after a bounded join (close() has returned)."""
    new = set(live_threads()) - before
    for t in new:
        t.join(timeout=10)
    return [t for t in new if t.is_alive()]


async def test_cancelled_reads_leave_no_thread_after_close(tmp_path: Path) -> None:
    before = set(live_threads())
    log = await filled_log(tmp_path / "ledger.sqlite")
    assert len(await log.read_after(0, limit=10)) == 10  # the connection works (and is open now)
    for delay in CANCEL_AFTER_S:
        reads = [asyncio.create_task(log.read_after(0, limit=100_000)) for _ in range(3)]
        await asyncio.sleep(delay)
        for r in reads:
            r.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
    # still usable after cancelled reads
    assert [e.seq for e in await log.read_after(4990)] == list(range(4991, 5001))
    slow = asyncio.create_task(log.read_after(0, limit=100_000))
    await asyncio.sleep(0.001)
    slow.cancel()
    await log.close()
    assert left_over(before) == []


async def test_a_read_cancelled_before_the_first_open_leaves_no_thread(tmp_path: Path) -> None:
    before = set(live_threads())
    log = await filled_log(tmp_path / "ledger.sqlite", n=500)
    read = asyncio.create_task(log.read_after(0))
    await asyncio.sleep(0)
    read.cancel()
    await asyncio.gather(read, return_exceptions=True)
    await log.close()
    assert left_over(before) == []


def test_process_exits_after_a_cancelled_read(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from tests.integration.helpers import filled_log

        async def main():
            log = await filled_log(Path({str(tmp_path / "ledger.sqlite")!r}))
            await log.read_after(0, limit=1)
            read = asyncio.create_task(log.read_after(0, limit=100_000))
            await asyncio.sleep(0.002)
            read.cancel()
            await log.close()

        asyncio.run(main())
        print("main returned")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert "main returned" in done.stdout
