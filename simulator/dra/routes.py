"""The ``resource.k8s.io/v1`` part of the simulated API server.

URL shapes as on a real API server::

    /apis/resource.k8s.io/v1/deviceclasses[/{name}]
    /apis/resource.k8s.io/v1/resourceslices[/{name}]
    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims[/{name}[/status]]
    /apis/resource.k8s.io/v1/resourceclaims                      (all namespaces)
    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates[/{name}]

list (and ``?watch=true``, resumable by resourceVersion, bookmarks), get, create, patch (merge,
strategic-as-merge, JSON patch, apply), replace, delete. A ResourceClaim has a status subresource:
writes to the main resource keep the stored status, and a claim's spec cannot change after creation
(the API server's validation: "field is immutable"). Field selectors: ``metadata.name``,
``metadata.namespace``, and for slices ``spec.nodeName``, ``spec.driver`` and ``spec.pool.name``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..errors import ApiError
from ..patches import apply_patch
from ..selectors import Selector, parse_label_selector
from .store import GROUP_VERSION, KINDS, KindStore

if TYPE_CHECKING:
    from ..simulator import NodeSimulator

__all__ = ["api_group", "dra_routes"]

GROUP = "resource.k8s.io"
PREFIX = f"/apis/{GROUP_VERSION}"

_FIELDS: dict[str, Any] = {
    "metadata.name": lambda o: o["metadata"].get("name", ""),
    "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", "") or "",
    "spec.driver": lambda o: (o.get("spec") or {}).get("driver", "") or "",
    "spec.pool.name": lambda o: ((o.get("spec") or {}).get("pool") or {}).get("name", "") or "",
}
_SLICE_ONLY = {"spec.nodeName", "spec.driver", "spec.pool.name"}


def api_group() -> dict[str, Any]:
    version = {"groupVersion": GROUP_VERSION, "version": "v1"}
    return {"name": GROUP, "versions": [version], "preferredVersion": version}


def _apiserver() -> Any:
    from .. import apiserver  # the pod handlers' helpers; imported late (that module imports this one)

    return apiserver


def _sim(request: web.Request) -> NodeSimulator:
    return request.app[_apiserver().SIM_KEY]


def _store(request: web.Request, plural: str) -> KindStore:
    return _sim(request).dra_objects.stores[plural]


def _field_selector(text: str | None, plural: str) -> Selector:
    checks = []
    for term in [t.strip() for t in (text or "").split(",") if t.strip()]:
        m = re.fullmatch(r"([^=!]+)(!=|==|=)(.*)", term)
        if not m:
            raise ApiError.bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if key not in _FIELDS or (key in _SLICE_ONLY and plural != "resourceslices"):
            raise ApiError.bad_request(f"field label not supported: {key}")
        getter = _FIELDS[key]
        checks.append((lambda o, g=getter, v=value: g(o) != v) if op == "!=" else
                      (lambda o, g=getter, v=value: g(o) == v))
    return lambda obj: all(check(obj) for check in checks)


def _selector(request: web.Request, plural: str) -> Selector:
    ns = request.match_info.get("ns")
    fields = _field_selector(request.query.get("fieldSelector"), plural)
    labels = parse_label_selector(request.query.get("labelSelector"))

    def match(obj: dict[str, Any]) -> bool:
        if ns is not None and obj["metadata"].get("namespace") != ns:
            return False
        return fields(obj) and labels(obj)

    return match


def _handlers(plural: str) -> dict[str, Any]:
    kind, namespaced = KINDS[plural]
    api = _apiserver()
    has_status = plural == "resourceclaims"

    def ns_of(request: web.Request) -> str:
        return request.match_info.get("ns", "") if namespaced else ""

    async def list_(request: web.Request) -> web.StreamResponse:
        match = _selector(request, plural)
        store = _store(request, plural)
        if request.query.get("watch", "").lower() in ("true", "1"):
            return await api.watch_pods(request, match, store=store, kind=kind, api_version=GROUP_VERSION)
        return api.json_response({
            "kind": f"{kind}List", "apiVersion": GROUP_VERSION,
            "metadata": {"resourceVersion": str(store.resource_version)},
            "items": [api._as_list_item(o) for o in store.list(match)],
        })

    async def get(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        obj = _store(request, plural).get(ns_of(request), name)
        if obj is None:
            raise ApiError.not_found(plural, name)
        return api.json_response(obj)

    async def create(request: web.Request) -> web.StreamResponse:
        body = await api._json_body(request)
        if not isinstance(body, dict):
            raise ApiError.bad_request(f"the body must be a {kind} object")
        if body.get("kind") not in (None, kind):
            raise ApiError.bad_request(f"expected kind {kind}, got {body.get('kind')!r}")
        meta = body.setdefault("metadata", {})
        if namespaced:
            ns = ns_of(request)
            if meta.get("namespace") and meta["namespace"] != ns:
                raise ApiError.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = ns
        body.pop("status", None) if has_status else None
        return api.json_response(_store(request, plural).create(body), 201)

    def _writer(status_only: bool, replace: bool) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            name = request.match_info["name"]
            ns = ns_of(request)
            body = await api._json_body(request)
            content_type = request.headers.get("Content-Type", "")
            store = _store(request, plural)
            if replace and not isinstance(body, dict):
                raise ApiError.bad_request(f"the body must be a {kind} object")

            def mutate(current: dict[str, Any]) -> dict[str, Any]:
                wanted = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
                if wanted and wanted != current["metadata"].get("resourceVersion"):
                    raise ApiError.conflict(plural, name)
                new = dict(body) if replace else apply_patch(current, content_type, body)
                if status_only:
                    current["status"] = new.get("status") or {}
                    return current
                if has_status:
                    new.pop("status", None)
                    if "status" in current:
                        new["status"] = current["status"]
                    if new.get("spec") != current.get("spec"):
                        raise ApiError.invalid(plural, name, "spec: Invalid value: field is immutable")
                return new

            with _sim(request).call_log.record("PATCH" if not replace else "PUT",
                                               f"{plural}/status" if status_only else plural,
                                               {"namespace": ns, "name": name, "body": body}):
                return api.json_response(store.update(ns, name, mutate))

        return handler

    async def delete(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        return api.json_response(_store(request, plural).remove(ns_of(request), name))

    return {"list": list_, "get": get, "create": create, "patch": _writer(False, False),
            "put": _writer(False, True), "patch_status": _writer(True, False),
            "put_status": _writer(True, True), "delete": delete}


async def _resources(_request: web.Request) -> web.StreamResponse:
    verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
    resources = []
    for plural, (kind, namespaced) in KINDS.items():
        resources.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                          "kind": kind, "verbs": verbs})
        if plural == "resourceclaims":
            resources.append({"name": "resourceclaims/status", "singularName": "", "namespaced": True,
                              "kind": kind, "verbs": ["get", "patch", "update"]})
    return _apiserver().json_response({"kind": "APIResourceList", "apiVersion": "v1",
                                       "groupVersion": GROUP_VERSION, "resources": resources})


def dra_routes() -> list[web.RouteDef]:
    routes = [web.get(PREFIX, _resources)]
    for plural, (_kind, namespaced) in KINDS.items():
        h = _handlers(plural)
        base = f"{PREFIX}/namespaces/{{ns}}/{plural}" if namespaced else f"{PREFIX}/{plural}"
        one = base + "/{name}"
        routes += [web.get(base, h["list"]), web.post(base, h["create"]), web.get(one, h["get"]),
                   web.patch(one, h["patch"]), web.put(one, h["put"]), web.delete(one, h["delete"])]
        if namespaced:
            routes.append(web.get(f"{PREFIX}/{plural}", h["list"]))  # across namespaces
        if plural == "resourceclaims":
            routes += [web.get(one + "/status", h["get"]), web.patch(one + "/status", h["patch_status"]),
                       web.put(one + "/status", h["put_status"])]
    return routes
