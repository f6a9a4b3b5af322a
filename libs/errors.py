"""The agent-wide error tree.

    GpuledgerError
    ├── ConfigError            a setting is missing or invalid
    ├── StoreError             the event log refused or failed an operation
    │   ├── AppendOnlyViolation    something tried to change a committed row
    │   ├── NoSpace                the disk holding the log is full: the write was rolled back whole
    │   ├── StartRefused           this process may not write the log at all (another writer, read-only dir)
    │   └── CorruptLog             a stored event cannot be decoded (names the seq)
    ├── BusError               NATS transport problems
    │   ├── BusTimeout             no reply within the deadline
    │   └── RemoteError            the peer answered with an error (code + message)
    ├── GpuError               the GPU inventory could not be read
    └── ServiceError           a handler refuses a request; becomes a RemoteError on the caller's side

Each error carries a message meant for an operator: what failed, with which value, and what to do.
"""

from __future__ import annotations

__all__ = [
    "AppendOnlyViolation",
    "BusError",
    "BusTimeout",
    "ConfigError",
    "CorruptLog",
    "GpuError",
    "GpuledgerError",
    "NoSpace",
    "RemoteError",
    "ServiceError",
    "StartRefused",
    "StoreError",
]


class GpuledgerError(Exception):
    """Base class of every error raised on purpose by gpuledger."""


class ConfigError(GpuledgerError):
    pass


class StoreError(GpuledgerError):
    pass


class AppendOnlyViolation(StoreError):
    pass


class NoSpace(StoreError):
    """SQLITE_FULL / ENOSPC: nothing of the failed write is in the log; the next one may succeed."""


class StartRefused(StoreError):
    """The service must not start; the message says why in one line (no traceback is worth printing)."""


class CorruptLog(StoreError):
    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"event log entry seq={seq} is unreadable: {reason}")
        self.seq = seq
        self.reason = reason


class BusError(GpuledgerError):
    pass


class BusTimeout(BusError):
    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(f"no reply on {subject} within {timeout:g}s")
        self.subject = subject
        self.timeout = timeout


class GpuError(GpuledgerError):
    pass


# Codes follow HTTP's meaning so that logs read naturally: 400 bad request, 404 unknown id,
# 409 conflict with recorded state, 503 not ready / capacity, 504 deadline passed, 500 bug.
class ServiceError(GpuledgerError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RemoteError(BusError):
    def __init__(self, subject: str, code: int, message: str) -> None:
        super().__init__(f"{subject}: {message} (code {code})")
        self.subject = subject
        self.code = code
        self.message = message
