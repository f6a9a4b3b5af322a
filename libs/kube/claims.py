"""Reading ResourceClaims (resource.k8s.io/v1) from the API server: the registrar's NodePrepareResources
and the watchdog's claim reconciliation read them the same way.

The kubelet's request names a claim (namespace, name, UID); its allocation result (device, shareID,
consumed capacity) and reservedFor are in the object, at
``/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`` (``libs.dra.claim_path``). Read
through lightkube's generic resources with the client every other API use builds (kubeconfig or
in-cluster), decoded by ``libs.dra.claim_view``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from libs.dra import ClaimView, claim_view

__all__ = ["ClaimNotFound", "ClaimSource"]


class ClaimNotFound(LookupError):
    pass


class ClaimSource:
    """lightkube is imported only here, when DRA is on: a service without DRA never loads it."""

    def __init__(self, client: Any) -> None:
        from lightkube import ApiError
        from lightkube.generic_resource import create_namespaced_resource

        self.client = client
        self._api_error = ApiError
        self._resource = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")

    async def get(self, namespace: str, name: str, *, timeout: float) -> ClaimView:
        try:
            obj = await asyncio.wait_for(self.client.get(self._resource, name, namespace=namespace), timeout)
        except self._api_error as exc:
            if exc.status.code == 404:
                raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found") from None
            raise
        return claim_view(obj.to_dict() if hasattr(obj, "to_dict") else dict(obj))

    async def list(self, namespace: str, *, timeout: float) -> list[ClaimView]:
        async def collect() -> list[ClaimView]:
            return [claim_view(o.to_dict() if hasattr(o, "to_dict") else dict(o))
                    async for o in self.client.list(self._resource, namespace=namespace)]
        return await asyncio.wait_for(collect(), timeout)
