"""Container images built here, from files we write, as OCI image layouts; never pulled.

* ``localhost/gpuledger/pause:1``: the pod sandbox, our static ``csrc/pause.c`` (pause until SIGTERM,
  reap children).
* ``localhost/gpuledger/busybox:1``: the test image. ``busybox-static`` with one link per applet,
  ``/bin/vcuda-register`` (``csrc/vcuda_register.c``, static: the in-container client that registers
  through the mounted ``vcuda.sock`` as a CUDA interception library does), ``/bin/cuda-probe``
  (``csrc/cuda_probe.c``, dynamic: loads ``libcuda.so.1`` through the dynamic loader; on a GPU machine
  it also initialises CUDA, names the devices and holds memory) with the host's loader and libc (and
  the glibc libraries a real driver's libcuda needs), and ``/etc/passwd``, ``/etc/group``, ``/tmp``.

Each image is one gzip layer written deterministically (mtime 0, uid 0), an OCI config and manifest,
and an ``index.json`` whose descriptor carries ``io.containerd.image.name``, which ``ctr images
import`` names the image after. Run as a script to write the two ``.oci.tar`` files into a directory:
``python -m simulator.runtime.images DIR``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BUSYBOX_IMAGE", "PAUSE_IMAGE", "BuiltImages", "ImageBuildError", "build_images"]

PAUSE_IMAGE = "localhost/gpuledger/pause:1"
BUSYBOX_IMAGE = "localhost/gpuledger/busybox:1"
CSRC = Path(__file__).parent / "csrc"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
# glibc's other libraries that a real NVIDIA driver's libcuda.so.1 names (DT_NEEDED)
REAL_LIBCUDA_NEEDS = ("libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(RuntimeError):
    """A tool or input the images need is missing (gcc, a static busybox)."""


@dataclass
class BuiltImages:
    pause: Path
    busybox: Path
    names: tuple[str, ...] = (PAUSE_IMAGE, BUSYBOX_IMAGE)


@dataclass
class _Layer:
    """Files of one layer: path in the image -> (mode, bytes) / symlink target / directory."""

    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    dirs: dict[str, int] = field(default_factory=dict)

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            parents = {str(Path(p).parent) for p in [*self.files, *self.links, *self.dirs]}
            all_dirs = {**{d: 0o755 for p in parents for d in _ancestors(p)}, **self.dirs}
            for name in sorted(all_dirs):
                tar.addfile(_info(name, tarfile.DIRTYPE, all_dirs[name]))
            for name in sorted(self.links):
                info = _info(name, tarfile.SYMTYPE, 0o777)
                info.linkname = self.links[name]
                tar.addfile(info)
            for name in sorted(self.files):
                mode, data = self.files[name]
                info = _info(name, tarfile.REGTYPE, mode)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def _ancestors(path: str) -> list[str]:
    """"/a/b" -> ["/a", "/a/b"] (the directories a tar entry under /a/b needs)."""
    parts = Path(path).parts[1:]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name.lstrip("/"))
    info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, 0, 0, 0
    return info


def _arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_layout(out: Path, name: str, layer: _Layer, *, entrypoint: list[str], cmd: list[str]) -> Path:
    """One OCI image layout, as a tar file ``ctr images import`` reads."""
    raw = layer.tar()
    gz = gzip.compress(raw, mtime=0)
    arch = _arch()
    config = json.dumps({
        "architecture": arch, "os": "linux",
        "config": {"Env": [PATH_ENV], "Entrypoint": entrypoint, "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [_sha(raw)]},
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _sha(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": _sha(gz),
                    "size": len(gz)}],
    }, sort_keys=True).encode()
    index = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _sha(manifest),
            "size": len(manifest), "platform": {"architecture": arch, "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }, sort_keys=True).encode()
    entries = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
    for blob in (config, manifest, gz):
        entries["blobs/sha256/" + hashlib.sha256(blob).hexdigest()] = blob
    path = out / (name.split("/")[-1].replace(":", "_") + ".oci.tar")
    with tarfile.open(path, "w") as tar:
        for dirname in ("blobs", "blobs/sha256"):
            tar.addfile(_info(dirname, tarfile.DIRTYPE, 0o755))
        for entry, data in entries.items():
            info = _info(entry, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _compile(source: str, out: Path, *, static: bool) -> bytes:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ImageBuildError("no C compiler (apt-get install gcc libc6-dev)")
    args = [cc, "-Os", "-Wall", *(["-static"] if static else []), "-o", str(out), str(CSRC / source)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ImageBuildError(f"{' '.join(args)} failed: {done.stderr.strip()[-800:]}")
    subprocess.run(["strip", str(out)], capture_output=True, timeout=60)
    return out.read_bytes()


def find_static_busybox() -> Path:
    for candidate in BUSYBOX_CANDIDATES:
        path = Path(candidate)
        if path.is_file() and _is_static(path):
            return path
    raise ImageBuildError("no static busybox (apt-get install busybox-static)")


def _is_static(path: Path) -> bool:
    """No program interpreter named in the ELF header area (a dynamic busybox would need one)."""
    with path.open("rb") as f:
        return b"ld-linux" not in f.read(4096)


def build_images(out: Path) -> BuiltImages:
    """Compile our C programs and write both image layouts into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    busybox = find_static_busybox()
    with tempfile.TemporaryDirectory(prefix="glimg") as tmp:
        work = Path(tmp)
        pause = _compile("pause.c", work / "pause", static=True)
        register = _compile("vcuda_register.c", work / "vcuda-register", static=True)
        probe = _compile("cuda_probe.c", work / "cuda-probe", static=False)

    pause_layer = _Layer(files={"/pause": (0o755, pause)})
    pause_tar = write_layout(out, PAUSE_IMAGE, pause_layer, entrypoint=["/pause"], cmd=[])

    test = _Layer(dirs={"/tmp": 0o1777, "/proc": 0o555, "/sys": 0o555, "/dev": 0o755, "/etc": 0o755})
    test.files["/bin/busybox"] = (0o755, busybox.read_bytes())
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True, timeout=30)
    for applet in applets.stdout.split():
        if applet != "busybox":
            test.links[f"/bin/{applet}"] = "busybox"
    test.files["/bin/vcuda-register"] = (0o755, register)
    test.files["/bin/cuda-probe"] = (0o755, probe)
    # The loader and libc cuda-probe needs, at the paths the loader looks for them.
    test.files["/lib64/ld-linux-x86-64.so.2" if _arch() == "amd64" else "/lib/ld-linux-aarch64.so.1"] = (
        0o755, Path(os.path.realpath(_loader())).read_bytes())
    test.files[f"/lib/{_multiarch()}/libc.so.6"] = (0o755, Path(os.path.realpath(_libc())).read_bytes())
    # What a real driver's libcuda.so.1 also links against, so that a GPU machine's test can load it
    for name in REAL_LIBCUDA_NEEDS:
        found = _glibc_library(name)
        if found is not None:
            test.files[f"/lib/{_multiarch()}/{name}"] = (0o755, Path(os.path.realpath(found)).read_bytes())
    test.files["/etc/passwd"] = (0o644, b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    test.files["/etc/group"] = (0o644, b"root:x:0:\nnogroup:x:65534:\n")
    busybox_tar = write_layout(out, BUSYBOX_IMAGE, test, entrypoint=[], cmd=["/bin/sh"])
    return BuiltImages(pause=pause_tar, busybox=busybox_tar)


def _multiarch() -> str:
    return {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}.get(_arch(), "")


def _loader() -> str:
    return "/lib64/ld-linux-x86-64.so.2" if _arch() == "amd64" else "/lib/ld-linux-aarch64.so.1"


def _glibc_library(name: str) -> str | None:
    for candidate in (f"/lib/{_multiarch()}/{name}", f"/usr/lib/{_multiarch()}/{name}", f"/lib64/{name}"):
        if Path(candidate).exists():
            return candidate
    return None


def _libc() -> str:
    found = _glibc_library("libc.so.6")
    if found is None:
        raise ImageBuildError("no libc.so.6 found for the test image's dynamic loader")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m simulator.runtime.images OUT_DIR")
    built = build_images(Path(sys.argv[1]))
    print(built.pause)
    print(built.busybox)
