"""Run one service process: logging, signals, and the service's lifetime as an async context.

A service is an async context manager factory ``service(settings)``: entering it starts everything
(connections, servers, background tasks), leaving it stops them in reverse order. This module owns
the signals: SIGTERM or SIGINT ends the wait and the context is left cleanly. A background task that
fails cancels the wait too, and the process exits non-zero so its supervisor restarts just it.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from libs.config import Settings
from libs.errors import StartRefused
from libs.logger import configure_logging, get_logger

__all__ = ["ServiceFactory", "Supervisor", "discard", "run_service", "serve_until_stopped"]


def discard(future: asyncio.Future[Any]) -> None:
    """Drop work started ahead whose answer nobody wants any more: cancelled while it runs; once done,
    its failure is marked as looked at (no one's error, not "exception was never retrieved")."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


ServiceFactory = Callable[[Settings], AbstractAsyncContextManager[Any]]


async def serve_until_stopped(name: str, settings: Settings, factory: ServiceFactory) -> None:
    logger = get_logger(name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        cm = factory(settings)
        # Starting may wait on things that are not there yet (NATS, the kubelet): a signal must end
        # that wait too, so the start runs as a task raced against the stop event.
        svc = await _start_or_stop(cm, stop)
        if svc is _STOPPED:
            logger.info("stopped before the service started")
            return
        async with _entered(cm):
            logger.info("service started", node=settings.node_name)
            settle_gc()
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
            supervisor = getattr(svc, "supervisor", None)
            if isinstance(supervisor, Supervisor):
                waits.append(supervisor.failure)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()
            if supervisor is not None and supervisor.failure.done() and not supervisor.failure.cancelled():
                raise supervisor.failure.exception()  # type: ignore[misc]
            logger.info("stopping")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    logger.info("service stopped")


_STOPPED = object()


async def _start_or_stop(cm: AbstractAsyncContextManager[Any], stop: asyncio.Event) -> Any:
    """``await cm.__aenter__()``, unless ``stop`` is set first: then cancel the start and return _STOPPED."""
    enter = asyncio.ensure_future(cm.__aenter__())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([enter, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not enter.done():
            enter.cancel()  # the factory's own cleanups run as the cancellation unwinds it
            # Bounded: its cleanups should finish before the loop closes, but must not hold the stop.
            await asyncio.wait([enter], timeout=STOP_UNWIND_S)
    if not enter.done() or enter.cancelled():
        return _STOPPED
    if enter.exception() is not None and stop.is_set():
        return _STOPPED  # it failed because it was being stopped
    svc = enter.result()  # raises the start's own error
    if stop.is_set():  # started in the same instant as the signal: leave it again
        await cm.__aexit__(None, None, None)
        return _STOPPED
    return svc


STOP_UNWIND_S = 5.0

# The cyclic collector, once a service has started: what start-up built (modules, clients, the replayed
# state) is moved out of its reach, and young objects are collected less often. A service's request
# objects die by reference counting; with the defaults a collection ran in one Allocate of four, and
# every full pass walked every module (47 ms in the allocator, at p99.9 of the Allocate benchmark).
GC_THRESHOLDS = (20_000, 50, 50)


def settle_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@asynccontextmanager
async def _entered(cm: AbstractAsyncContextManager[Any]) -> AsyncIterator[None]:
    """Leave an already entered context manager, passing on any exception."""
    try:
        yield
    except BaseException as exc:
        if not await cm.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await cm.__aexit__(None, None, None)


def run_service(name: str, settings: Settings, factory: ServiceFactory, *, uvloop: bool = False) -> int:
    """``uvloop``: run on uvloop's event loop instead of asyncio's (gpuledger/agent.py says which)."""
    configure_logging(name, fmt=settings.log_format, level=settings.log_level, cache=True)
    try:
        if uvloop:
            import uvloop as fast  # only the processes that use it pay for its library

            fast.run(serve_until_stopped(name, settings, factory))
        else:
            asyncio.run(serve_until_stopped(name, settings, factory))
    except KeyboardInterrupt:  # SIGINT before the loop's handlers were in place: nothing had started
        return 0
    except StartRefused as exc:  # a second writer, a read-only state dir: one line says it all
        get_logger(name).error("refused to start", error=str(exc))
        return 2
    except Exception as exc:  # the process ends here: report once, in the log's format
        get_logger(name).error("service failed", error=str(exc), exc_info=exc)
        return 1
    return 0


class Supervisor:
    """A service's background tasks. The first one to fail ends the service (and the process).

    A service object exposes it as ``.supervisor``; ``serve_until_stopped`` waits for a signal or for
    ``failure``, whichever comes first.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failure: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.failure.done():
            return
        exc = task.exception()
        err = exc or RuntimeError(f"background task {task.get_name()} ended unexpectedly")
        self.failure.set_exception(err)

    async def aclose(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for them, at most ``timeout`` seconds: a task that ignores its
        cancellation is reported (with where it is stuck) instead of holding the service's stop forever."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _done, stuck = await asyncio.wait(tasks, timeout=timeout)
            for task in stuck:
                where = [f"{f.f_code.co_filename}:{f.f_lineno}" for f in task.get_stack()]
                get_logger(self.name).error("task did not stop when cancelled", task=task.get_name(), at=where)
        if not self.failure.done():
            self.failure.cancel()
        elif not self.failure.cancelled():
            self.failure.exception()  # mark retrieved: it was reported by serve_until_stopped
