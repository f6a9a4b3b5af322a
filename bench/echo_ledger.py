"""The durable half of the Allocate benchmark's second floor (bench/echo_plugin.py ``--bus``).

It answers each request on ``bench.echo.append`` after appending one row to a SQLite file in one
transaction, with the log's own settings (WAL, ``synchronous=FULL``): what the product's promise costs
at least per grant, one durable append. It commits on its event loop (no writer thread, no hash
chain, no encoding beyond the row): the cheapest such append, so this floor is a floor.

It times each append (BEGIN to COMMIT's return) and answers ``bench.echo.appends`` with those times
since the last such question (a JSON list of ms): the benchmark sets them beside the allocator's own,
to tell the fsync that any durable append waits for on a loaded machine from gpuledger's own work.

    python -m bench.echo_ledger DB_PATH NATS_URL   (prints "ready" once subscribed)
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg

from bench.echo_plugin import APPEND_SUBJECT

ROW_BYTES = 280  # about one grant in the compact log (docs/benchmarks.md, log size)
APPENDS_SUBJECT = "bench.echo.appends"


async def main(path: Path, url: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, at INTEGER, body BLOB)")
    bus = await nats.connect(url)

    taken_ms: list[float] = []

    async def append(msg: Msg) -> None:
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO events (at, body) VALUES (?, ?)", (time.time_ns(), os.urandom(ROW_BYTES)))
        conn.execute("COMMIT")
        taken_ms.append((time.perf_counter() - started) * 1000)
        await msg.respond(b"ok")

    async def appends(msg: Msg) -> None:
        await msg.respond(json.dumps(taken_ms).encode())
        taken_ms.clear()

    await bus.subscribe(APPEND_SUBJECT, cb=append)
    await bus.subscribe(APPENDS_SUBJECT, cb=appends)
    await bus.flush()
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await bus.close()
        conn.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
