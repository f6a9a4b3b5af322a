"""The allocation policy, pure and deterministic: where a request goes and what the container is handed.

Shared by the allocator's Allocate, ``gpuledger simulate`` and ``import-checkpoint``, and the benchmarks:
`placement` chooses the GPUs (gpu-manager's evaluators, in `evaluators`, over the topology tree);
`reuse` places an app container on the GPUs of the init grants it takes over; `responses` builds
gpu-manager's ContainerAllocateResponse, turned into HAMi-core's form by `hami_response`.
"""

from libs.placement.hami_response import HamiDelivery, hami_response
from libs.placement.placement import Links, place, topology
from libs.placement.recorded import ResponseSettings, reproduce
from libs.placement.responses import VCUDA_MOUNTPOINT, build_response
from libs.placement.reuse import place_on_reused, reuse_view, without

__all__ = [
    "VCUDA_MOUNTPOINT",
    "HamiDelivery",
    "Links",
    "ResponseSettings",
    "build_response",
    "hami_response",
    "place",
    "place_on_reused",
    "reproduce",
    "reuse_view",
    "topology",
    "without",
]
