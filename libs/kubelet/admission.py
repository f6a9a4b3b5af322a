"""Whether the kubelet may be admitting a pod now, read from its pod-resources List (issue 13).

``Allocate`` names no pod. The kubelet admits one pod at a time and lists the pods it has taken up;
a List sent after the Allocate shows which pods can be the one asking: those it lists with a GPU
container that holds no vcore devices yet. The allocator checks its own List this way, and the
registrar, which asks the List as the Allocate comes in, checks a grant the allocator could not
check before its append (``AdmissionCheck``, in the allocator's reply). One rule for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from libs.kube.pods import RESOURCE_VCORE, Pod

if TYPE_CHECKING:  # libs.commands carries AdmissionCheck to every service: no protobuf for them
    from libs.kubelet.podresources.v1 import api_pb2 as pr

__all__ = ["AdmissionCheck", "ListedContainers", "admitting", "listed_containers"]

# (namespace, pod name) -> container -> whether it holds vcore devices. The kubelet lists app containers
# and sidecars, never ordinary init containers.
ListedContainers = dict[tuple[str, str], dict[str, bool]]


class AdmissionCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What a List must show for the kubelet to be admitting one pod."""

    namespace: str
    pod_name: str
    gpu_containers: tuple[str, ...]  # its app containers and sidecars that ask vcore (the kubelet lists them)
    gpu_inits: bool  # an ordinary init container asks vcore: never listed, so no List can rule the pod out

    @classmethod
    def of(cls, pod: Pod) -> AdmissionCheck:
        inits = pod.spec.init_containers
        shown = [c for c in inits if c.restart_policy == "Always"] + list(pod.spec.containers)
        return cls(namespace=pod.metadata.namespace, pod_name=pod.metadata.name,
                   gpu_containers=tuple(c.name for c in shown if c.vcore > 0),
                   gpu_inits=any(c.vcore > 0 and c.restart_policy != "Always" for c in inits))


def listed_containers(listing: pr.ListPodResourcesResponse) -> ListedContainers:
    return {
        (pod.namespace, pod.name): {
            ctr.name: any(d.resource_name == RESOURCE_VCORE and d.device_ids for d in ctr.devices)
            for ctr in pod.containers
        }
        for pod in listing.pod_resources
    }


def admitting(listed: ListedContainers, check: AdmissionCheck) -> bool:
    """Whether the kubelet may be admitting the pod: it lists the pod and some GPU container of it holds
    no vcore devices yet (or the pod has GPU init containers, which the kubelet never lists)."""
    containers = listed.get((check.namespace, check.pod_name))
    if containers is None:
        return False
    if check.gpu_inits:
        return True
    return any(not containers.get(name, False) for name in check.gpu_containers)
