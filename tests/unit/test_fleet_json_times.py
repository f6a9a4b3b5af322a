"""`gpuledger fleet ... --json` gives times as every --json does: RFC 3339 with nanoseconds, and the raw
unix nanoseconds beside them (docs/operator-cli.md)."""

from __future__ import annotations

from gpuledger.inspect import with_times


def test_times_become_rfc3339_with_the_raw_value_beside_them() -> None:
    row = with_times({"node": "n1", "valid_from": 1_700_000_000_123_456_789, "valid_to": None},
                      "valid_from", "valid_to")
    assert row == {"node": "n1", "valid_from": "2023-11-14T22:13:20.123456789Z",
                   "valid_from_ns": 1_700_000_000_123_456_789, "valid_to": None, "valid_to_ns": None}
