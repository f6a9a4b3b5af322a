"""Restart time: how long after its process starts the allocator answers, with a million events logged.

The allocator runs as ``gpuledger run allocator`` (its own process, as in production) against a real
nats-server. "Ready" = it answers a request on ``gpuledger.<node>.allocator.inventory``, which it
serves together with ``allocator.allocate`` once its state is rebuilt; the clock starts when the
process is spawned. Three starts in one run:
- floor: an empty state dir (interpreter start, imports, NATS connect, the GPU inventory);
- the log of ``--events`` events and no snapshot (a full replay, e.g. the first start after an upgrade);
- the same log after a clean stop, which wrote a snapshot (the normal restart).
The node's stream is current throughout, as on a running node (``seed_stream``): no start has a
backlog to publish.

    python -m bench.restart [--events 1000000] [--log PATH (reuse a log written by bench.make_log)]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors

from bench.make_log import synthetic, write_log
from libs.bus import NatsServer
from libs.bus.client import Bus
from libs.bus.outbox import EVENT_ID_HEADER, ensure_stream
from libs.commands import InventoryRequest
from libs.events.codec import to_record
from libs.events.subjects import Subjects
from libs.store.replay import iter_events, open_reader

NODE = "bench"


async def start_and_wait(state_dir: Path, url: str, timeout: float = 120) -> tuple[float, asyncio.subprocess.Process]:
    nc = await nats.connect(url)
    subject = Subjects(NODE).inventory
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", "run", "allocator", "--state-dir", str(state_dir), "--nats-url", url,
        "--gpus", "fake", "--node-name", NODE, "--log-format", "json",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)
    try:
        while True:
            try:
                await nc.request(subject, msgspec.json.encode(InventoryRequest()), timeout=0.25)
                return time.perf_counter() - started, proc
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if time.perf_counter() - started > timeout:
                    raise TimeoutError("the allocator did not become ready") from None
                await asyncio.sleep(0.005)
    finally:
        await nc.close()


async def _published(js) -> int:  # type: ignore[no-untyped-def]
    """The stream's last seq; 0 while the relay has not created the stream yet (a slow start)."""
    try:
        return int((await js.stream_info(Subjects(NODE).stream)).state.last_seq)
    except nats.js.errors.NotFoundError:
        return 0


async def wait_published(url: str, last: int, timeout: float = 900) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while (done := await _published(js)) < last:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the relay published {done} of {last} events")
            print(f"  relay published {done:,}/{last:,}", file=sys.stderr, flush=True)
            await asyncio.sleep(1)
    finally:
        await nc.close()


async def seed_stream(url: str, log: Path) -> int:
    """Make the node's stream current for ``log`` without publishing the log: a stream that starts at
    the log's last seq and holds that one event, with the headers the relay writes. That is all the
    relay checks when it starts (the stream's last seq, and the event id at it), so the allocators
    started on this log find nothing to publish, as on a node whose stream is current, instead of
    the bench waiting minutes for a million publications. Returns that seq."""
    conn = open_reader(log)
    try:
        last = next(iter_events(conn, after_seq=conn.execute("SELECT MAX(seq) FROM events").fetchone()[0] - 1))
    finally:
        conn.close()
    bus = await Bus.connect(url, name="bench", node=NODE, wait=10)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await bus.js.delete_stream(bus.subjects.stream)  # the floor's start published its own inventory
        await ensure_stream(bus, first_seq=last.seq)  # the relay's own stream config
        await bus.js.publish(bus.subjects.event(last.type), msgspec.json.encode(to_record(last)),
                             stream=bus.subjects.stream,
                             headers={"Nats-Expected-Last-Sequence": str(last.seq - 1), EVENT_ID_HEADER: last.event_id})
        assert await _published(bus.js) == last.seq
    finally:
        await bus.close()
    return last.seq


async def stop(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError("the allocator did not stop within 60 s of SIGTERM (no snapshot written)") from None


async def run(events: int, reuse: Path | None) -> list[dict[str, object]]:
    root = Path(tempfile.mkdtemp(prefix="glrs", dir="/tmp"))
    server = NatsServer(root / "nats")
    await server.start()
    try:
        rows = []
        empty = root / "empty"
        seconds, proc = await start_and_wait(empty, server.url)
        await stop(proc)
        rows.append({"case": "floor: empty log", "seconds": seconds})
        full = root / "full"
        full.mkdir()
        if reuse:
            shutil.copyfile(reuse, full / "ledger.sqlite")
        else:
            write_log(full / "ledger.sqlite", synthetic(events))
        await seed_stream(server.url, full / "ledger.sqlite")
        seconds, proc = await start_and_wait(full, server.url)
        rows.append({"case": f"{events:,} events, no snapshot (full replay)", "seconds": seconds})
        # The relay publishes what this start appended (its inventory) before the snapshot restarts.
        await wait_published(server.url, events + 1)
        await stop(proc)  # a clean stop writes the snapshot
        for attempt in (1, 2):
            seconds, proc = await start_and_wait(full, server.url)
            await stop(proc)
            rows.append({"case": f"{events:,} events, snapshot (restart {attempt})", "seconds": seconds})
        return rows
    finally:
        await server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--log", type=Path, default=None, help="reuse this log (its event count is --events)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = asyncio.run(run(args.events, args.log))
    print("| allocator start (process spawn -> answers on NATS) | seconds |\n|---|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['seconds']:.2f} |")
    print(f"\n{platform.machine()}, {os.cpu_count()} cpu, load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
