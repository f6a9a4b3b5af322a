"""What may become a path under the vm root, and the container-directory defence in depth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.vmanager.configfiles import (
    CONFIG_NAME,
    PIDS_NAME,
    container_dir,
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
