"""Pure rules of the watchdog: the model label value, which pods failed admission, who owns a pod."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from libs.kube.pods import Pod
from services.watchdog.admission import admission_failed, controller_owned
from services.watchdog.labels import model_label_value


@pytest.mark.parametrize(("name", "value"), [
    ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"),
    ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
    ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX-2080-Ti"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada-Generation"),
    ("NVIDIA", "NVIDIA"),
    ("", ""),
    ("NVIDIA H100 (PCIe) / 80GB" + " x" * 40, "H100-PCIe-80GB" + "-x" * 24),
])
def test_model_label_values_are_valid_and_not_empty_for_datacenter_names(name: str, value: str) -> None:
    got = model_label_value(name)
    assert got == value
    assert len(got) <= 63 and (not got or (got[0].isalnum() and got[-1].isalnum()))


def pod(phase: str = "Failed", reason: str = "", waiting_message: str = "", owners: list[dict[str, Any]] | None = None,
        gpu: bool = True) -> Pod:
    limits = {"tencent.com/vcuda-core": "50"} if gpu else {}
    statuses = [{"name": "c", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                    "message": waiting_message}}}] if waiting_message else []
    return msgspec.convert({
        "metadata": {"name": "p", "ownerReferences": owners or []},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": phase, "reason": reason, "containerStatuses": statuses},
    }, Pod)


def test_admission_failures_as_gpu_manager_defines_them() -> None:
    assert admission_failed(pod(reason="UnexpectedAdmissionError"))
    assert admission_failed(pod(phase="Pending", waiting_message="rpc error: PreStartContainer check failed, no"))
    assert not admission_failed(pod(phase="Running", reason="UnexpectedAdmissionError"))
    assert not admission_failed(pod(reason="OutOfcpu"))
    assert not admission_failed(pod(reason="UnexpectedAdmissionError", gpu=False))
    assert not admission_failed(pod(phase="Pending", waiting_message="image pull back-off"))


def test_only_controller_owners_count() -> None:
    rs = {"kind": "ReplicaSet", "name": "r", "uid": "u", "controller": True}
    assert controller_owned(pod(owners=[rs]))
    assert not controller_owned(pod(owners=[{**rs, "controller": False}]))
    assert not controller_owned(pod(owners=[]))
    assert not controller_owned(pod(owners=[{**rs, "kind": "Pod"}]))
