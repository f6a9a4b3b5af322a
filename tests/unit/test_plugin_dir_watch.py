"""What wakes the registrar's keeper: kubelet.sock and its own sockets, not the rest of the directory.

The kubelet rewrites its checkpoint file in the device-plugin directory at every admission, and other
plugins' sockets live there too; the keeper must not take the CPU for those at the moment of an
Allocate. Real inotify on a temp directory."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

from services.registrar.kubelet import PluginDirWatch

QUIET = 0.3  # a wait that no event ends runs this long


async def waited(watch: PluginDirWatch, timeout: float = QUIET) -> float:
    started = time.perf_counter()
    await watch.changed(timeout)
    return time.perf_counter() - started


def bind(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return sock


async def test_only_the_kubelets_and_its_own_sockets_wake_the_keeper(tmp_path: Path) -> None:
    watch = PluginDirWatch(tmp_path, kubelet="kubelet.sock", own={"vcore.sock"})
    assert watch.ensure()
    try:
        # the kubelet's checkpoint, written the way it writes it (a temp file renamed), and another plugin
        (tmp_path / "kubelet_internal_checkpoint.tmp").write_text("{}")
        os.replace(tmp_path / "kubelet_internal_checkpoint.tmp", tmp_path / "kubelet_internal_checkpoint")
        other = bind(tmp_path / "other-vendor.sock")
        assert await waited(watch) >= QUIET
        kubelet = bind(tmp_path / "kubelet.sock")  # a (re)started kubelet
        assert await waited(watch, 5) < 1
        ours = bind(tmp_path / "vcore.sock")
        assert await waited(watch, 5) < 1  # made by someone else: news
        with watch.ignoring_own():  # made afresh by the keeper itself: no news
            (tmp_path / "vcore.sock").unlink()
            ours.close()
            ours = bind(tmp_path / "vcore.sock")
            await asyncio.sleep(0.05)
        assert await waited(watch) >= QUIET
        (tmp_path / "vcore.sock").unlink()  # the kubelet wiped it
        assert await waited(watch, 5) < 1
        for sock in (other, kubelet, ours):
            sock.close()
    finally:
        watch.close()
