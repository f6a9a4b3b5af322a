"""gpuledger import-checkpoint: a node that ran gpu-manager keeps its allocations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libs.bus.server import NatsServer
from libs.config import Settings
from libs.events.schema import AllocationReleased
from libs.ledger.state import LedgerState
from libs.store import EventLog, replay
from services.allocator import app as allocator_app

GIB = 1 << 30
# The shape gpu-manager writes (gpu-manager-reference.md 4.4): Go field names, Memory in bytes.
CHECKPOINT = {"PodGPUMapping": {
    "0f6a-uid-trainer": {"trainer": {"Devices": ["/dev/nvidia0", "/dev/nvidia1"], "Cores": 200, "Memory": 0}},
    "7c21-uid-notebook": {
        "nb": {"Devices": ["/dev/nvidia2"], "Cores": 30, "Memory": 2 * GIB},
        "sidecar": {"Devices": ["/dev/nvidia2"], "Cores": 20, "Memory": GIB},
    },
}}


def gpuledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuledger", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def write_checkpoint(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def do_import(checkpoint: Path, state: Path) -> subprocess.CompletedProcess[str]:
    return gpuledger("import-checkpoint", str(checkpoint), "--state-dir", str(state), "--gpus", "fake",
                     "--node-name", "n1")


def test_the_checkpoint_becomes_the_first_events(tmp_path: Path) -> None:
    cp = write_checkpoint(tmp_path / "gpumanager_internal_checkpoint", CHECKPOINT)
    state = tmp_path / "state"
    run = do_import(cp, state)
    assert run.returncode == 0, run.stderr
    assert "imported 3 allocations of 2 pods" in run.stdout and "(seq 2..4)" in run.stdout

    view = json.loads(gpuledger("replay", "--json", "--state-dir", str(state)).stdout)
    used = {g["index"]: (g["cores_used"], g["memory_used"]) for g in view["gpus"]}
    assert used[0][0] == used[1][0] == 100 and used[0][1] > 0
    assert used[2] == (50, 3 * GIB) and used[3] == (0, 0)
    held = {(a["pod_uid"], a["container"]): a for a in view["allocations"]}
    assert set(held) == {("0f6a-uid-trainer", "trainer"), ("7c21-uid-notebook", "nb"),
                         ("7c21-uid-notebook", "sidecar")}
    assert held["0f6a-uid-trainer", "trainer"]["source"] == str(cp)

    state_fold = LedgerState()
    replay(state / "ledger.sqlite", state_fold.apply)
    nb = next(a for a in state_fold.allocations.values() if a.container == "nb")
    assert nb.response.envs["NVIDIA_VISIBLE_DEVICES"] == nb.shares[0].uuid
    assert nb.response.mounts[1].host_path.endswith("/vm/7c21-uid-notebook")

    again = do_import(cp, state)
    assert again.returncode == 0 and "already imported" in again.stdout
    history = gpuledger("history", "--pod", "7c21-uid-notebook", "--state-dir", str(state)).stdout
    assert history.count("alloc.imported") == 2


def test_bad_checkpoints_are_refused_and_write_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cases = [
        ({"PodGPUMapping": {"u": {"c": {"Devices": ["/dev/nvidia9"], "Cores": 100}}}}, "not a GPU of this node"),
        ({"PodGPUMapping": {"u": {"c": {"Devices": ["/dev/sda"], "Cores": 100}}}}, "not an NVIDIA device node"),
        ({"PodGPUMapping": {"u": {"c": {"Devices": ["/dev/nvidia0"], "Cores": 80, "Memory": GIB}},
                            "v": {"c": {"Devices": ["/dev/nvidia0"], "Cores": 30, "Memory": GIB}}}},
         "more than it has"),
        ({"PodGPUMapping": {"u": {"c": {"Devices": ["/dev/nvidia0", "/dev/nvidia1"], "Cores": 50}}}},
         "cannot span 2 GPUs"),
        ({"PodGPUMapping": {"u": {"c": {"Cores": 50}}}}, "not a gpu-manager checkpoint"),
    ]
    for data, message in cases:
        run = do_import(write_checkpoint(tmp_path / "cp.json", data), state)
        assert run.returncode == 1 and message in run.stderr, (data, run.stderr)
        assert "Traceback" not in run.stderr
    (tmp_path / "junk").write_text("{not json")
    run = do_import(tmp_path / "junk", state)
    assert run.returncode == 1 and "is not a gpu-manager checkpoint" in run.stderr
    events = gpuledger("events", "--json", "--state-dir", str(state)).stdout
    assert events == ""


async def test_a_log_with_history_or_a_running_allocator_is_refused(tmp_path: Path) -> None:
    cp = write_checkpoint(tmp_path / "cp.json", CHECKPOINT)
    state = tmp_path / "state"
    event_log = await EventLog.open(state / "ledger.sqlite")
    try:
        run = do_import(cp, state)
        assert run.returncode == 1 and "is the allocator running" in run.stderr
        await event_log.append([AllocationReleased(alloc_id="a", pod_uid="u", container="c", reason="deleted")])
    finally:
        await event_log.close()
    run = do_import(cp, state)
    assert run.returncode == 1 and "already holds allocation history" in run.stderr


async def test_the_allocator_starts_on_the_imported_log(tmp_path: Path, nats_server: NatsServer) -> None:
    cp = write_checkpoint(tmp_path / "cp.json", CHECKPOINT)
    settings = Settings(node_name="n1", state_dir=str(tmp_path / "state"), nats_url=nats_server.url, gpus="fake")
    assert do_import(cp, Path(settings.state_dir)).returncode == 0
    async with allocator_app.service(settings) as svc:
        state = svc.handlers.state
        assert state.seq == 4  # the same node and GPUs: no new inventory event
        assert sorted(a.container for a in state.allocations.values()) == ["nb", "sidecar", "trainer"]
        assert all(a.request_id.startswith("import:") for a in state.allocations.values())
        assert sum(g.cores_used for g in state.gpus.values()) == 250


def vcore_ids(start: int, count: int) -> list[str]:
    return [f"tencent.com/vcuda-core-{i}" for i in range(start, start + count)]


@pytest.mark.parametrize("layout", ["numa", "flat", "legacy"])
def test_the_kubelet_checkpoint_supplies_device_ids(tmp_path: Path, layout: str) -> None:
    def ids(start: int, count: int) -> object:
        return {"0": vcore_ids(start, count)} if layout == "numa" else vcore_ids(start, count)

    entries = [
        {"PodUID": "0f6a-uid-trainer", "ContainerName": "trainer", "ResourceName": "tencent.com/vcuda-core",
         "DeviceIDs": ids(0, 200), "AllocResp": ""},
        {"PodUID": "0f6a-uid-trainer", "ContainerName": "trainer", "ResourceName": "tencent.com/vcuda-memory",
         "DeviceIDs": ids(0, 1), "AllocResp": ""},
        {"PodUID": "7c21-uid-notebook", "ContainerName": "nb", "ResourceName": "tencent.com/vcuda-core",
         "DeviceIDs": ids(200, 30), "AllocResp": ""},
    ]
    body = {"PodDeviceEntries": entries, "RegisteredDevices": {}}
    kubelet = write_checkpoint(tmp_path / "kubelet_internal_checkpoint",
                               body if layout == "legacy" else {"Data": body, "Checksum": 1})
    cp = write_checkpoint(tmp_path / "cp.json", CHECKPOINT)
    state = tmp_path / "state"
    run = gpuledger("import-checkpoint", str(cp), "--kubelet-checkpoint", str(kubelet), "--state-dir", str(state),
                    "--gpus", "fake", "--node-name", "n1")
    assert run.returncode == 0, run.stderr
    fold = LedgerState()
    replay(state / "ledger.sqlite", fold.apply)
    trainer = fold.find_by_devices(vcore_ids(0, 200))  # what PreStartContainer looks up
    assert trainer is not None and trainer.container == "trainer"
    nb = fold.find_by_devices(vcore_ids(200, 30))
    assert nb is not None and nb.container == "nb"
    sidecar = next(a for a in fold.allocations.values() if a.container == "sidecar")
    assert sidecar.device_ids == ()  # not in the kubelet's file: stays empty


def test_a_kubelet_checkpoint_that_disagrees_is_refused(tmp_path: Path) -> None:
    entries = [{"PodUID": "7c21-uid-notebook", "ContainerName": "nb", "ResourceName": "tencent.com/vcuda-core",
                "DeviceIDs": vcore_ids(0, 31)}]
    kubelet = write_checkpoint(tmp_path / "k", {"Data": {"PodDeviceEntries": entries}})
    cp = write_checkpoint(tmp_path / "cp.json", CHECKPOINT)
    run = gpuledger("import-checkpoint", str(cp), "--kubelet-checkpoint", str(kubelet), "--state-dir",
                    str(tmp_path / "s"), "--gpus", "fake", "--node-name", "n1")
    assert run.returncode == 1 and "gives it 31 tencent.com/vcuda-core IDs but gpu-manager's 30" in run.stderr
