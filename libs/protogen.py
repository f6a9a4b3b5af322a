"""Regenerate the committed gRPC stubs from our .proto files.

Run from anywhere: ``python -m libs.protogen`` (needs the ``dev`` extra: grpcio-tools, mypy-protobuf).
Protos sit at their Python package path and are compiled from the repository root with ``-I .``, so
the generated imports are absolute (``from libs.kubelet... import api_pb2``) and the two upstream
files that are both called ``api.proto`` get distinct names in the descriptor pool.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROTOS = (
    "libs/kubelet/deviceplugin/v1beta1/api.proto",
    "libs/kubelet/podresources/v1/api.proto",
    "libs/vcuda/api.proto",
    "libs/cri/v1/api.proto",
    "libs/kubelet/pluginregistration/v1/api.proto",
    "libs/kubelet/dra/v1/api.proto",
    "libs/kubelet/dra/v1beta1/api.proto",
    "libs/kubelet/drahealth/v1/api.proto",
)


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Compile every proto into ``out_dir`` (the repository root by default); return the files written."""
    try:
        from grpc_tools import protoc  # noqa: F401  (presence check only)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("grpcio-tools is missing: pip install -e '.[dev]'") from exc
    args = [
        sys.executable, "-m", "grpc_tools.protoc", "-I", ".",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
    ]
    # mypy-protobuf's plugins live next to the interpreter; protoc only searches PATH, so name them.
    bin_dir = str(Path(sys.executable).parent)
    mypy = shutil.which("protoc-gen-mypy", path=bin_dir)
    mypy_grpc = shutil.which("protoc-gen-mypy_grpc", path=bin_dir)
    if mypy and mypy_grpc:
        args += [
            f"--plugin=protoc-gen-mypy={mypy}", f"--plugin=protoc-gen-mypy_grpc={mypy_grpc}",
            f"--mypy_out={out_dir}", f"--mypy_grpc_out={out_dir}",
        ]
    subprocess.run([*args, *PROTOS], cwd=ROOT, check=True)
    written = []
    for proto in PROTOS:
        stem = (out_dir / proto).with_suffix("")
        written += sorted(stem.parent.glob(stem.name + "_pb2*"))
    return written


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
