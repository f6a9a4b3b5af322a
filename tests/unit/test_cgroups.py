"""Container cgroup discovery on fake trees: every hierarchy x driver x runtime x QoS class, and owners of pids."""

from __future__ import annotations

import array
import itertools
import uuid
from pathlib import Path, PurePosixPath

import pytest

from libs.cgroups import (
    AmbiguousCgroup,
    container_cgroup_paths,
    encode_pids,
    find_container_cgroup,
    owner_of_path,
    owner_of_process,
    pod_cgroup_paths,
    read_pids,
)
from tests.builders.cgroups import (
    DRIVERS,
    HIERARCHIES,
    QOS,
    RUNTIMES,
    add_container,
    container_path,
    proc_cgroup_text,
    write_proc,
)

POD = "3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f"
CID = "4c8d1f0e9b2a7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d"
OTHER_CID = "a" * 64

COMBOS = [*itertools.product(HIERARCHIES, DRIVERS, RUNTIMES, QOS),
          *((h, "containerd-misconfigured", "containerd", q) for h in HIERARCHIES for q in QOS)]


@pytest.mark.parametrize(("hierarchy", "driver", "runtime", "qos"), COMBOS)
def test_finds_every_layout(tmp_path: Path, hierarchy: str, driver: str, runtime: str, qos: str) -> None:
    root = tmp_path / "cgroup"
    rel = container_path(POD, CID, driver=driver, runtime=runtime, qos=qos)
    # A sibling container of the same pod and the pod's pause container must not be picked.
    sibling = container_path(POD, OTHER_CID, driver=driver, runtime=runtime, qos=qos)
    add_container(root, hierarchy, sibling, [99])
    expected = add_container(root, hierarchy, rel, [4242, 17, 311], children={"nested": [5000, 18]})

    for hint in (qos, None, "Burstable" if qos != "Burstable" else "BestEffort"):  # right, unknown, wrong
        found = find_container_cgroup(root, POD, CID, hint)
        assert found == expected, (hint, found)
    assert read_pids(expected) == [17, 18, 311, 4242, 5000]

    owner = owner_of_path("/" + str(rel))
    assert owner.pod_uid == POD and owner.container_id == CID


@pytest.mark.parametrize("hierarchy", HIERARCHIES)
def test_missing_container_is_none(tmp_path: Path, hierarchy: str) -> None:
    root = tmp_path / "cgroup"
    add_container(root, hierarchy, container_path(POD, OTHER_CID, driver="systemd", runtime="containerd",
                                                  qos="Burstable"), [1])
    assert find_container_cgroup(root, POD, CID) is None
    assert find_container_cgroup(tmp_path / "absent", POD, CID) is None


def test_v2_root_wins_over_stray_v1_names(tmp_path: Path) -> None:
    """On a v2 host, a directory called memory/ is an ordinary cgroup, never a hierarchy."""
    root = tmp_path / "cgroup"
    rel = container_path(POD, CID, driver="systemd", runtime="containerd", qos="BestEffort")
    add_container(root, "v2", rel, [10])
    add_container(root / "memory", "v2", rel, [666])
    assert read_pids(find_container_cgroup(root, POD, CID) or Path("/nonexistent")) == [10]


def test_a_likely_path_is_tried_first_and_stays_inside(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    rel = PurePosixPath("custom.slice", f"pod-{CID}")
    expected = add_container(root, "v2", rel, [7])
    assert find_container_cgroup(root, POD, CID) is None
    assert find_container_cgroup(root, POD, CID, likely=[rel]) == expected
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "cgroup.procs").write_text("1\n")
    assert find_container_cgroup(root, POD, CID, likely=[PurePosixPath("../outside")]) is None
    # Before the formulas: where the registering process lives wins over a layout's guess.
    formula = add_container(root, "v2", container_path(POD, CID, driver="cgroupfs", runtime="containerd",
                                                       qos="BestEffort"), [8])
    assert find_container_cgroup(root, POD, CID) == formula
    assert find_container_cgroup(root, POD, CID, likely=[rel]) == expected


def test_paths_by_qos() -> None:
    paths = [str(p) for p in pod_cgroup_paths(POD, "guaranteed")]
    us = POD.replace("-", "_")
    assert paths[:2] == [f"kubepods/pod{POD}", f"kubepods.slice/kubepods-pod{us}.slice"]
    assert f"kubepods/burstable/pod{POD}" in paths and f"kubepods/besteffort/pod{POD}" in paths
    assert (f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{us}.slice" in paths)
    first = [str(p) for p in container_cgroup_paths(POD, CID, "Burstable")][:2]
    assert first == [f"kubepods/burstable/pod{POD}/{CID}", f"kubepods/burstable/pod{POD}/crio-{CID}"]


def test_pids_config_bytes() -> None:
    data = encode_pids([311, 17, 4242, 17])
    assert len(data) == 12
    assert list(array.array("i", data)) == [17, 311, 4242]
    assert data == (17).to_bytes(4, "little") + (311).to_bytes(4, "little") + (4242).to_bytes(4, "little")


def test_read_pids_ignores_garbage(tmp_path: Path) -> None:
    (tmp_path / "cgroup.procs").write_text("12\n\nx\n-3\n0\n4294967296\n5\n")
    assert read_pids(tmp_path) == [5, 12]


@pytest.mark.parametrize(("path", "pod", "cid"), [
    (f"/kubepods/burstable/pod{POD}/{CID}", POD, CID),
    (f"/kubepods/pod{POD}/crio-{CID}", POD, CID),
    (f"/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/docker-{CID}.scope", POD, CID),
    (f"/../../kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
     f"cri-containerd-{CID}.scope", POD, CID),
    (f"/system.slice/containerd.service/kubepods-burstable-pod{POD.replace('-', '_')}.slice:cri-containerd:{CID}",
     POD, CID),
    (f"/kubepods/burstable/pod{POD}", POD, None),  # the pod's own cgroup
    (f"/kubepods/burstable/pod{POD.upper()}/{CID}", POD, CID),
    ("/user.slice/user-1000.slice/session-3.scope", None, None),
    ("/", None, None),
    (f"/kubepods/burstable/podnot-a-uid/{CID}", None, None),
    (f"/kubepods/burstable/pod{POD}x/{CID}", None, None),
    (f"/docker/{CID}", None, None),  # a plain docker container, not a pod
])
def test_owner_of_path(path: str, pod: str | None, cid: str | None) -> None:
    owner = owner_of_path(path)
    assert (owner.pod_uid, owner.container_id) == (pod, cid)


@pytest.mark.parametrize(("hierarchy", "driver", "runtime"), [
    ("v1", "cgroupfs", "docker"), ("v2", "systemd", "containerd"), ("hybrid", "systemd", "cri-o"),
    ("v1", "containerd-misconfigured", "containerd"),
])
def test_owner_of_process(tmp_path: Path, hierarchy: str, driver: str, runtime: str) -> None:
    rel = container_path(POD, CID, driver=driver, runtime=runtime, qos="Burstable")
    write_proc(tmp_path, 1234, proc_cgroup_text(rel, hierarchy))
    owner = owner_of_process(tmp_path, 1234)
    assert (owner.pod_uid, owner.container_id) == (POD, CID)
    assert owner.path.endswith(str(rel))


def test_owner_of_process_outside_any_pod(tmp_path: Path) -> None:
    write_proc(tmp_path, 1, "0::/init.scope\n")
    assert owner_of_process(tmp_path, 1).pod_uid is None
    with pytest.raises(FileNotFoundError):
        owner_of_process(tmp_path, 2)


def test_disagreeing_hierarchies_are_refused(tmp_path: Path) -> None:
    other = str(uuid.uuid4())
    text = (f"12:memory:/kubepods/pod{POD}/{CID}\n"
            f"11:pids:/kubepods/pod{other}/{CID}\n")
    write_proc(tmp_path, 5, text)
    with pytest.raises(AmbiguousCgroup, match="several pods"):
        owner_of_process(tmp_path, 5)
    write_proc(tmp_path, 6, f"12:memory:/kubepods/pod{POD}/{CID}\n11:pids:/kubepods/pod{POD}/{OTHER_CID}\n")
    with pytest.raises(AmbiguousCgroup, match="several containers"):
        owner_of_process(tmp_path, 6)
