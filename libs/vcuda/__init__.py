"""gpu-manager's vcuda contract: the vcuda.config codec, the vcuda.sock protocol and its client.

The client (grpcio) is loaded when first named: the vmanager uses the codec and the messages, never
the client, and loads no grpcio (its gRPC is h2: libs/grpcwire.py, grpcchannel.py).
"""

from typing import Any

from libs.vcuda.config import SIZE, VcudaConfig, config_for, decode, encode, parse_driver_version

__all__ = [
    "SIZE",
    "VcudaClientError",
    "VcudaConfig",
    "config_for",
    "decode",
    "encode",
    "parse_driver_version",
    "register_vdevice",
]

_CLIENT = ("VcudaClientError", "register_vdevice")


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from libs.vcuda import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
