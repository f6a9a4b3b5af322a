"""bench.pod_start's floor answers with gpuledger's own response, its vcuda directory replaced (pure logic)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from bench.pod_start import floor_response

ANSWERED = {  # an AllocateResponse as the simulator's call log keeps it (MessageToDict's field names)
    "containerResponses": [{
        "envs": {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"},
        "mounts": [
            {"containerPath": "/usr/local/nvidia", "hostPath": "/var/lib/gpuledger/vdriver", "readOnly": True},
            {"containerPath": "/etc/vcuda", "hostPath": "/var/lib/gpuledger/vm/pod-1", "readOnly": True},
        ],
        "devices": [{"containerPath": "/dev/nvidia0", "hostPath": "/dev/nvidia0", "permissions": "rwm"}],
    }],
}


def test_only_the_vcuda_mount_moves_and_the_answer_is_left_as_it_was() -> None:
    before = copy.deepcopy(ANSWERED)
    out = floor_response(ANSWERED, Path("/tmp/floor"))
    assert before == ANSWERED
    assert out["mounts"][1] == {"containerPath": "/etc/vcuda", "hostPath": "/tmp/floor", "readOnly": True}
    assert out["mounts"][0] == before["containerResponses"][0]["mounts"][0]
    assert out["devices"] == before["containerResponses"][0]["devices"]
    assert out["envs"] == before["containerResponses"][0]["envs"]


def test_the_proto_field_names_are_read_too() -> None:
    answered = {"container_responses": [{"mounts": [{"container_path": "/etc/vcuda", "host_path": "/x"}]}]}
    assert floor_response(answered, Path("/f"))["mounts"] == [{"container_path": "/etc/vcuda", "host_path": "/f"}]


@pytest.mark.parametrize("answered", [
    {"containerResponses": []},
    {"containerResponses": [{"mounts": []}, {"mounts": []}]},
    {"containerResponses": [{"mounts": [{"containerPath": "/usr/local/nvidia", "hostPath": "/d"}]}]},
])
def test_a_response_the_floor_cannot_mirror_is_refused(answered: dict) -> None:
    with pytest.raises(ValueError):
        floor_response(answered, Path("/f"))
