"""Run one service process: logging, signals, and the service's lifetime as an async context.

A service is an async context manager factory ``service(settings)``: entering it starts everything
(connections, servers, background tasks), leaving it stops them in reverse order. This module owns
the signals: SIGTERM or SIGINT ends the wait and the context is left cleanly. A background task that
fails cancels the wait too, and the process exits non-zero so its supervisor restarts just it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from libs.config import Settings
from libs.log import configure_logging, get_logger

__all__ = ["ServiceFactory", "run_service", "serve_until_stopped"]

ServiceFactory = Callable[[Settings], AbstractAsyncContextManager[Any]]


async def serve_until_stopped(name: str, settings: Settings, factory: ServiceFactory) -> None:
    log = get_logger(name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with factory(settings):
            log.info("service started", node=settings.node_name)
            await stop.wait()
            log.info("stopping")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("service stopped")


def run_service(name: str, settings: Settings, factory: ServiceFactory) -> int:
    configure_logging(name, fmt=settings.log_format, level=settings.log_level)
    try:
        asyncio.run(serve_until_stopped(name, settings, factory))
    except Exception as exc:  # the process ends here: report once, in the log's format
        get_logger(name).error("service failed", error=str(exc), exc_info=exc)
        return 1
    return 0
