"""The real runtime's record of what it made outside its temp dir (simulator/runtime/leftovers.py):
pod cgroup parents are written down before runc makes them and dropped once removed, so the file
holds the pods still there however long the run; QoS levels that did not exist stay named as ours."""

from __future__ import annotations

from pathlib import Path

from simulator.runtime.leftovers import Leftovers

# A QoS level no host has: it counts as made by us, and no test touches a real cgroup.
ABSENT = "/gl-no-such-qos-level"


def test_a_removed_pods_parent_is_dropped_from_the_file(tmp_path: Path) -> None:
    record = Leftovers(tmp_path / "leftovers.json")
    first, second, third = (f"{ABSENT}/besteffort/pod{x}" for x in "abc")
    record.add_cgroup_parent(first)
    record.add_cgroup_parent(second)
    assert Leftovers.load(record.path).cgroup_parents == [first, second]  # on disk before runc runs

    record.drop_cgroup_parent(first)
    assert record.cgroup_parents == [second]
    record.add_cgroup_parent(third)  # the drop is written with the next save
    on_disk = Leftovers.load(record.path)
    assert on_disk.cgroup_parents == [second, third]
    # the levels we made stay named until the end of the run, whatever pods come and go
    assert on_disk.created_cgroups == [ABSENT, f"{ABSENT}/besteffort"]


def test_a_record_does_not_grow_with_pods_that_came_and_went(tmp_path: Path) -> None:
    record = Leftovers(tmp_path / "leftovers.json")
    record.add_cgroup_parent(f"{ABSENT}/besteffort/pod0")
    size = record.path.stat().st_size
    for i in range(1, 200):
        record.drop_cgroup_parent(f"{ABSENT}/besteffort/pod{i - 1}")
        record.add_cgroup_parent(f"{ABSENT}/besteffort/pod{i}")
    assert record.path.stat().st_size == size + len("199") - len("0")
    assert Leftovers.load(record.path).cgroup_parents == [f"{ABSENT}/besteffort/pod199"]


def test_dropping_a_parent_never_named_changes_nothing(tmp_path: Path) -> None:
    record = Leftovers(tmp_path / "leftovers.json")
    record.add_cgroup_parent(f"{ABSENT}/burstable/poda")
    record.drop_cgroup_parent(f"{ABSENT}/burstable/podz")
    assert record.cgroup_parents == [f"{ABSENT}/burstable/poda"]


def test_levels_made_by_us_survive_a_reload(tmp_path: Path) -> None:
    """The reaper (and a clean after a crash) loads the file: it still knows which levels were ours."""
    record = Leftovers(tmp_path / "leftovers.json")
    record.add_cgroup_parent(f"{ABSENT}/burstable/poda")
    again = Leftovers.load(record.path)
    again.add_cgroup_parent(f"{ABSENT}/burstable/podb")
    assert Leftovers.load(record.path).created_cgroups == [ABSENT, f"{ABSENT}/burstable"]
