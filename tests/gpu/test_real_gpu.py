"""Smoke test on a machine with an NVIDIA GPU (run with GPULEDGER_GPU_TESTS=1)."""

from __future__ import annotations

import pytest

from libs.gpu import link_level, load_inventory


@pytest.mark.gpu
def test_real_nvml_inventory() -> None:
    inv = load_inventory("nvml")
    n = len(inv.gpus)
    assert inv.backend == "nvml"
    assert n >= 1
    assert inv.driver_version
    assert [g.index for g in inv.gpus] == list(range(n))
    for g in inv.gpus:
        assert g.uuid.startswith("GPU-")
        assert g.memory > 0
        assert g.pci_bus_id
    assert len({g.minor for g in inv.gpus}) == n
    assert len(inv.links) == n
    for i, row in enumerate(inv.links):
        assert len(row) == n
        assert row[i] == "X"
        for j, token in enumerate(row):
            link_level(token)  # a known token
            assert token == inv.links[j][i]
    assert load_inventory("auto") == inv
