"""vcuda.config codec: the golden bytes of the C struct, round trips, and values that do not fit."""

from __future__ import annotations

import pytest

from libs.ledger.state import Allocation
from libs.vcuda import SIZE, VcudaConfig, config_for, decode, encode, parse_driver_version
from tests.vmanager.helpers import BLOCK, golden_config, granted, new_pod_uid

UID = "3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f"


def sample(**changes: object) -> VcudaConfig:
    fields: dict[str, object] = dict(
        pod_uid=UID, limit=70, container_name="trainer", bus_id="0000:17:00.0",
        gpu_memory=3 * BLOCK, utilization=30, hard_limit=0, driver_major=550, driver_minor=54, enable=1,
    )
    fields.update(changes)
    return VcudaConfig(**fields)  # type: ignore[arg-type]


def test_size_is_the_c_struct() -> None:
    assert SIZE == 8240
    assert len(encode(sample())) == 8240


def test_golden_bytes() -> None:
    expected = golden_config(
        pod_uid=UID, limit=70, container_name="trainer", bus_id="0000:17:00.0",
        gpu_memory=805306368, utilization=30, hard_limit=0, driver_major=550, driver_minor=54, enable=1,
    )
    assert encode(sample()) == expected


def test_golden_bytes_large_values() -> None:
    cfg = sample(gpu_memory=(1 << 64) - 1, utilization=800, limit=0, hard_limit=1, enable=0,
                 container_name="c" * 4095, pod_uid="u" * 47, bus_id="b" * 15)
    expected = golden_config(
        pod_uid="u" * 47, limit=0, container_name="c" * 4095, bus_id="b" * 15,
        gpu_memory=(1 << 64) - 1, utilization=800, hard_limit=1, driver_major=550, driver_minor=54, enable=0,
    )
    assert encode(cfg) == expected


@pytest.mark.parametrize("cfg", [
    sample(),
    sample(bus_id="", limit=0, hard_limit=1),
    sample(container_name="c" * 4095, pod_uid="u" * 47, bus_id="b" * 15),
    sample(container_name="ünïcode", driver_major=0, driver_minor=0),
    sample(limit=-1, utilization=-(2**31), enable=2**31 - 1),
])
def test_round_trip(cfg: VcudaConfig) -> None:
    assert decode(encode(cfg)) == cfg


@pytest.mark.parametrize(("changes", "field"), [
    ({"pod_uid": "u" * 48}, "pod_uid"),
    ({"container_name": "c" * 4096}, "container_name"),
    ({"bus_id": "b" * 16}, "bus_id"),
    ({"container_name": "a\0b"}, "container_name"),
    ({"gpu_memory": -1}, "gpu_memory"),
    ({"gpu_memory": 1 << 64}, "gpu_memory"),
    ({"utilization": 2**31}, "utilization"),
    ({"limit": -(2**31) - 1}, "limit"),
])
def test_values_that_do_not_fit(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        encode(sample(**changes))


@pytest.mark.parametrize("size", [0, 8239, 8241, 8248])
def test_decode_wants_exactly_8240_bytes(size: int) -> None:
    with pytest.raises(ValueError, match="8240"):
        decode(bytes(size))


@pytest.mark.parametrize(("version", "expected"), [
    ("550.54.15", (550, 54)),
    ("535.183.01", (535, 183)),
    ("470.82", (470, 82)),
    (" 525.60.13\n", (525, 60)),
    ("", (0, 0)),
    ("550", (0, 0)),
    ("unknown", (0, 0)),
    ("550.x", (0, 0)),
    ("99999999999.1", (0, 0)),
])
def test_parse_driver_version(version: str, expected: tuple[int, int]) -> None:
    assert parse_driver_version(version) == expected


def alloc(**kw: object) -> Allocation:
    grant = granted(new_pod_uid(), "trainer", **kw)  # type: ignore[arg-type]
    return Allocation.from_event(grant, seq=1, at=0)


def test_config_for_hard_limit() -> None:
    a = alloc(cores=30, memory=3 * BLOCK)
    cfg = config_for(a, container_name="trainer", driver_version="550.54.15")
    assert cfg == VcudaConfig(pod_uid=a.pod_uid, limit=0, container_name="trainer", gpu_memory=805306368,
                              utilization=30, hard_limit=1, driver_major=550, driver_minor=54, enable=1)


def test_config_for_soft_limit_is_clamped() -> None:
    assert config_for(alloc(core_limit=70), container_name="t", driver_version="").limit == 70
    assert config_for(alloc(core_limit=70), container_name="t", driver_version="").hard_limit == 0
    assert config_for(alloc(core_limit=250), container_name="t", driver_version="").limit == 100
    assert config_for(alloc(core_limit=-5), container_name="t", driver_version="").limit == 0
    zero = config_for(alloc(core_limit=0), container_name="t", driver_version="")
    assert (zero.limit, zero.hard_limit) == (0, 0)  # present, even at 0: soft mode


def test_config_for_whole_gpus_disables_limits() -> None:
    cfg = config_for(alloc(cores=200), container_name="t", driver_version="bogus")
    assert (cfg.enable, cfg.utilization, cfg.driver_major, cfg.driver_minor) == (0, 200, 0, 0)
    assert config_for(alloc(cores=100), container_name="t", driver_version="").enable == 0
    assert config_for(alloc(cores=99), container_name="t", driver_version="").enable == 1
