"""Node simulator: a kubelet device manager, PodResources and a Kubernetes-shaped pod API on one
machine without root, for `gpuledger sim` and the test suite (spec: kubelet-device-plugin.md)."""

from __future__ import annotations

from .calls import RpcCall
from .config import SimConfig
from .devicemanager import ResourceInfo
from .simulator import NodeSimulator, run_simulator

__all__ = ["NodeSimulator", "ResourceInfo", "RpcCall", "SimConfig", "run_simulator"]
