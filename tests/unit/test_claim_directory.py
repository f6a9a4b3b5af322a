"""Which vm-root directory serves a prepared claim: the one its response (and so its CDI spec) mounts."""

from __future__ import annotations

from pathlib import Path

from libs.events.schema import ContainerResponse, GpuShare
from libs.placement.responses import build_response
from services.vmanager.tracker import claim_directory

CLAIM = "c1a1c1a1-0000-4000-8000-000000000001"
POD = "p0d0p0d0-0000-4000-8000-000000000002"


def _response(directory: str) -> ContainerResponse:
    share = GpuShare(index=0, uuid="GPU-0", minor=0, cores=30, memory=1 << 30)
    return build_response(shares=(share,), cores=30, memory=1 << 30, pod_uid=directory, vm_root=Path("/vm"),
                          vdriver_root=Path("/vdriver"), hami=None, container="c")


def test_a_claim_is_served_where_its_response_mounts_etc_vcuda() -> None:
    assert claim_directory(CLAIM, _response(CLAIM)) == CLAIM
    # Prepared by an earlier version: the first pod's directory, which stays served for it.
    assert claim_directory(CLAIM, _response(POD)) == POD


def test_without_a_vcuda_mount_the_claims_own_directory() -> None:
    response = _response(CLAIM)
    bare = ContainerResponse(envs=response.envs, mounts=(), devices=response.devices)
    assert claim_directory(CLAIM, bare) == CLAIM
