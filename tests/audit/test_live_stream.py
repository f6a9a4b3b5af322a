"""The live stream as operators see it: a plain NATS client, and `gpuledger events --follow --nats-url`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

import jsonschema
import nats
import pytest
from nats.js import api

from libs.bus import Bus, NatsServer, Relay
from libs.events.jsonschema import DEFAULT_OUT
from libs.events.schema import GpuInfo, InventoryRecorded
from libs.store import EventLog
from tests.builders import released_event

NODE = "ip-10-0-0-1.ec2.internal"
TOKEN = "ip-10-0-0-1_2Eec2_2Einternal"  # as docs/nats.md escapes it


@contextlib.asynccontextmanager
async def publishing(url: str, path: Path):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(url, name="allocator", node=NODE)
    event_log = await EventLog.open(path)
    relay = Relay(bus, event_log)
    task = asyncio.create_task(relay.run())
    try:
        yield event_log, relay
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await event_log.close()
        await bus.close()


async def test_a_plain_nats_client_sees_the_documented_subjects(nats_server: NatsServer, short_dir: Path) -> None:
    nc = await nats.connect(nats_server.url)
    core: list[tuple[str, dict[str, Any]]] = []
    all_in = asyncio.Event()

    async def collect(msg: Any) -> None:
        core.append((msg.subject, json.loads(msg.data)))
        if len(core) == 6:
            all_in.set()

    await nc.subscribe(f"gpuledger.{TOKEN}.alloc.*", cb=collect)
    await nc.subscribe(f"gpuledger.{TOKEN}.inventory.*", cb=collect)
    try:
        async with publishing(nats_server.url, short_dir / "ledger.sqlite") as (event_log, relay):
            gpu = GpuInfo(index=0, minor=0, uuid="GPU-0", memory=1 << 34)
            await event_log.append([InventoryRecorded(node=NODE, backend="fake", gpus=(gpu,))])
            for i in range(5):
                await event_log.append([released_event(i)])
            await relay.wait_published(6, timeout=10)
            # A late subscriber replays the stream, by its documented name, from any seq.
            js = nc.jetstream()
            sub = await js.subscribe(f"gpuledger.{TOKEN}.>", stream=f"GPULEDGER_{TOKEN}", ordered_consumer=True,
                                     config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                                               opt_start_seq=3))
            replayed = [json.loads((await sub.next_msg(timeout=5)).data) for _ in range(4)]
            await sub.unsubscribe()
        await asyncio.wait_for(all_in.wait(), 10)
    finally:
        await nc.close()
    # Each subscription gets its subject's events in commit order (two subscriptions may interleave).
    by_subject: dict[str, list[int]] = {}
    for subject, record in core:
        by_subject.setdefault(subject, []).append(record["seq"])
    assert by_subject == {f"gpuledger.{TOKEN}.inventory.recorded": [1],
                          f"gpuledger.{TOKEN}.alloc.released": [2, 3, 4, 5, 6]}
    assert [r["seq"] for r in replayed] == [3, 4, 5, 6]
    for _, record in core:
        jsonschema.validate(record, json.loads((DEFAULT_OUT / f"{record['type']}.json").read_text()))


async def start_follow(url: str, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuledger", "events", "--follow", "--json", "--nats-url", url, *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)


async def read_seqs(proc: asyncio.subprocess.Process, count: int, timeout: float = 20) -> list[int]:
    assert proc.stdout is not None
    out = []
    for _ in range(count):
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        out.append(json.loads(line)["seq"])
    return out


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("mode", ["since", "durable"])
async def test_events_follow_reads_the_stream_and_catches_up(
    nats_server: NatsServer, short_dir: Path, mode: str
) -> None:
    async with publishing(nats_server.url, short_dir / "ledger.sqlite") as (event_log, _relay):
        for i in range(10):
            await event_log.append([released_event(i)])
        extra = ["--durable", "ops-audit"] if mode == "durable" else []
        proc = await start_follow(nats_server.url, *extra)  # the node is found: the only gpuledger stream
        try:
            first = await read_seqs(proc, 10)
            await asyncio.sleep(0.5)  # let the last acks land (durable mode)
        finally:
            await stop(proc)
        for i in range(10, 25):  # while the follower is away
            await event_log.append([released_event(i)])
        resume = ["--since", str(first[-1])] if mode == "since" else []
        proc = await start_follow(nats_server.url, "--node-name", NODE, *extra, *resume)
        try:
            second = await read_seqs(proc, 15)
            for i in range(25, 30):  # and live again
                await event_log.append([released_event(i)])
            third = await read_seqs(proc, 5)
        finally:
            await stop(proc)
    assert first + second + third == list(range(1, 31))
