"""``gpuledger up``: the embedded broker and the four services as supervised child processes.

Children are fresh interpreters (spawn, not fork: gRPC does not survive fork) in their own process
groups, so Ctrl-C reaches only the launcher, which then stops them in order: services, simulator,
broker. A child that dies unexpectedly is restarted with a growing delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpuledger.agent import SERVICES
from libs.bus.server import NatsServer
from libs.config import Settings
from libs.logger import get_logger

__all__ = ["SERVICES", "Child", "Launcher", "settings_env"]

_logger = get_logger("up")


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child build the same Settings (see gpuledger/options.py)."""
    return settings.to_env()


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    async def start(self) -> None:
        out: int | IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = open(self.log_path, "ab")  # noqa: SIM115, ASYNC230 (closed in stop)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env={**os.environ, **self.env}, stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=out, start_new_session=True,
        )
        _logger.info("started", child=self.name, pid=self.proc.pid)

    async def stop(self, timeout: float) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
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


class Launcher:
    def __init__(self, settings: Settings, *, embedded_nats: bool, log_dir: Path | None = None) -> None:
        self.settings = settings
        self.embedded_nats = embedded_nats
        self.log_dir = log_dir
        self.nats: NatsServer | None = None
        self.children: list[Child] = []
        self._stopping = False
        self._watcher: asyncio.Task[None] | None = None

    def _child(self, name: str, args: list[str]) -> Child:
        log_path = self.log_dir / f"{name}.log" if self.log_dir else None
        return Child(name, [sys.executable, "-m", "gpuledger", *args], settings_env(self.settings), log_path)

    async def start_nats(self) -> str:
        if self.embedded_nats:
            self.nats = NatsServer(Path(self.settings.state_dir) / "nats", config=_leaf_config(self.settings))
            url = await self.nats.start()
            self.settings = self.settings.replace(nats_url=url)
            _logger.info("embedded nats-server ready", url=url)
        return self.settings.nats_url

    async def start_child(self, name: str, args: list[str]) -> Child:
        child = self._child(name, args)
        await child.start()
        self.children.append(child)
        return child

    async def start_services(self) -> None:
        for name in SERVICES:
            await self.start_child(name, ["run", name])
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            for child in self.children:
                proc = child.proc
                if self._stopping or proc is None or proc.returncode is None:
                    continue
                hint = " (killed: perhaps out of memory?)" if proc.returncode == -signal.SIGKILL else ""
                delay = min(2 ** child.restarts, 30)
                _logger.warning(f"child exited{hint}; restarting", child=child.name, code=proc.returncode, in_s=delay)
                child.restarts += 1
                await asyncio.sleep(delay)
                if not self._stopping:
                    await child.start()

    async def stop(self) -> None:
        self._stopping = True
        if self._watcher:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        services = [c for c in self.children if c.name in SERVICES]
        others = [c for c in self.children if c.name not in SERVICES]
        await asyncio.gather(*(c.stop(10.0) for c in services))
        await asyncio.gather(*(c.stop(10.0) for c in others))
        if self.nats:
            await self.nats.stop()
        _logger.info("all stopped")


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
