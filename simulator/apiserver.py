"""The Kubernetes-API-shaped HTTP server of the simulated node (aiohttp).

The subset real clients (lightkube, kubectl-style code) use for pods and this node: list, watch
(with resourceVersion resumption, bookmarks, timeouts and selector transitions), get, create,
patch (merge, strategic-as-merge, JSON patch), replace, delete, the status subresource, and
GET/PATCH of the Node. Errors are `Status` objects with `Content-Type: application/json` exactly,
because lightkube only builds its ApiError for that exact header.

Under /simulator/v1/ are the simulator's own controls (kubelet restart, run options, RPC log) and
fault injection for clients: drop every watch connection, expire the watch history (resumes get 410
Gone), and an outage (stop serving for N seconds).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import yaml
from aiohttp import web

from .errors import ApiError, status_body
from .kubelet import Kubelet
from .logger import logger
from .patches import apply_patch
from .selectors import Selector, parse_field_selector, parse_label_selector
from .store import DROP, Event

if TYPE_CHECKING:
    from .simulator import NodeSimulator

__all__ = ["build_app"]

_logger = logger("apiserver")

SIM_KEY: web.AppKey[NodeSimulator] = web.AppKey("sim")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(obj: Any, status: int = 200) -> web.Response:
    body = json.dumps(obj).encode()
    return web.Response(status=status, body=body, headers={"Content-Type": "application/json"})


def error_response(err: ApiError) -> web.Response:
    return json_response(err.status(), err.code)


@web.middleware
async def status_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a Kubernetes Status object."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        reason = {404: "NotFound", 405: "MethodNotAllowed"}.get(err.status, "BadRequest")
        message = "the server could not find the requested resource" if err.status == 404 else err.reason
        return json_response(status_body(err.status, reason, message), err.status)


def _sim(request: web.Request) -> NodeSimulator:
    return request.app[SIM_KEY]


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        if request.content_type == "application/apply-patch+yaml":
            return yaml.safe_load(raw)
        return json.loads(raw or b"null")
    except (ValueError, yaml.YAMLError) as err:
        raise ApiError.bad_request(f"the request body is not valid: {err}") from err


def _check_rv(body: Any, current: dict[str, Any], name: str) -> None:
    """Optimistic concurrency: a resourceVersion in the body must be the stored one."""
    if not isinstance(body, dict):
        return
    wanted = (body.get("metadata") or {}).get("resourceVersion")
    if wanted and wanted != current["metadata"].get("resourceVersion"):
        raise ApiError.conflict("pods", name)


def _as_list_item(pod: dict[str, Any]) -> dict[str, Any]:
    # List items carry no kind/apiVersion on a real API server.
    return {k: v for k, v in pod.items() if k not in ("kind", "apiVersion")}


# -- pods --------------------------------------------------------------------------------------


def _pod_selector(request: web.Request) -> Selector:
    ns = request.match_info.get("ns")
    fields = parse_field_selector(request.query.get("fieldSelector"))
    labels = parse_label_selector(request.query.get("labelSelector"))

    def match(pod: dict[str, Any]) -> bool:
        if ns is not None and pod.get("metadata", {}).get("namespace") != ns:
            return False
        return fields(pod) and labels(pod)

    return match


async def list_pods(request: web.Request) -> web.StreamResponse:
    match = _pod_selector(request)
    if request.query.get("watch", "").lower() in ("true", "1"):
        return await watch_pods(request, match)
    store = _sim(request).store
    return json_response(
        {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(store.resource_version)},
            "items": [_as_list_item(p) for p in store.list(match)],
        }
    )


def _translate(event: Event, match: Selector) -> tuple[str, dict[str, Any]] | None:
    """What a watcher with this selector sees: objects entering it are ADDED, leaving it DELETED."""
    matches_now = match(event.object)
    if event.type == "MODIFIED":
        matched_before = event.previous is not None and match(event.previous)
        if matches_now and matched_before:
            return "MODIFIED", event.object
        if matches_now:
            return "ADDED", event.object
        if matched_before:
            return "DELETED", event.object
        return None
    return (event.type, event.object) if matches_now else None


async def watch_pods(request: web.Request, match: Selector, store: Any = None, kind: str = "Pod",
                     api_version: str = "v1") -> web.StreamResponse:
    """A watch on pods, or on any store with the same watch contract (the DRA kinds)."""
    sim = _sim(request)
    store = sim.store if store is None else store
    query = request.query
    raw_rv = query.get("resourceVersion", "")
    try:
        since = None if raw_rv in ("", "0") else int(raw_rv)
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
    except ValueError as err:
        raise ApiError.bad_request(f"invalid watch parameter: {err}") from err
    bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")

    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()

    async def send(kind: str, obj: dict[str, Any]) -> None:
        await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    try:
        watcher, backlog = store.watch(since)
    except ApiError as err:
        # The client must list again: one ERROR event carrying the 410 Status, then the end.
        await resp.prepare(request)
        await send("ERROR", err.status())
        await resp.write_eof()
        return resp
    # Subscribing and listing happen without an await in between, so no event falls in a gap.
    initial = store.list(match) if since is None else []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout is not None else None
    interval = sim.cfg.bookmark_interval
    next_bookmark = loop.time() + interval
    try:
        await resp.prepare(request)
        for pod in initial:
            await send("ADDED", pod)
        for event in backlog:
            translated = _translate(event, match)
            if translated:
                await send(*translated)
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                break
            if bookmarks and now >= next_bookmark:
                await send("BOOKMARK", {"kind": kind, "apiVersion": api_version,
                                        "metadata": {"resourceVersion": str(store.resource_version)}})
                next_bookmark = now + interval
            # Wake at least every second to notice a client that went away.
            wait = 1.0
            if deadline is not None:
                wait = min(wait, deadline - now)
            if bookmarks:
                wait = min(wait, next_bookmark - now)
            try:
                # asyncio.timeout, not wait_for: wait_for runs the get in a task of its own, which
                # wakes this handler loop turns after the kubelet's admission, woken by the same
                # change; a real API server fans an event out to every watcher, the kubelet among them.
                async with asyncio.timeout(max(wait, 0)):
                    event = await watcher.queue.get()
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    break
                continue
            if event is None:
                break
            if event == DROP:
                if request.transport is not None:
                    request.transport.abort()
                return resp
            assert isinstance(event, Event)
            translated = _translate(event, match)
            if translated:
                await send(*translated)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    finally:
        store.unwatch(watcher)
    return resp


async def get_pod(request: web.Request) -> web.StreamResponse:
    ns, name = request.match_info["ns"], request.match_info["name"]
    pod = _sim(request).store.get(ns, name)
    if pod is None:
        raise ApiError.not_found("pods", name)
    return json_response(pod)


async def create_pod(request: web.Request) -> web.StreamResponse:
    ns = request.match_info["ns"]
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise ApiError.bad_request("the body must be a Pod object")
    if body.get("kind") not in (None, "Pod"):
        raise ApiError.bad_request(f"expected kind Pod, got {body.get('kind')!r}")
    meta = body.setdefault("metadata", {})
    if meta.get("namespace") and meta["namespace"] != ns:
        raise ApiError.bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    meta["namespace"] = ns
    pod = await _sim(request).create_pod(body)
    return json_response(pod, 201)


async def patch_pod(request: web.Request, *, status_only: bool = False) -> web.StreamResponse:
    ns, name = request.match_info["ns"], request.match_info["name"]
    body = await _json_body(request)
    content_type = request.headers.get("Content-Type", "")
    sim = _sim(request)
    if (
        not status_only
        and content_type.startswith("application/apply-patch+yaml")
        and sim.store.peek(ns, name) is None
        and isinstance(body, dict)
    ):
        # Server-side apply creates what does not exist yet.
        body.setdefault("metadata", {}).update(name=name, namespace=ns)
        return json_response(await sim.create_pod(body), 201)

    def mutate(pod: dict[str, Any]) -> dict[str, Any]:
        _check_rv(body, pod, name)
        patched = apply_patch(pod, content_type, body)
        if status_only:
            pod["status"] = patched.get("status") or {}
            return pod
        return patched

    # Recorded like the kubelet's RPCs (method "PATCH"), so tests can count who writes a pod and how often.
    subresource = "pods/status" if status_only else "pods"
    with sim.call_log.record("PATCH", subresource, {"namespace": ns, "name": name,
                                                    "content_type": content_type, "body": body}):
        return json_response(sim.store.update(ns, name, mutate))


async def patch_pod_status(request: web.Request) -> web.StreamResponse:
    return await patch_pod(request, status_only=True)


async def replace_pod(request: web.Request, *, status_only: bool = False) -> web.StreamResponse:
    ns, name = request.match_info["ns"], request.match_info["name"]
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise ApiError.bad_request("the body must be a Pod object")
    if (body.get("metadata") or {}).get("name", name) != name:
        raise ApiError.bad_request("the name of the object does not match the name on the URL")

    def mutate(pod: dict[str, Any]) -> dict[str, Any]:
        _check_rv(body, pod, name)
        if status_only:
            pod["status"] = body.get("status") or {}
            return pod
        new = dict(body)
        new["status"] = pod.get("status") or {}  # the main resource ignores status changes
        return new

    return json_response(_sim(request).store.update(ns, name, mutate))


async def replace_pod_status(request: web.Request) -> web.StreamResponse:
    return await replace_pod(request, status_only=True)


async def delete_pod(request: web.Request) -> web.StreamResponse:
    ns, name = request.match_info["ns"], request.match_info["name"]
    kubelet: Kubelet = _sim(request).kubelet
    return json_response(kubelet.begin_delete(ns, name))


# -- node --------------------------------------------------------------------------------------


def _node_or_404(request: web.Request) -> dict[str, Any]:
    sim = _sim(request)
    name = request.match_info["name"]
    if name != sim.node.name:
        raise ApiError.not_found("nodes", name)
    return sim.node.render()


async def list_nodes(request: web.Request) -> web.StreamResponse:
    sim = _sim(request)
    if request.query.get("watch", "").lower() in ("true", "1"):
        raise ApiError(405, "MethodNotAllowed", "watching nodes is not supported by the simulator")
    fields = parse_field_selector(request.query.get("fieldSelector"), kind="nodes")
    labels = parse_label_selector(request.query.get("labelSelector"))
    node = sim.node.render()
    items = [_as_list_item(node)] if fields(node) and labels(node) else []
    return json_response({"kind": "NodeList", "apiVersion": "v1",
                          "metadata": {"resourceVersion": str(sim.store.resource_version)}, "items": items})


async def get_node(request: web.Request) -> web.StreamResponse:
    return json_response(_node_or_404(request))


async def patch_node(request: web.Request, *, status_only: bool = False) -> web.StreamResponse:
    current = _node_or_404(request)
    body = await _json_body(request)
    patched = apply_patch(current, request.headers.get("Content-Type", ""), body)
    if status_only:
        current["status"] = patched.get("status") or {}
        patched = current
    return json_response(_sim(request).node.replace(patched))


async def patch_node_status(request: web.Request) -> web.StreamResponse:
    return await patch_node(request, status_only=True)


# -- discovery ---------------------------------------------------------------------------------


async def version(_request: web.Request) -> web.StreamResponse:
    return json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-gpuledger-sim",
                          "platform": "linux/amd64"})


async def api_versions(_request: web.Request) -> web.StreamResponse:
    return json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})


async def api_groups(_request: web.Request) -> web.StreamResponse:
    from .dra.routes import api_group

    return json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]})


async def api_resources(_request: web.Request) -> web.StreamResponse:
    def res(name: str, kind: str, namespaced: bool, verbs: list[str]) -> dict[str, Any]:
        return {"name": name, "singularName": "", "namespaced": namespaced, "kind": kind, "verbs": verbs}

    return json_response({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            res("pods", "Pod", True, ["create", "delete", "get", "list", "patch", "update", "watch"]),
            res("pods/status", "Pod", True, ["get", "patch", "update"]),
            res("nodes", "Node", False, ["get", "list", "patch"]),
            res("nodes/status", "Node", False, ["get", "patch"]),
        ],
    })


# -- simulator controls ------------------------------------------------------------------------


async def sim_restart_kubelet(request: web.Request) -> web.StreamResponse:
    await _sim(request).restart_kubelet()
    return json_response({"restarted": True})


async def sim_run_options(request: web.Request) -> web.StreamResponse:
    info = request.match_info
    try:
        opts = _sim(request).container_run_options(info["ns"], info["name"], info["container"])
    except KeyError as err:
        raise ApiError.not_found("pods", info["name"]) from err
    return json_response(opts)


async def sim_drop_watches(request: web.Request) -> web.StreamResponse:
    sim = _sim(request)
    return json_response({"dropped": sim.store.drop_watches() + sim.dra_objects.drop_watches()})


async def sim_expire(request: web.Request) -> web.StreamResponse:
    return json_response({"compacted": _sim(request).store.expire_history()})


async def sim_outage(request: web.Request) -> web.StreamResponse:
    """Stop serving for `seconds` (answered first; the restart happens in the background)."""
    try:
        seconds = float(request.query.get("seconds", "1"))
    except ValueError as err:
        raise ApiError.bad_request(f"invalid seconds: {err}") from err
    if not 0 < seconds <= 600:
        raise ApiError.bad_request("seconds must be in (0, 600]")
    _sim(request).schedule_api_outage(seconds)
    return json_response({"outage_seconds": seconds})


async def sim_calls(request: web.Request) -> web.StreamResponse:
    return json_response([c.to_dict() for c in _sim(request).calls])


async def sim_resources(request: web.Request) -> web.StreamResponse:
    return json_response({name: dict(info) for name, info in _sim(request).registered_resources().items()})


def build_app(sim: NodeSimulator) -> web.Application:
    app = web.Application(middlewares=[status_errors])
    app[SIM_KEY] = sim
    pods = "/api/v1/namespaces/{ns}/pods"
    pod = pods + "/{name}"
    app.add_routes([
        web.get("/version", version),
        web.get("/api", api_versions),
        web.get("/apis", api_groups),
        web.get("/api/v1", api_resources),
        web.get("/api/v1/pods", list_pods),
        web.get(pods, list_pods),
        web.post(pods, create_pod),
        web.get(pod, get_pod),
        web.patch(pod, patch_pod),
        web.put(pod, replace_pod),
        web.delete(pod, delete_pod),
        web.get(pod + "/status", get_pod),
        web.patch(pod + "/status", patch_pod_status),
        web.put(pod + "/status", replace_pod_status),
        web.get("/api/v1/nodes", list_nodes),
        web.get("/api/v1/nodes/{name}", get_node),
        web.patch("/api/v1/nodes/{name}", patch_node),
        web.get("/api/v1/nodes/{name}/status", get_node),
        web.patch("/api/v1/nodes/{name}/status", patch_node_status),
        web.post("/simulator/v1/kubelet/restart", sim_restart_kubelet),
        web.get("/simulator/v1/pods/{ns}/{name}/containers/{container}", sim_run_options),
        web.get("/simulator/v1/calls", sim_calls),
        web.post("/simulator/v1/faults/drop-watches", sim_drop_watches),
        web.post("/simulator/v1/faults/expire", sim_expire),
        web.post("/simulator/v1/faults/outage", sim_outage),
        web.get("/simulator/v1/resources", sim_resources),
    ])
    from .dra.routes import dra_routes  # here: that module uses this one's handlers

    app.add_routes(dra_routes())
    return app
