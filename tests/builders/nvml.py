"""The GPUs as NVML itself reports them (pynvml called directly, not through our backend): what the
tests on a real GPU machine compare the agent's inventory and Allocate responses with."""

from __future__ import annotations


def nvml_truth() -> list[tuple[str, int, int]]:
    """(uuid, minor, memory in bytes) of each GPU, in NVML's index order."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out.append((uuid, pynvml.nvmlDeviceGetMinorNumber(h), pynvml.nvmlDeviceGetMemoryInfo(h).total))
        return out
    finally:
        pynvml.nvmlShutdown()


def uuid_hex(uuid: str) -> str:
    """NVML's "GPU-8244ac3d-f88f-..." as CUDA's cuDeviceGetUuid bytes print in hex."""
    return uuid.removeprefix("GPU-").replace("-", "").lower()
