"""Driver volumes from a real NVIDIA driver install (run with GPULEDGER_GPU_TESTS=1 on a GPU machine).

The host's own ld.so.cache and libraries: glibc's cache as ldconfig wrote it, the driver's real
DT_SONAMEs. The interception library is a stand-in (tests/builders/elf.py): only its placement is checked.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.vmanager.ldcache import read_ld_cache
from services.vmanager.volumes import build_volumes, soname_of
from tests.builders.elf import shared_object


@pytest.mark.gpu
def test_volumes_from_the_real_driver(tmp_path: Path) -> None:
    entries = read_ld_cache(Path("/etc/ld.so.cache"))
    cuda = [e for e in entries if e.name == "libcuda.so.1" and e.bits == 64]
    assert cuda, "the host's ld.so.cache lists no 64-bit libcuda.so.1"
    real = Path(os.path.realpath(cuda[0].path))
    assert soname_of(real) == "libcuda.so.1"
    version = real.name.removeprefix("libcuda.so.")

    control = shared_object(tmp_path / "control" / "libcuda-control.so", "libcuda-control.so")
    vdriver = tmp_path / "vdriver"
    build_volumes(vdriver, ld_cache=Path("/etc/ld.so.cache"), bin_dirs=[Path("/usr/bin")], share_mode=True,
                  control_library=control)
    origin, nvidia = vdriver / "origin", vdriver / "nvidia"
    assert os.readlink(origin / "lib64" / "libcuda.so.1") == real.name
    assert soname_of(origin / "lib64" / "libcuda.so.1") == "libcuda.so.1"
    assert (origin / "lib64" / "libnvidia-ml.so.1").exists()
    assert (origin / "bin" / "nvidia-smi").is_file()
    for name in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        assert (nvidia / "lib64" / name).read_bytes() == control.read_bytes(), name
    assert (nvidia / "lib64" / f"libcuda.so.{version}").read_bytes() == real.read_bytes()
