"""Fake profile files: the bundled ones, overrides, and the errors a hand-written file can hit."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from libs.errors import GpuError
from libs.events.schema import InventoryRecorded
from libs.gpu import DEFAULT_FAKE_PROFILE, FakeBackend, GpuBackend, Inventory, load_inventory
from libs.gpu.fake import PROFILES_DIR, fake_uuid, parse_fake_profile, parse_memory

GiB = 1 << 30
UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def write(tmp_path: Path, text: str, name: str = "node.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_profile_is_the_demo_node() -> None:
    assert DEFAULT_FAKE_PROFILE == PROFILES_DIR / "demo-4gpu.yaml"
    inv = load_inventory("fake")
    assert inv.backend == "fake"
    assert inv.driver_version == "550.54.15"
    assert [g.index for g in inv.gpus] == [0, 1, 2, 3]
    assert [g.minor for g in inv.gpus] == [0, 1, 2, 3]
    assert all(g.memory == 16 * GiB for g in inv.gpus)
    assert [g.pci_bus_id for g in inv.gpus] == [
        "00000000:1A:00.0", "00000000:1C:00.0", "00000000:88:00.0", "00000000:8A:00.0"
    ]
    assert inv.links == (
        ("X", "NV2", "SYS", "SYS"),
        ("NV2", "X", "SYS", "SYS"),
        ("SYS", "SYS", "X", "NV2"),
        ("SYS", "SYS", "NV2", "X"),
    )
    assert inv == FakeBackend().inventory()


def test_dgx_profile() -> None:
    inv = load_inventory(f"fake:{PROFILES_DIR / 'dgx-a100-8gpu.yaml'}")
    assert len(inv.gpus) == 8
    assert {g.memory for g in inv.gpus} == {80 * GiB}
    assert {g.name for g in inv.gpus} == {"NVIDIA A100-SXM4-80GB"}
    assert inv.links == tuple(tuple("X" if i == j else "NV12" for j in range(8)) for i in range(8))


def test_pcie_profile() -> None:
    inv = load_inventory(f"fake:{PROFILES_DIR / 'pcie-4gpu.yaml'}")
    assert {g.memory for g in inv.gpus} == {24 * GiB}
    assert inv.links == (
        ("X", "PIX", "PHB", "PHB"),
        ("PIX", "X", "PHB", "PHB"),
        ("PHB", "PHB", "X", "PIX"),
        ("PHB", "PHB", "PIX", "X"),
    )


@pytest.mark.parametrize("path", sorted(PROFILES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_bundled_profile_loads(path: Path) -> None:
    backend = FakeBackend(path)
    assert isinstance(backend, GpuBackend)
    inv = backend.inventory()
    backend.close()
    n = len(inv.gpus)
    assert n >= 1
    assert all(UUID_RE.fullmatch(g.uuid) for g in inv.gpus)
    assert len({g.uuid for g in inv.gpus}) == n
    assert len(inv.links) == n and all(len(row) == n and row[i] == "X" for i, row in enumerate(inv.links))
    # What the allocator records must round-trip through the event codec.
    event = InventoryRecorded(node="n1", backend=inv.backend, driver_version=inv.driver_version,
                              gpus=inv.gpus, links=inv.links)
    assert msgspec.json.decode(msgspec.json.encode(event), type=InventoryRecorded) == event
    assert msgspec.json.decode(msgspec.json.encode(inv), type=Inventory) == inv


def test_count_only_defaults(tmp_path: Path) -> None:
    inv = FakeBackend(write(tmp_path, "memory: 8GiB\ncount: 3\nname: Tesla T4\n")).inventory()
    assert inv.driver_version == ""
    assert [(g.index, g.minor, g.pci_bus_id, g.memory, g.name) for g in inv.gpus] == [
        (0, 0, "00000000:10:00.0", 8 * GiB, "Tesla T4"),
        (1, 1, "00000000:11:00.0", 8 * GiB, "Tesla T4"),
        (2, 2, "00000000:12:00.0", 8 * GiB, "Tesla T4"),
    ]
    # Without a topology every pair sits behind one host bridge.
    assert inv.links == (("X", "PHB", "PHB"), ("PHB", "X", "PHB"), ("PHB", "PHB", "X"))


def test_per_gpu_overrides(tmp_path: Path) -> None:
    text = """\
driver_version: 535.10
name: Tesla T4
memory: 16GiB
gpus:
  - {uuid: GPU-11111111-2222-3333-4444-555555555555, pci_bus_id: 00000000:10:00.0, minor: 5}
  -
  - memory: 32GiB
    name: Tesla V100-PCIE-32GB
"""
    inv = FakeBackend(write(tmp_path, text)).inventory()
    assert inv.driver_version == "535.10"  # YAML would read the bare value as the float 535.1
    g0, g1, g2 = inv.gpus
    assert (g0.uuid, g0.pci_bus_id, g0.minor, g0.memory, g0.name) == (
        "GPU-11111111-2222-3333-4444-555555555555", "00000000:10:00.0", 5, 16 * GiB, "Tesla T4"
    )
    assert (g1.minor, g1.memory, g1.pci_bus_id, g1.name) == (1, 16 * GiB, "00000000:11:00.0", "Tesla T4")
    assert (g2.minor, g2.memory, g2.name) == (2, 32 * GiB, "Tesla V100-PCIE-32GB")
    assert UUID_RE.fullmatch(g1.uuid) and UUID_RE.fullmatch(g2.uuid)


def test_topology_with_gpus_and_count_that_agree(tmp_path: Path) -> None:
    text = """\
memory: 24GiB
count: 2
gpus: [{name: a}, {name: b}]
topology: |2
          GPU0    GPU1    CPU Affinity    NUMA Affinity
  GPU0     X      NV4     0-23            0
  GPU1    NV4      X      0-23            0
"""
    inv = FakeBackend(write(tmp_path, text)).inventory()
    assert [g.name for g in inv.gpus] == ["a", "b"]
    assert inv.links == (("X", "NV4"), ("NV4", "X"))


def test_topology_with_tabs_pasted(tmp_path: Path) -> None:
    text = (
        "memory: 1GiB\ntopology: |2\n"
        "  \tGPU0\tGPU1\tCPU Affinity\n"
        "  GPU0\t X \tPIX\t0-3\n"
        "  GPU1\tPIX\t X \t0-3\n"
    )
    assert FakeBackend(write(tmp_path, text)).inventory().links == (("X", "PIX"), ("PIX", "X"))


def test_uuids_are_deterministic(tmp_path: Path) -> None:
    a = FakeBackend(write(tmp_path, "memory: 1GiB\ncount: 4\n", "node-a.yaml")).inventory()
    again = FakeBackend(tmp_path / "node-a.yaml").inventory()
    b = FakeBackend(write(tmp_path, "memory: 1GiB\ncount: 4\n", "node-b.yaml")).inventory()
    named = FakeBackend(write(tmp_path, "profile: node-a\nmemory: 1GiB\ncount: 4\n", "x.yaml")).inventory()
    assert [g.uuid for g in a.gpus] == [g.uuid for g in again.gpus] == [g.uuid for g in named.gpus]
    assert len({g.uuid for g in a.gpus}) == 4
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in b.gpus}
    assert a.gpus[2].uuid == fake_uuid("node-a", 2) != fake_uuid("node-a", 3)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (17179869184, 16 * GiB),
        ("17179869184", 16 * GiB),
        ("16GiB", 16 * GiB),
        ("16 GiB", 16 * GiB),
        ("16gib", 16 * GiB),
        ("16384MiB", 16 * GiB),
        ("81920 MiB", 80 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("1TiB", 1 << 40),
        ("512KiB", 512 << 10),
        ("4096B", 4096),
    ],
)
def test_memory_units(value: object, expected: int) -> None:
    assert parse_memory(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("80GB", "ambiguous unit 'GB'"),
        ("16G", "ambiguous unit 'G'"),
        ("16 MB", "ambiguous unit 'MB'"),
        ("16 parsecs", "unknown unit"),
        ("lots", "is not a size"),
        ("0.3B", "not a whole number of bytes"),
        (0, "more than 0"),
        ("0GiB", "more than 0"),
        (-5, "more than 0"),
        (1.5e10, "is not a size"),
        (True, "is not a size"),
        (None, "is not a size"),
    ],
)
def test_bad_memory(value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_memory(value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("memory: 1GiB\ncount: 3\ngpus: [{}, {}]\n", "the GPU count disagrees: gpus gives 2, count gives 3"),
        (
            "memory: 1GiB\ncount: 2\ntopology: |2\n    GPU0\n  GPU0 X\n",
            "the GPU count disagrees: topology gives 1, count gives 2",
        ),
        ("memory: 1GiB\nmemroy: 2GiB\ncount: 1\n", "line 2: unknown key 'memroy' (did you mean 'memory'?)"),
        ("memory: 1GiB\ncount: 1\ngpus:\n  - {mem: 1GiB}\n", "line 4: gpus[0]: unknown key 'mem'"),
        ("count: 2\n", "no memory for GPU 0"),
        ("count: 2\ngpus:\n  - {memory: 1GiB}\n  - {name: x}\n", "line 4: gpus[1]: no memory for GPU 1"),
        ("memory: 80GB\ncount: 1\n", "line 1: memory: ambiguous unit 'GB'"),
        ("memory: 1GiB\n", "no GPU count"),
        ("memory: 1GiB\ncount: 0\n", "count: expected a whole number >= 1, got '0'"),
        ("memory: 1GiB\ncount: two\n", "count: expected a whole number >= 1"),
        ("memory: 1GiB\ngpus: []\n", "gpus: the list is empty"),
        ("memory: 1GiB\ngpus: {a: 1}\n", "gpus: expected a list"),
        ("memory: 1GiB\ncount: 1\ncount: 1\n", "line 3: key 'count' is given twice"),
        ("- memory\n", "line 1: expected a mapping"),
        ("", "is empty; give at least memory and count"),
        ("memory: [1GiB\n", "not valid YAML"),
        (
            "memory: 1GiB\ngpus:\n  - {uuid: GPU-1}\n  - {uuid: GPU-1}\n",
            "uuid: GPU 0 and GPU 1 both have uuid 'GPU-1'",
        ),
        ("memory: 1GiB\ngpus: [{minor: 1}, {}]\n", "minor: GPU 0 and GPU 1 both have minor 1"),
        ("memory: 1GiB\ngpus: [{minor: -1}]\n", "gpus[0].minor: expected a whole number >= 0"),
        ("memory: 1GiB\ngpus: [{uuid: ''}]\n", "gpus[0].uuid: is empty"),
        ("memory: 1GiB\nname: [a]\ncount: 1\n", "line 2: name: expected text"),
        (
            "memory: 1GiB\ntopology: |2\n    GPU0 GPU1\n  GPU0 X PIX\n  GPU1 PHB X\n",
            "line 2: topology: topology matrix is not symmetric: GPU0->GPU1 is 'PIX'",
        ),
        ("memory: 1GiB\ntopology: 3\n", "topology: expected pasted `nvidia-smi topo -m` text"),
        ("memory: !!python/name:os.system\ncount: 1\n", "line 1: memory: could not determine a constructor"),
        (
            "memory: 1GiB\ntopology: |\n      GPU0 GPU1\n  GPU0 X PIX\n  GPU1 PIX X\n",
            "write `topology: |2`",
        ),
    ],
)
def test_file_errors(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(GpuError) as info:
        load_inventory(f"fake:{path}")
    assert f"fake GPU file {path}" in str(info.value)
    assert message in str(info.value)


def test_unreadable_and_unknown_specs(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(GpuError, match=r"nope\.yaml: cannot read it: No such file or directory"):
        load_inventory(f"fake:{missing}")
    with pytest.raises(GpuError, match="needs a file"):
        load_inventory("fake:")
    for spec in ("", "gpu", "FAKE", "nvml:x"):
        with pytest.raises(GpuError, match="unknown GPU source"):
            load_inventory(spec)


def test_parse_fake_profile_from_text() -> None:
    inv = parse_fake_profile("memory: 2GiB\ncount: 1\n", source="inline", profile="p")
    assert inv.gpus[0].uuid == fake_uuid("p", 0)
    with pytest.raises(GpuError, match="fake GPU file inline: no GPU count"):
        parse_fake_profile("memory: 2GiB\n", source="inline")
