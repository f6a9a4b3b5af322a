"""Loggers of the simulator, all under the `simulator.` name."""

from __future__ import annotations

from typing import Any

from libs.logger import get_logger

__all__ = ["logger"]


def logger(name: str) -> Any:
    return get_logger(f"simulator.{name}")
