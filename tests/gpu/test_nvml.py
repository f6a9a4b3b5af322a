"""The NVML adapter against a small hand-written `pynvml` stand-in (no GPU needed).

The stand-in mimics pynvml's surface: module-level functions, NVMLError subclasses, constants, and
structs whose string fields are bytes on some versions and str on others.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import structlog

from libs.errors import GpuError
from libs.gpu import DEFAULT_FAKE_PROFILE, FakeBackend, GpuBackend, NvmlBackend, load_inventory

GiB = 1 << 30


class NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3, "Not Supported")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12, "NVML Shared Library Not Found")


class FakeNvml:
    """State behind the stand-in module; `calls` records init/shutdown."""

    def __init__(
        self,
        gpus: list[dict[str, Any]],
        levels: dict[tuple[int, int], int],
        nvlinks: dict[int, list[tuple[int, Any]]],  # gpu -> [(state, remote bus id or ("switch", id))]
        *,
        init_error: Exception | None = None,
        driver: Any = b"550.54.15",
    ) -> None:
        self.gpus = gpus
        self.levels = levels
        self.nvlinks = nvlinks
        self.init_error = init_error
        self.driver = driver
        self.calls: list[str] = []
        self.fail: dict[str, Exception] = {}

    def module(self) -> ModuleType:
        m = ModuleType("pynvml")
        m.NVMLError = NVMLError  # type: ignore[attr-defined]
        m.NVMLError_NotSupported = NVMLError_NotSupported  # type: ignore[attr-defined]
        m.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound  # type: ignore[attr-defined]
        consts = {"NVML_FEATURE_ENABLED": 1, "NVML_FEATURE_DISABLED": 0, "NVML_NVLINK_MAX_LINKS": 6,
                  "NVML_NVLINK_DEVICE_TYPE_GPU": 0, "NVML_NVLINK_DEVICE_TYPE_SWITCH": 2}
        for name, value in consts.items():
            setattr(m, name, value)
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(m, name, getattr(self, name))
        return m

    def _check(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> Any:
        self._check("driver")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return SimpleNamespace(i=i)

    def nvmlDeviceGetUUID(self, h: Any) -> Any:
        self._check("uuid")
        return self.gpus[h.i]["uuid"]

    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        return int(self.gpus[h.i]["minor"])

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return SimpleNamespace(busId=self.gpus[h.i]["bus"], domain=0)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        return SimpleNamespace(total=self.gpus[h.i]["memory"], free=1, used=0)

    def nvmlDeviceGetName(self, h: Any) -> Any:
        return self.gpus[h.i]["name"]

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int:
        key = (min(a.i, b.i), max(a.i, b.i))
        if key not in self.levels:
            raise NVMLError_NotSupported()
        return self.levels[key]

    def _link(self, h: Any, link: int) -> tuple[int, Any]:
        links = self.nvlinks.get(h.i)
        if links is None:
            raise NVMLError_NotSupported()  # a GPU without NVLink
        if link >= len(links):
            raise NVMLError(2, "Invalid Argument")
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        return self._link(h, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:
        remote = self._link(h, link)[1]
        return SimpleNamespace(busId=remote[1] if isinstance(remote, tuple) else remote)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Any, link: int) -> int:
        return 2 if isinstance(self._link(h, link)[1], tuple) else 0


def four_gpus() -> FakeNvml:
    """GPU0-GPU1 and GPU2-GPU3 NVLink-bridged (2 links each); mixed PCIe levels otherwise."""
    gpus = [
        {"uuid": b"GPU-aaaaaaaa-0000-0000-0000-000000000000", "minor": 2, "bus": b"00000000:1A:00.0",
         "memory": 16 * GiB, "name": b"Tesla V100-SXM2-16GB"},
        {"uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000", "minor": 3, "bus": "00000000:1C:00.0",
         "memory": 16 * GiB, "name": "Tesla V100-SXM2-16GB"},
        {"uuid": "GPU-cccccccc-0000-0000-0000-000000000000", "minor": 0, "bus": b"00000000:88:00.0\x00\x00",
         "memory": 32 * GiB, "name": b"Tesla V100-SXM2-32GB"},
        {"uuid": b"GPU-dddddddd-0000-0000-0000-000000000000", "minor": 1, "bus": "00000000:8A:00.0",
         "memory": 32 * GiB, "name": "Tesla V100-SXM2-32GB"},
    ]
    levels = {(0, 2): 50, (0, 3): 40, (1, 2): 30, (1, 3): 20}  # SYSTEM, NODE, HOSTBRIDGE, MULTIPLE
    on, off = 1, 0
    nvlinks = {
        # remote bus ids in other spellings: 4-digit domain, lower case, bytes
        0: [(on, "0000:1c:00.0"), (on, b"00000000:1C:00.0"), (off, "")],
        1: [(on, b"0000:1a:00.0"), (on, "00000000:1a:00.0")],
        2: [(on, "00000000:8A:00.0"), (on, "00000000:8A:00.0"), (on, "00000000:FF:00.0")],  # a non-GPU peer
        3: [(on, "00000000:88:00.0"), (off, "00000000:88:00.0")],  # one direction sees only one link
    }
    return FakeNvml(gpus, levels, nvlinks)


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def _install(fake: FakeNvml) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", fake.module())
        return fake

    return _install


def test_four_gpus_two_nvlink_pairs(install: Any) -> None:
    fake = install(four_gpus())
    inv = load_inventory("nvml")
    assert fake.calls == ["init", "shutdown"]
    assert inv.backend == "nvml"
    assert inv.driver_version == "550.54.15"
    v16, v32 = "Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"
    assert [(g.index, g.minor, g.uuid, g.pci_bus_id, g.memory, g.name) for g in inv.gpus] == [
        (0, 2, "GPU-aaaaaaaa-0000-0000-0000-000000000000", "00000000:1A:00.0", 16 * GiB, v16),
        (1, 3, "GPU-bbbbbbbb-0000-0000-0000-000000000000", "00000000:1C:00.0", 16 * GiB, v16),
        (2, 0, "GPU-cccccccc-0000-0000-0000-000000000000", "00000000:88:00.0", 32 * GiB, v32),
        (3, 1, "GPU-dddddddd-0000-0000-0000-000000000000", "00000000:8A:00.0", 32 * GiB, v32),
    ]
    assert inv.links == (
        ("X", "NV2", "SYS", "NODE"),
        ("NV2", "X", "PHB", "PXB"),
        ("SYS", "PHB", "X", "NV2"),
        ("NODE", "PXB", "NV2", "X"),
    )
    assert load_inventory("auto") == inv


@pytest.mark.parametrize(
    ("level", "token"),
    [(0, "PIX"), (10, "PIX"), (20, "PXB"), (30, "PHB"), (40, "NODE"), (50, "SYS"), (60, "SYS"),
     (None, "SYS")],
)
def test_pcie_levels_without_nvlink(install: Any, level: int | None, token: str) -> None:
    gpus = [{"uuid": f"GPU-{i}", "minor": i, "bus": f"00000000:{i + 1:02X}:00.0", "memory": GiB, "name": "g"}
            for i in range(2)]
    # level 0 (INTERNAL) between two devices is a dual-GPU board; None: NVML says NotSupported.
    install(FakeNvml(gpus, {} if level is None else {(0, 1): level}, {}, driver="550.54.15"))
    inv = load_inventory("nvml")
    assert inv.driver_version == "550.54.15"
    assert inv.links == (("X", token), (token, "X"))


def test_nvswitch_gpus_show_nv_links_to_each_other(install: Any) -> None:
    gpus = [{"uuid": f"GPU-{i}", "minor": i, "bus": f"00000000:{i + 1:02X}:00.0", "memory": GiB, "name": "g"}
            for i in range(3)]
    to_switch = [(1, ("switch", f"00000000:C{k}:00.0")) for k in range(6)]
    half = to_switch[:3] + [(0, ("switch", "00000000:C9:00.0"))] * 3
    levels = {(0, 1): 50, (0, 2): 50, (1, 2): 50}
    fake = install(FakeNvml(gpus, levels, {0: to_switch, 1: to_switch, 2: half}))
    assert NvmlBackend().inventory().links == (("X", "NV6", "NV3"), ("NV6", "X", "NV3"), ("NV3", "NV3", "X"))
    assert fake.calls == ["init"]


def test_backend_protocol_and_close(install: Any) -> None:
    fake = install(four_gpus())
    backend = NvmlBackend()
    assert isinstance(backend, GpuBackend)
    assert backend.device_count() == 4
    backend.close()
    backend.close()
    assert fake.calls == ["init", "shutdown"]
    with pytest.raises(GpuError, match="closed"):
        backend.inventory()


def test_optional_queries_may_fail(install: Any) -> None:
    fake = install(four_gpus())
    fake.fail["driver"] = NVMLError_NotSupported()
    assert load_inventory("nvml").driver_version == ""


def test_required_query_failure_is_a_gpu_error_even_for_auto(install: Any) -> None:
    fake = install(four_gpus())
    fake.fail["uuid"] = NVMLError(15, "GPU is lost")
    for spec in ("nvml", "auto"):  # a broken real GPU must not quietly become a fake one
        with pytest.raises(GpuError, match=r"nvmlDeviceGetUUID\(GPU 0\) failed: GPU is lost"):
            load_inventory(spec)
    assert fake.calls == ["init", "shutdown", "init", "shutdown"]


def test_init_failure(install: Any) -> None:
    fake = install(FakeNvml([], {}, {}, init_error=NVMLError_LibraryNotFound()))
    with pytest.raises(GpuError) as info:
        load_inventory("nvml")
    assert str(info.value) == (
        "NVML is not available: NVML Shared Library Not Found; "
        "use --gpus fake:FILE (or fake) to run without GPUs"
    )
    with structlog.testing.capture_logs() as logs:
        inv = load_inventory("auto")
    assert inv == FakeBackend(DEFAULT_FAKE_PROFILE).inventory()
    assert inv.backend == "fake"
    assert logs == [
        {"event": "using fake GPUs", "log_level": "warning", "reason": "NVML Shared Library Not Found",
         "profile": str(DEFAULT_FAKE_PROFILE)}
    ]
    assert fake.calls == ["init", "init"]  # nothing to shut down after a failed init


def test_no_gpus(install: Any) -> None:
    fake = install(FakeNvml([], {}, {}))
    with pytest.raises(GpuError, match="NVML works but reports no GPUs"):
        load_inventory("nvml")
    with structlog.testing.capture_logs() as logs:
        assert load_inventory("auto").backend == "fake"
    assert [(e["event"], e["reason"]) for e in logs] == [("using fake GPUs", "NVML reports no GPUs")]
    assert fake.calls == ["init", "shutdown", "init", "shutdown"]


def test_missing_pynvml_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(GpuError, match="NVML is not available: cannot import pynvml"):
        load_inventory("nvml")
    with structlog.testing.capture_logs():
        assert load_inventory("auto").backend == "fake"
