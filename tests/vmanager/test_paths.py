"""What may become a path under the vm root, and the container-directory defence in depth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.vmanager.configfiles import (
    CONFIG_NAME,
    PIDS_NAME,
    SPARE_NAME,
    container_dir,
    make_spare,
    take_spare,
    write_atomic,
    write_container_config,
    write_container_files,
)
from services.vmanager.names import is_container_id, is_container_name, is_pod_uid


@pytest.mark.parametrize(("value", "ok"), [
    ("3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f", True),
    ("3F9C2A8E-1B7D-4C5E-9A0F-6D2E8B1C4A7F", True),
    ("3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f\n", False),
    ("3f9c2a8e1b7d4c5e9a0f6d2e8b1c4a7f", False),
    ("{3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7f}", False),
    ("3f9c2a8e-1b7d-4c5e-9a0f-6d2e8b1c4a7g", False),
    ("../../etc", False),
    ("", False),
])
def test_pod_uid(value: str, ok: bool) -> None:
    assert is_pod_uid(value) is ok


@pytest.mark.parametrize(("value", "ok"), [
    ("a" * 64, True), ("0123abcdef" * 6 + "0123", True), ("crio-abc_1.2", True), ("a" * 128, True),
    ("a" * 129, False), ("../x", False), ("a/b", False), ("..", False), (".hidden", False), ("", False),
    ("abc\n", False), ("a b", False), ("-abc", False),
])
def test_container_id(value: str, ok: bool) -> None:
    assert is_container_id(value) is ok


@pytest.mark.parametrize(("value", "ok"), [
    ("main", True), ("a", True), ("side-car-2", True), ("a" * 63, True),
    ("a" * 64, False), ("Main", False), ("-main", False), ("main-", False), ("a.b", False), ("a_b", False),
    ("", False), ("../x", False),
])
def test_container_name(value: str, ok: bool) -> None:
    assert is_container_name(value) is ok


def test_container_dir_must_be_a_direct_child(workdir: Path) -> None:
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    assert container_dir(pod_dir, "main") == pod_dir / "main"
    for bad in ("..", ".", "", "a/b", "../x", "/etc"):
        with pytest.raises(ValueError):
            container_dir(pod_dir, bad)


def test_symlinked_container_dir_is_refused(workdir: Path) -> None:
    pod_dir, outside = workdir / "pod", workdir / "outside"
    pod_dir.mkdir()
    outside.mkdir()
    (pod_dir / "main").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError):
        write_container_config(pod_dir, "main", b"data")
    assert os.listdir(outside) == []


def test_missing_pod_dir_is_not_created(workdir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_container_config(workdir / "gone", "main", b"data")
    assert not (workdir / "gone").exists()


def test_write_atomic(workdir: Path) -> None:
    path = workdir / "vcuda.config"
    assert write_atomic(path, b"one")
    assert not write_atomic(path, b"one")
    assert write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(workdir) == ["vcuda.config"]
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_failed_write_leaves_no_temp_file(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = workdir / "vcuda.config"
    path.write_bytes(b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_atomic(path, b"new")
    assert os.listdir(workdir) == ["vcuda.config"] and path.read_bytes() == b"old"


def test_container_files_are_not_fsynced_durable_files_are(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    # Rewritten by every registration before the library reads them: atomic, not durable.
    assert write_container_files(pod_dir, "main", {PIDS_NAME: b"\x01\x00\x00\x00", CONFIG_NAME: b"cfg"}) == \
        {PIDS_NAME: True, CONFIG_NAME: True}
    assert (pod_dir / "main" / CONFIG_NAME).read_bytes() == b"cfg"
    assert synced == []
    assert write_atomic(workdir / "ld.so.preload", b"/usr/local/vgpu/libvgpu.so\n")
    assert len(synced) == 2  # the file, then its directory


def test_a_first_registration_takes_the_spare_by_one_rename(workdir: Path) -> None:
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    assert take_spare(pod_dir, "cid") is None  # no spare yet
    assert make_spare(pod_dir) and not make_spare(pod_dir)  # one at a time
    spare = pod_dir / SPARE_NAME
    made = sorted(os.listdir(spare))
    assert len(made) == 2 and all(n.endswith(".tmp") and os.path.getsize(spare / n) == 0 for n in made)
    inodes = {os.stat(spare / n).st_ino for n in made}

    staged = take_spare(pod_dir, "cid")
    assert staged is not None and not spare.exists()
    assert staged.commit({PIDS_NAME: b"\x07\x00\x00\x00", CONFIG_NAME: b"cfg"}) == {PIDS_NAME: True,
                                                                                     CONFIG_NAME: True}
    staged.discard()  # nothing left to take back; the files stay
    written = pod_dir / "cid"
    assert sorted(os.listdir(written)) == sorted([CONFIG_NAME, PIDS_NAME])
    assert {os.stat(written / n).st_ino for n in (CONFIG_NAME, PIDS_NAME)} == inodes  # no new inode
    assert (written / CONFIG_NAME).read_bytes() == b"cfg"
    assert os.stat(written / CONFIG_NAME).st_mode & 0o777 == 0o644
    assert os.stat(written).st_mode & 0o777 == 0o755

    # Not a first registration: the directory is there, the next spare stays for another container.
    assert make_spare(pod_dir)
    assert take_spare(pod_dir, "cid") is None and spare.is_dir()
    with pytest.raises(ValueError):
        take_spare(pod_dir, "../escape")
    assert spare.is_dir()


def test_a_spare_that_is_not_a_directory_is_refused(workdir: Path) -> None:
    # take_spare checks no realpath: a spare replaced by a symlink (only root could) must still be
    # refused once renamed, and a symlink already at the container's name is never renamed over.
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    outside = workdir / "outside"
    outside.mkdir()
    kept = {".vcuda.config.tmp", ".pids.config.tmp"}  # the names a staged directory's files have
    for name in kept:
        (outside / name).write_bytes(b"theirs")
    (pod_dir / SPARE_NAME).symlink_to(outside)
    with pytest.raises(ValueError, match="is not a directory"):
        take_spare(pod_dir, "cid")
    assert set(os.listdir(outside)) == kept  # nothing removed through the link
    (pod_dir / "cid").unlink()
    assert make_spare(pod_dir)
    (pod_dir / "other").symlink_to(outside)
    assert take_spare(pod_dir, "other") is None and (pod_dir / SPARE_NAME).is_dir()


def test_a_spare_left_unused_leaves_nothing(workdir: Path) -> None:
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    assert make_spare(pod_dir)
    staged = take_spare(pod_dir, "cid")
    assert staged is not None
    staged.discard()  # the registration failed before writing
    assert os.listdir(pod_dir) == []
    with pytest.raises(FileNotFoundError):  # a pod no longer served: nothing is created
        make_spare(workdir / "gone")
    assert sorted(os.listdir(workdir)) == ["pod"]


def test_a_spare_is_never_seen_half_made(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pod_dir = workdir / "pod"
    pod_dir.mkdir()
    real_open = os.open

    def failing_open(path: object, flags: int, mode: int = 0o777, **kwargs: object) -> int:
        if str(path).endswith(".vcuda.config.tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(OSError, match="No space left"):
        make_spare(pod_dir)
    assert os.listdir(pod_dir) == []  # neither a spare nor the half-built directory
