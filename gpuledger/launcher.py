"""``gpuledger up``: the embedded broker and the four services as supervised child processes.

Children are fresh interpreters (spawn, not fork: gRPC does not survive fork) in their own sessions,
so Ctrl-C reaches only the launcher, which then stops them in order: services, simulator, broker (the
services close their connections before the broker goes, so a requested stop logs no "unexpected
EOF"). Every child, the broker included, dies with the launcher however it dies (the parent-death
signal, libs/lifeline.py), so a ``kill -9`` of ``up`` leaves nothing behind.

Supervision: each child has a task that waits for its exit. A child that exits unexpectedly is
logged with the cause (exit code or signal) and restarted; the broker on the same port with the same
store, so the services' connections come back by themselves. A first exit is restarted after
``AT_ONCE_S``; the delay (from ``FIRST_DELAY_S``) doubles only while a child keeps dying within
``QUICK_EXIT_S`` of its start (a crash loop) and resets once a run lasted a
healthy minute (``HEALTHY_AFTER_S``); a child that ran at least ``QUICK_EXIT_S`` comes back after
``AT_ONCE_S`` whatever the streak (so a kill never waits 8 or 16 s for kills that came before it,
which the chaos bench showed): the tenth kill in a week of healthy running waits ``AT_ONCE_S``,
not 30 s.

The launcher's own record is ``<state dir>/up.json`` (written on every start and exit): its pid, each
child's pid and command line, restarts and the cause of the last exit. It is how restarts are counted
(``gpuledger_up_restarts`` per child, for a textfile collector, in ``up.prom`` beside it), and how a
new ``up`` on the same state dir finds children of one that was killed and clears them first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpuledger.agent import SERVICES
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.errors import GpuledgerError
from libs.lifeline import command_line, describe_exit, process_alive, start_in_own_session
from libs.logger import get_logger

__all__ = ["BROKER", "SERVICES", "Child", "Launcher", "LauncherError", "settings_env"]

BROKER = "nats-server"
STATUS_FILE = "up.json"
FIRST_DELAY_S = 0.25     # the first restart's delay in a crash loop
AT_ONCE_S = 0.02         # the restart delay of a child that was not crash-looping (killed from outside)
MAX_DELAY_S = 30.0
# A run shorter than this counts toward a crash loop (the delay doubles): a crash during start-up (a
# service is up in about 1 s, 1.5 s on a loaded node). Longer, it was killed or failed while running:
# 10 s here made a node whose processes were killed every 5-9 s (the chaos bench, 1,000 lifecycles)
# wait 8-30 s for a restart.
QUICK_EXIT_S = 2.0
HEALTHY_AFTER_S = 60.0   # a run this long resets the delay
_logger = get_logger("up")


class LauncherError(GpuledgerError):
    """``gpuledger up`` cannot start (another one runs on the same state dir)."""


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child build the same Settings (see gpuledger/options.py)."""
    return settings.to_env()


@dataclass
class Backoff:
    """The restart delay of one child: doubles in a crash loop, resets after a healthy minute."""

    streak: int = 0

    def after_exit(self, uptime: float) -> float:
        if uptime >= HEALTHY_AFTER_S:
            self.streak = 0
        if uptime >= QUICK_EXIT_S:
            # Not a crash loop (killed from outside, say): back at once. The streak is kept until a
            # healthy minute, so a child that alternates short runs and quick crashes still backs off.
            return AT_ONCE_S
        # The first quick exit may be a kill from outside too: back at once; a second one in a row
        # is a crash loop, and the delay grows from FIRST_DELAY_S.
        delay = AT_ONCE_S if self.streak == 0 else min(FIRST_DELAY_S * 2 ** (self.streak - 1), MAX_DELAY_S)
        self.streak += 1
        return delay


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    last_exit: str = ""
    started_at: float = 0.0  # time.monotonic() of the last start
    backoff: Backoff = field(default_factory=Backoff)
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def cmdline(self) -> list[str]:
        return list(self.argv)

    async def start(self) -> None:
        out: int | IO[bytes] | None = None
        if self.log_path is not None and self._log_file is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 (closed in stop)
        out = self._log_file
        self.proc = await start_in_own_session(
            self.argv, env={**os.environ, **self.env}, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
        self.started_at = time.monotonic()
        _logger.info("started", child=self.name, pid=self.proc.pid)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, timeout: float) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a frozen child must see the SIGTERM too
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                _logger.warning("did not stop in time; killing", child=self.name)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._log_file:
            self._log_file.close()
            self._log_file = None


@dataclass
class Broker:
    """The embedded nats-server as a supervised child (same port and store on every start)."""

    server: NatsServer
    name: str = BROKER
    restarts: int = 0
    last_exit: str = ""
    started_at: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def cmdline(self) -> list[str]:
        return list(self.server.argv)

    async def start(self) -> None:
        await self.server.start()
        self.started_at = time.monotonic()
        _logger.info("started", child=self.name, pid=self.pid, url=self.server.url)

    async def wait(self) -> int:
        return await self.server.wait()


class Launcher:
    def __init__(self, settings: Settings, *, embedded_nats: bool, log_dir: Path | None = None) -> None:
        self.settings = settings
        self.embedded_nats = embedded_nats
        self.log_dir = log_dir
        self.nats: NatsServer | None = None
        self.broker: Broker | None = None
        self.children: list[Child] = []
        self._stopping = False
        self._claimed = False
        self._supervisors: list[asyncio.Task[None]] = []

    @property
    def status_path(self) -> Path:
        return Path(self.settings.state_dir) / STATUS_FILE

    def _child(self, name: str, args: list[str]) -> Child:
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        return Child(name, [sys.executable, "-m", "gpuledger", *args], settings_env(self.settings), log_path)

    async def start_nats(self) -> str:
        self.claim()
        if self.embedded_nats:
            self.nats = NatsServer(Path(self.settings.state_dir) / "nats", config=_leaf_config(self.settings))
            self.broker = Broker(self.nats)
            await self.broker.start()
            self.settings = self.settings.replace(nats_url=self.nats.url)
            _logger.info("embedded nats-server ready", url=self.nats.url)
            self._write_status()
            self._supervise(self.broker)
        return self.settings.nats_url

    async def start_child(self, name: str, args: list[str]) -> Child:
        self.claim()
        child = self._child(name, args)
        await child.start()
        self.children.append(child)
        self._write_status()
        self._supervise(child)
        return child

    async def start_services(self) -> None:
        for name in SERVICES:
            await self.start_child(name, ["run", name])

    def _supervise(self, unit: Child | Broker) -> None:
        self._supervisors.append(asyncio.create_task(self._keep_running(unit), name=f"supervise-{unit.name}"))

    async def _keep_running(self, unit: Child | Broker) -> None:
        while not self._stopping:
            code = await unit.wait()
            if self._stopping:
                return
            uptime = time.monotonic() - unit.started_at
            delay = unit.backoff.after_exit(uptime)
            unit.restarts += 1
            unit.last_exit = describe_exit(code)
            hint = " (killed: perhaps out of memory?)" if code == -signal.SIGKILL else ""
            _logger.warning(f"child exited{hint}; restarting", child=unit.name, cause=unit.last_exit, code=code,
                         uptime_s=round(uptime, 1), restarts=unit.restarts, in_s=delay)
            self._write_status()
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await unit.start()
            except Exception as exc:  # e.g. the broker's port still held: the next round tries again
                unit.started_at = time.monotonic()
                _logger.error("restart failed", child=unit.name, error=str(exc))
                await asyncio.sleep(FIRST_DELAY_S)
                if isinstance(unit, Broker):
                    continue
            self._write_status()

    # --- the state dir's record: status, restarts, and the children of a killed launcher ---

    def claim(self) -> None:
        """Take the state dir: clear what a dead `up` left there; LauncherError while another one runs."""
        if self._claimed:
            return
        Path(self.settings.state_dir).mkdir(parents=True, exist_ok=True)
        clear_stale(self.status_path)
        self._claimed = True

    def status(self) -> dict[str, object]:
        units: list[Child | Broker] = [*([self.broker] if self.broker else []), *self.children]
        return {
            "pid": os.getpid(),
            "children": {
                # What the child runs once it has armed its lifeline and exec'd (libs/lifeline.py):
                # /proc shows the same from then on, and it is what clear_stale compares.
                u.name: {"pid": u.pid, "cmdline": u.cmdline if u.pid else [], "restarts": u.restarts,
                         "last_exit": u.last_exit}
                for u in units
            },
        }

    def _write_status(self) -> None:
        status = self.status()
        _write_atomic(self.status_path, json.dumps(status, indent=1) + "\n")
        lines = ["# HELP gpuledger_up_restarts_total Restarts of a child of gpuledger up.",
                 "# TYPE gpuledger_up_restarts_total counter"]
        children = status["children"]
        assert isinstance(children, dict)
        lines += [f'gpuledger_up_restarts_total{{child="{n}"}} {c["restarts"]}' for n, c in children.items()]
        _write_atomic(self.status_path.with_suffix(".prom"), "\n".join(lines) + "\n")

    async def stop(self) -> None:
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        for task in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        services = [c for c in self.children if c.name in SERVICES]
        others = [c for c in self.children if c.name not in SERVICES]
        await asyncio.gather(*(c.stop(10.0) for c in services))
        await asyncio.gather(*(c.stop(10.0) for c in others))
        if self.nats:
            await self.nats.stop()
        if self._claimed:
            with contextlib.suppress(OSError):
                self.status_path.unlink()
        _logger.info("all stopped")


def clear_stale(status_path: Path, timeout: float = 5.0) -> list[int]:
    """Kill what a killed ``up`` left on this state dir; refuse when that ``up`` still runs.

    A pid counts only while its command line is still the one recorded (a reused pid is left alone).
    Returns the pids killed.
    """
    try:
        recorded = json.loads(status_path.read_text())
    except (OSError, ValueError):
        return []
    up_pid = recorded.get("pid")
    if isinstance(up_pid, int) and up_pid != os.getpid() and process_alive(up_pid) and "up" in command_line(up_pid):
        raise LauncherError(f"another gpuledger up (pid {up_pid}) runs on state dir {status_path.parent}")
    killed = []
    for name, child in (recorded.get("children") or {}).items():
        pid, cmdline = child.get("pid"), child.get("cmdline")
        if isinstance(pid, int) and cmdline and command_line(pid) == cmdline:
            _logger.warning("clearing a child of an earlier gpuledger up", child=name, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:  # the record is for operators: a full disk must not stop the supervision
        _logger.warning("cannot write the launcher status", path=str(path), error=str(exc))


def _leaf_config(settings: Settings) -> str | None:
    """With a fleet URL, the embedded broker is a leaf node of the central cluster in the node's own
    JetStream domain (its stream and every Allocate stay local); without one, a lone broker as before."""
    if not settings.fleet_url:
        return None
    from libs.fleet.credentials import load_credentials
    from libs.fleet.natsconf import leaf_config

    creds = load_credentials(settings.fleet_credentials)
    return leaf_config(settings.node_name, Path(settings.state_dir) / "nats",
                       remote_urls=[u.strip() for u in settings.fleet_url.split(",") if u.strip()],
                       user=creds.user, password=creds.password)
