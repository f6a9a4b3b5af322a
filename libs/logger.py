"""structlog set-up: JSON lines in production, readable lines on a terminal.

``LOG_FORMAT=json|console`` (or the ``--log-format`` option) overrides the TTY guess, because
``kubectl logs`` is never a TTY while ``gpuledger up`` may be piped.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

__all__ = ["CORRELATION_FIELDS", "RepeatedWarning", "bound", "configure_logging", "correlation", "get_logger"]

# What lets one allocation be followed across the services' log lines (bound as structlog contextvars).
CORRELATION_FIELDS = ("request_id", "alloc_id", "pod_uid", "container")


def _json_dumps(obj: Any, **_: Any) -> str:
    return msgspec.json.encode(obj).decode()


def configure_logging(service: str, *, fmt: str = "auto", level: str = "info", stream: Any = None,
                      cache: bool = False) -> None:
    """``cache``: each logger is bound once, at its first use, instead of at every call (a third of a
    line's cost, on every request's lines). Only for a process that never configures logging again:
    a service's (``libs.runtime.run_service``); structlog's ``capture_logs`` does not see cached ones."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer(serializer=_json_dumps)
        shared.append(structlog.processors.dict_tracebacks)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=cache,
    )
    # Third-party libraries (grpc, nats, aiohttp) log through stdlib logging: keep them quiet but visible.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(f"{service} %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)


def correlation(obj: Any, **given: Any) -> dict[str, Any]:
    """The correlation fields ``obj`` (a request or an event) carries, plus ``given``; empty values dropped."""
    found: dict[str, Any] = {}
    for k in CORRELATION_FIELDS:
        v = getattr(obj, k, None)
        if v and isinstance(v, str):
            found[k] = v
    for k, v in given.items():
        if v and isinstance(v, str):
            found[k] = v
    return found


class bound:
    """``with bound(**fields):`` the fields are in every log line written inside, and what was bound before
    is back after. structlog's ``bound_contextvars`` does the same but copies the whole log context on
    entry; this binds with contextvars tokens and resets them, which every served request and every
    followed event does."""

    __slots__ = ("_fields", "_tokens")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._tokens = structlog.contextvars.bind_contextvars(**self._fields)

    def __exit__(self, *_exc: object) -> None:
        structlog.contextvars.reset_contextvars(**self._tokens)


# How often a warning whose cause comes and goes is written at most (RepeatedWarning).
REPEAT_EVERY_S = 60.0


class RepeatedWarning:
    """A warning whose cause can come and go many times a second (a kubelet rejecting calls beyond its
    rate limit, answering the next one): the first is written at once, later ones at most every
    ``every`` seconds, each with ``occurrences`` (all so far) and ``left_out`` (those not written
    since the line before). A success in between does not start a new series, so an intermittent
    cause writes no more than a steady one; ``occurrences`` is there for a metric."""

    def __init__(self, logger: Any, event: str, *, every: float = REPEAT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.event = event
        self.every = every
        self.clock = clock
        self.occurrences = 0
        self._left_out = 0
        self._written_at: float | None = None

    def __call__(self, **fields: Any) -> bool:
        """One more occurrence; whether it was written."""
        self.occurrences += 1
        now = self.clock()
        if self._written_at is not None and now - self._written_at < self.every:
            self._left_out += 1
            return False
        if self._written_at is not None:
            fields.update(occurrences=self.occurrences, left_out=self._left_out)
        self.logger.warning(self.event, **fields)
        self._written_at = now
        self._left_out = 0
        return True
