"""gpu-manager's vcuda contract: the vcuda.config codec, the vcuda.sock protocol and its client."""

from libs.vcuda.client import VcudaClientError, register_vdevice
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
