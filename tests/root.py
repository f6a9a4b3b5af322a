"""Tests that need root: skipped with one line without it, a failure in CI (GPULEDGER_REQUIRE_ROOT_TESTS=1)."""

from __future__ import annotations

import os

import pytest

REQUIRE_ROOT_ENV = "GPULEDGER_REQUIRE_ROOT_TESTS"


def cannot(why: str) -> None:
    """This test cannot run here: fail where root tests are required, else skip saying why."""
    if os.environ.get(REQUIRE_ROOT_ENV) == "1":
        pytest.fail(f"{why}, and {REQUIRE_ROOT_ENV}=1")
    pytest.skip(f"{why} (set {REQUIRE_ROOT_ENV}=1 to fail instead)")


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        cannot(f"{what} needs root")
