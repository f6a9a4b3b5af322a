"""bench.pod_start's floor answers with gpuledger's own response, its vcuda directory replaced (pure logic)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from bench.pod_start import floor_response

ANSWERED = {  # an AllocateResponse as the simulator's call log keeps it (proto field names)
    "container_responses": [{
        "envs": {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"},
        "mounts": [
            {"container_path": "/usr/local/nvidia", "host_path": "/var/lib/gpuledger/vdriver", "read_only": True},
            {"container_path": "/etc/vcuda", "host_path": "/var/lib/gpuledger/vm/pod-1", "read_only": True},
        ],
        "devices": [{"container_path": "/dev/nvidia0", "host_path": "/dev/nvidia0", "permissions": "rwm"}],
    }],
}


def test_only_the_vcuda_mount_moves_and_the_answer_is_left_as_it_was() -> None:
    before = copy.deepcopy(ANSWERED)
    out = floor_response(ANSWERED, Path("/tmp/floor"))
    assert before == ANSWERED
    assert out["mounts"][1] == {"container_path": "/etc/vcuda", "host_path": "/tmp/floor", "read_only": True}
    assert out["mounts"][0] == before["container_responses"][0]["mounts"][0]
    assert out["devices"] == before["container_responses"][0]["devices"]
    assert out["envs"] == before["container_responses"][0]["envs"]


@pytest.mark.parametrize("answered", [
    {"container_responses": []},
    {"container_responses": [{"mounts": []}, {"mounts": []}]},
    {"container_responses": [{"mounts": [{"container_path": "/usr/local/nvidia", "host_path": "/d"}]}]},
])
def test_a_response_the_floor_cannot_mirror_is_refused(answered: dict) -> None:
    with pytest.raises(ValueError):
        floor_response(answered, Path("/f"))


def test_the_floor_and_the_durable_floor_register_apart() -> None:
    """Both floors run beside each other in one run: four resources, four plugin sockets."""
    from bench.echo_gpu import CORE, DURABLE_CORE, DURABLE_MEMORY, MEMORY, resources, socket_name

    assert resources(durable=False) == (CORE, MEMORY)
    assert resources(durable=True) == (DURABLE_CORE, DURABLE_MEMORY)
    names = {socket_name(r) for r in (*resources(durable=False), *resources(durable=True))}
    assert len(names) == 4 and all(n.startswith("bench-") and n.endswith(".sock") for n in names)
    assert socket_name(CORE) == "bench-floor-core.sock"  # as before the durable floor
