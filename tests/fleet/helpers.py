"""A real fleet on loopback: 3 central nats-servers, leaf brokers for nodes, a TCP proxy to cut a link."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from libs.bus import Bus, NatsServer, Relay
from libs.config import Settings
from libs.errors import BusError
from libs.events import (
    AllocationGranted,
    AllocationReleased,
    ContainerResponse,
    GpuInfo,
    GpuShare,
    InventoryRecorded,
)
from libs.fleet.naming import FLEET_DOMAIN, HUB_INBOX, RECORDER_USER, node_user
from libs.fleet.natsconf import HubServer, NodeLogin, hub_config, leaf_config
from libs.store import EventLog
from libs.witness.files import NodeFiles, load_or_create_key
from libs.witness.node import Checkpointer, origin_of
from libs.witness.note import Checkpoint, SignedNote
from tests.polling import eventually


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class HubCluster:
    """Three central servers with routes, JetStream (domain ``fleet``, fsync always) and leafnode ports."""

    root: Path
    size: int = 3
    recorder_password: str = field(default_factory=lambda: secrets.token_hex(8))
    system_password: str = field(default_factory=lambda: secrets.token_hex(8))
    logins: dict[str, NodeLogin] = field(default_factory=dict)
    specs: list[HubServer] = field(default_factory=list)
    servers: list[NatsServer] = field(default_factory=list)

    async def start(self, timeout: float = 30.0) -> None:
        ports = free_ports(4 * self.size)
        self.specs = [HubServer(name=f"hub-{i}", store_dir=self.root / f"hub-{i}", client_port=ports[4 * i],
                                cluster_port=ports[4 * i + 1], leaf_port=ports[4 * i + 2],
                                monitor_port=ports[4 * i + 3]) for i in range(self.size)]
        self.servers = [NatsServer(s.store_dir, port=s.client_port, config=self._config(s)) for s in self.specs]
        await asyncio.gather(*(s.start(timeout) for s in self.servers))
        await self.wait_jetstream(timeout)

    def _config(self, spec: HubServer) -> str:
        return hub_config(spec, self.specs, recorder_password=self.recorder_password,
                          nodes=list(self.logins.values()), system_password=self.system_password)

    async def wait_jetstream(self, timeout: float) -> None:
        """Until every running server's /healthz says ok: its JetStream is in contact with a meta leader
        and its streams are current. A server that starts, or rejoins after a kill, catches up first,
        and a JetStream request it serves before then may be answered 503 "temporarily unavailable"
        (CI saw it after a restart)."""
        await eventually(lambda: all(self._healthy(spec) for spec in self._running()), timeout=timeout,
                         interval=0.1, what="JetStream current on every running hub server")

    def _healthy(self, spec: HubServer) -> bool:
        try:
            return self._monitor(spec, "healthz").get("status") == "ok"
        except OSError:  # 503 while it catches up (HTTPError), or its monitor port not answering yet
            return False

    def add_node(self, node: str, *, timeout: float = 10.0) -> NodeLogin:
        """A user for ``node`` on every central server (a configuration reload, no restart), returned
        once every running server has loaded it: a reload is asynchronous (SIGHUP), and a client that
        reached a server still on the old configuration was refused as an unknown user (CI saw it)."""
        login = self.logins.get(node) or NodeLogin(node, secrets.token_hex(8))
        self.logins[node] = login
        running = self._running()
        loaded = {spec.name: self._config_load_time(spec) for spec in running}
        for spec, server in zip(self.specs, self.servers, strict=True):  # a stopped one reads it when started
            server.reload(self._config(spec))
        deadline = time.monotonic() + timeout
        for spec in running:
            while self._config_load_time(spec) == loaded[spec.name]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec.name} did not reload its configuration within {timeout:g}s")
                time.sleep(0.01)
        return login

    def _running(self) -> list[HubServer]:
        return [spec for spec, server in zip(self.specs, self.servers, strict=True) if server.returncode is None]

    @staticmethod
    def _monitor(spec: HubServer, endpoint: str) -> dict[str, Any]:
        """One of the server's monitoring endpoints (``varz``, ``leafz``...), as JSON."""
        with urllib.request.urlopen(f"http://127.0.0.1:{spec.monitor_port}/{endpoint}", timeout=5) as reply:
            return json.load(reply)  # type: ignore[no-any-return]

    def _config_load_time(self, spec: HubServer) -> str:
        """When the server last loaded its configuration."""
        return str(self._monitor(spec, "varz")["config_load_time"])

    def client_urls(self, user: str = RECORDER_USER, password: str | None = None) -> str:
        password = self.recorder_password if password is None else password
        return ",".join(f"nats://{user}:{password}@127.0.0.1:{s.client_port}" for s in self.specs)

    @property
    def leaf_urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{s.leaf_port}" for s in self.specs]

    async def recorder_bus(self, wait: float = 10.0) -> Bus:
        return await Bus.connect(self.client_urls(), name="fleet-test", node="fleet", wait=wait,
                                 inbox_prefix=HUB_INBOX)

    def leaf_links(self) -> dict[str, str]:
        """Which central server (name) holds each leaf node's link (the leaf's server name), from the
        servers' /leafz monitoring endpoints."""
        held = {}
        for spec in self._running():
            for leaf in self._monitor(spec, "leafz").get("leafs") or []:
                held[leaf["name"]] = spec.name
        return held

    def index_of(self, name: str) -> int:
        return [s.name for s in self.specs].index(name)

    async def kill(self, index: int) -> None:
        await self.servers[index].kill()

    async def restart(self, index: int, timeout: float = 30.0) -> None:
        await self.servers[index].start(timeout)
        await self.wait_jetstream(timeout)

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)


class TcpProxy:
    """A TCP forwarder the test controls: ``cut()`` closes every connection and refuses new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_ports(1)[0]
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def cut(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.close()
        self._writers.clear()
        for t in list(self._pipes):
            t.cancel()

    async def restore(self) -> None:
        await self.start()

    async def stop(self) -> None:
        await self.cut()


@dataclass
class LeafBroker:
    """A node's own broker joined to the hub as a leaf node (optionally through a TcpProxy per hub server)."""

    node: str
    root: Path
    hub: HubCluster
    proxies: list[TcpProxy] = field(default_factory=list)
    server: NatsServer | None = None

    def _config(self) -> str:
        login = self.hub.add_node(self.node) if self.node not in self.hub.logins else self.hub.logins[self.node]
        urls = ([f"nats://127.0.0.1:{p.port}" for p in self.proxies] if self.proxies else self.hub.leaf_urls)
        port = self.server.port if self.server and self.server.port > 0 else -1
        return leaf_config(self.node, self.root / "store", remote_urls=urls, user=node_user(self.node),
                           password=login.password, port=port)

    async def start(self, *, through_proxy: bool = False, timeout: float = 15.0) -> str:
        if through_proxy and not self.proxies:
            self.proxies = [TcpProxy(s.leaf_port) for s in self.hub.specs]
            for p in self.proxies:
                await p.start()
        config = self._config()
        if self.server is None:
            self.server = NatsServer(self.root / "store", config=config)
        else:
            self.server.config = config
        return await self.server.start(timeout)

    @property
    def url(self) -> str:
        assert self.server
        return self.server.url

    async def cut(self) -> None:
        for p in self.proxies:
            await p.cut()

    async def restore(self) -> None:
        for p in self.proxies:
            await p.restore()

    async def kill(self) -> None:
        assert self.server
        await self.server.kill()

    async def stop(self) -> None:
        if self.server:
            await self.server.stop()
        for p in self.proxies:
            await p.stop()


GIB = 1 << 30


def gpus_of(node: str, count: int = 2, model: str = "NVIDIA A100-SXM4-40GB") -> tuple[GpuInfo, ...]:
    return tuple(GpuInfo(index=i, minor=i, uuid=f"GPU-{node}-{i}", memory=40 * GIB, name=model) for i in range(count))


class LedgerNode:
    """A node's event log and outbox relay, publishing into its own (leaf) broker as the allocator does."""

    def __init__(self, node: str, root: Path, broker_url: str, *, model: str = "NVIDIA A100-SXM4-40GB") -> None:
        self.node, self.root, self.broker_url = node, root, broker_url
        self.gpus = gpus_of(node, model=model)
        self.event_log: EventLog | None = None
        self.bus: Bus | None = None
        self.relay: Relay | None = None
        self._task: asyncio.Task[None] | None = None
        self.live: list[AllocationGranted] = []

    @property
    def log_path(self) -> Path:
        return self.root / "ledger.sqlite"

    async def start(self) -> LedgerNode:
        self.event_log = await EventLog.open(self.log_path)
        self.bus = await Bus.connect(self.broker_url, name="allocator", node=self.node, wait=10)
        self.relay = Relay(self.bus, self.event_log, poll_interval=0.05)
        self._task = asyncio.create_task(self.relay.run())
        if self.event_log.last_seq == 0:
            await self.event_log.append([InventoryRecorded(node=self.node, backend="fake", gpus=self.gpus)])
        return self

    async def grant(
        self, *, namespace: str = "ml", pod_name: str = "", cores: int = 30, gpu: int = 0
    ) -> AllocationGranted:
        assert self.event_log
        pod_uid = str(uuid.uuid4())
        info = self.gpus[gpu]
        ev = AllocationGranted(
            alloc_id=uuid.uuid4().hex, request_id=uuid.uuid4().hex, pod_uid=pod_uid, namespace=namespace,
            pod_name=pod_name or f"pod-{pod_uid[:8]}", container="main", container_index=0, cores=cores,
            memory=4 * GIB, device_ids=tuple(f"tencent.com/vcuda-core-{i}" for i in range(cores)),
            shares=(GpuShare(index=info.index, uuid=info.uuid, minor=info.minor, cores=cores, memory=4 * GIB),),
            response=ContainerResponse(annotations={"tencent.com/vcuda-core": str(cores)}),
        )
        await self.event_log.append([ev])
        self.live.append(ev)
        return ev

    async def grant_many(self, count: int, *, batch: int = 250) -> None:
        """``count`` grants, ``batch`` per commit (a busy allocator's groups): a backlog in little time."""
        assert self.event_log
        template = await self.grant()
        left = count - 1
        while left > 0:
            chunk = [msgspec.structs.replace(template, alloc_id=uuid.uuid4().hex, pod_uid=str(uuid.uuid4()))
                     for _ in range(min(batch, left))]
            await self.event_log.append(chunk)
            left -= len(chunk)

    async def release(self, grant: AllocationGranted | None = None) -> None:
        assert self.event_log
        grant = grant or self.live[0]
        self.live.remove(grant)
        await self.event_log.append([AllocationReleased(alloc_id=grant.alloc_id, pod_uid=grant.pod_uid,
                                                        container=grant.container, reason="deleted")])

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.bus:
            await self.bus.close()
        if self.event_log:
            await self.event_log.close()


@dataclass
class FleetNode:
    """One node of a test fleet: its leaf broker and its ledger."""

    broker: LeafBroker
    ledger: LedgerNode

    @property
    def name(self) -> str:
        return self.broker.node

    async def stop(self) -> None:
        await self.ledger.stop()
        await self.broker.stop()


async def start_fleet_node(hub: HubCluster, root: Path, node: str, *, through_proxy: bool = False,
                           model: str = "NVIDIA A100-SXM4-40GB") -> FleetNode:
    broker = LeafBroker(node, root / "leaf", hub)
    await broker.start(through_proxy=through_proxy)
    ledger = await LedgerNode(node, root / "ledger", broker.url, model=model).start()
    return FleetNode(broker, ledger)


async def fleet_count(bus: Bus) -> int:
    from libs.fleet.naming import FLEET_STREAM

    return (await bus.js.stream_info(FLEET_STREAM)).state.messages


async def read_fleet(bus: Bus) -> list[tuple[str, int, str]]:
    """(subject, record seq, row hash header) of every fleet stream message, in stream order."""
    import msgspec

    from libs.events.codec import EventRecord
    from libs.fleet.naming import FLEET_STREAM

    out = []
    last = (await bus.js.stream_info(FLEET_STREAM)).state.last_seq
    for seq in range(1, last + 1):
        msg = await bus.js.get_msg(FLEET_STREAM, seq)
        record = msgspec.json.decode(msg.data, type=EventRecord)
        out.append((msg.subject, record.seq, (msg.headers or {}).get("Gpuledger-Row-Hash", "")))
    return out


def per_node_seqs(records: list[tuple[str, int, str]]) -> dict[str, list[int]]:
    from libs.events.subjects import unescape_token

    seqs: dict[str, list[int]] = {}
    for subject, seq, _hash in records:
        seqs.setdefault(unescape_token(subject.split(".")[1]), []).append(seq)
    return seqs


def recorder_settings(hub: HubCluster, root: Path, *, cluster: str = "test", metrics_port: int = 0) -> Settings:
    """The recorder on the hub, its SQLite database and witness key in ``root``; /metrics on metrics_port + 4."""
    root.mkdir(parents=True, exist_ok=True)
    return Settings(node_name="fleet-recorder", state_dir=str(root), nats_url=hub.client_urls(),
                    fleet_db=f"sqlite:///{root / 'fleet.sqlite'}", cluster_name=cluster, metrics_port=metrics_port,
                    metrics_host="127.0.0.1")


async def node_checkpointer(ledger: LedgerNode, cluster: str = "test") -> Checkpointer:
    """The node's checkpointer (as the allocator runs it) on the ledger's log and bus; checkpoints on demand."""
    assert ledger.bus is not None and ledger.event_log is not None
    files = NodeFiles(ledger.root)
    origin = origin_of(cluster, ledger.node)
    cp = Checkpointer(ledger.bus, ledger.event_log, files, load_or_create_key(files.key, origin), origin=origin,
                      every=1000, interval=30.0, timeout=5.0)
    await cp.start()
    return cp


async def cosigned_now(cp: Checkpointer, size: int, timeout: float = 20.0) -> SignedNote:
    """Until the witness cosigned the checkpointer's log at ``size`` (the recorder's interest in the
    checkpoint subject reaches a leaf broker a moment after the recorder starts)."""
    async def cosigned() -> SignedNote | None:
        try:
            note = await cp.checkpoint()
        except BusError:
            return None
        return note if note is not None and Checkpoint.parse(note.text).size == size else None

    return await eventually(cosigned, timeout=timeout, interval=0.2, what=f"a checkpoint at {size} cosigned")


def metric_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a /metrics endpoint by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


__all__ = [
    "FLEET_DOMAIN", "FleetNode", "HubCluster", "LeafBroker", "LedgerNode", "TcpProxy", "cosigned_now", "fleet_count",
    "free_ports", "gpus_of", "metric_samples", "node_checkpointer", "per_node_seqs", "read_fleet", "recorder_settings",
    "start_fleet_node",
]


REQUIRE_POSTGRES = "GPULEDGER_REQUIRE_POSTGRES"


def postgres_bindir() -> Path | None:
    """Debian's PostgreSQL server binaries (the ``postgresql`` package), newest version first."""
    import shutil

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), reverse=True)
    if found:
        return found[0].parent
    on_path = shutil.which("postgres")
    return Path(on_path).parent if on_path else None


REPO = Path(__file__).resolve().parents[2]


class PostgresServer:
    """A throw-away PostgreSQL server in a temp dir (initdb, then postgres on a loopback port).

    PostgreSQL refuses to run as root: as root, the data dir belongs to ``nobody`` and the server runs
    as ``nobody``. Every command starts through ``setpriv``, which changes the user (as root) and arms
    the parent-death signal, then execs the command in place: the postmaster is this process's own
    child and is SIGKILLed by the kernel when this process goes, however it goes (a benchmark or a
    test run killed by a timeout left it running, under runuser). A cleaner process started with the
    temp dir removes the dir (gigabytes after a full ``bench.fleet``) and the shared memory the killed
    postmaster leaves, when this process goes without ``stop()``."""

    def __init__(self, bindir: Path) -> None:
        import subprocess
        import sys
        import tempfile

        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="glpg", dir="/tmp"))
        self.port = free_ports(1)[0]
        self._proc: asyncio.subprocess.Process | None = None
        # tests/fleet/pg_cleaner.py, in a session of its own: a Ctrl-C to the test's process group
        # must not stop it first
        self._cleaner = subprocess.Popen([sys.executable, "-m", "tests.fleet.pg_cleaner", str(self.root)],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_owner(self, *cmd: str) -> list[str]:
        import os

        as_nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        return ["setpriv", *as_nobody, "--pdeathsig", "KILL", "--", *cmd]

    async def start(self, timeout: float = 60.0) -> None:
        import os

        data = self.root / "data"
        if os.geteuid() == 0:
            os.chown(self.root, 65534, 65534)
        init = await asyncio.create_subprocess_exec(
            *self._as_owner(str(self.bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                            "--no-sync", "-E", "UTF8"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _out, err = await asyncio.wait_for(init.communicate(), timeout)
        if init.returncode:
            raise RuntimeError(f"initdb failed: {err.decode(errors='replace')}")
        self._proc = await asyncio.create_subprocess_exec(
            *self._as_owner(str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port), "-h", "127.0.0.1",
                            "-k", str(self.root), "-c", "fsync=off"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

        async def ready() -> bool:
            probe = await asyncio.create_subprocess_exec(
                str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            return await probe.wait() == 0

        await eventually(ready, timeout=timeout, interval=0.2, what="PostgreSQL accepting connections")

    async def stop(self) -> None:
        """A fast shutdown (SIGINT to the postmaster, our own child: open sessions are ended); SIGKILL
        if it has not ended 30 s later (its children end when it does)."""
        import shutil
        import signal

        if self._proc and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self._proc.wait(), 30)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
        from simulator.runtime.leftovers import stop_reaper  # the cleaner ends as the runtime's reaper does

        await asyncio.to_thread(stop_reaper, self._cleaner)
