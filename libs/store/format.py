"""The log's format version, in a module of its own: whoever checks a format needs nothing else.

Format 1 stored every column as its readers see it (``stream_id`` and ``type`` as text, an index per
key). Format 2 (docs/compact-log.md, "Rows") stores the same rows smaller in the table ``rows``, and
presents them as the view ``events`` with format 1's columns, so every reader reads both alike.
A format 1 log is read, and appended to, in its own format (``libs.store.layout``).
"""

from __future__ import annotations

__all__ = ["LOG_FORMAT_VERSION", "READABLE_FORMATS"]

LOG_FORMAT_VERSION = "2"
READABLE_FORMATS = ("1", "2")
