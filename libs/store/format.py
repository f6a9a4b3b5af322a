"""The log's format version, apart from the SQLAlchemy schema: checking it needs no SQLAlchemy."""

from __future__ import annotations

__all__ = ["LOG_FORMAT_VERSION"]

LOG_FORMAT_VERSION = "1"
