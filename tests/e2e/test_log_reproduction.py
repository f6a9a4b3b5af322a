"""The compact log gives back, byte for byte, the Allocate response the kubelet really received.

The simulated kubelet records every Allocate response it got (its call log); the log stores grants
without their response. Read back from the log, each grant's response, as the registrar sends it
(protobuf), must equal what the kubelet received, and the grant must be stored compact.
"""

from __future__ import annotations

from typing import Any

import msgspec
from google.protobuf.json_format import ParseDict

from libs.events.codec import encode_body
from libs.kube.pods import RESOURCE_VCORE
from libs.kubelet.deviceplugin.v1beta1 import api_pb2 as pb
from libs.store import iter_events, open_reader
from libs.store.compact import COMPACT_V, decode_compact
from services.registrar.plugin import to_proto
from simulator.calls import message_dict
from tests.builders import gpu_pod
from tests.e2e.helpers import Node


def _with_init(name: str, init: tuple[str, int, int], *apps: tuple[str, int, int]) -> dict[str, Any]:
    manifest = gpu_pod(name, *apps)
    manifest["spec"]["initContainers"] = gpu_pod("x", init)["spec"]["containers"]
    return manifest


def _compat32(name: str, cores: int) -> dict[str, Any]:
    manifest = gpu_pod(name, ("old", cores, 2))
    manifest["spec"]["containers"][0]["env"] = [{"name": "compat32", "value": "true"}]
    return manifest


async def test_every_response_read_from_the_log_is_the_one_the_kubelet_got(node: Node) -> None:
    manifests = [
        gpu_pod("tiny", ("main", 10, 1)),
        gpu_pod("big-share", ("main", 90, 8)),
        gpu_pod("whole", ("main", 100, 0)),
        gpu_pod("two", ("main", 200, 0)),
        gpu_pod("pair", ("a", 30, 2), ("b", 40, 3)),
        _with_init("staged", ("setup", 20, 2), ("app", 20, 2)),
        _compat32("legacy", 25),
    ]
    for manifest in manifests:
        pod = await node.run_pod(manifest)
        assert pod["status"]["phase"] == "Running", (manifest["metadata"]["name"], pod["status"])
        await node.sim.delete_pod("default", manifest["metadata"]["name"])  # room for the next

    # (device IDs, response) of each Allocate, in the order the kubelet made them (= the grants' order;
    # an app container reusing its init container's devices asks with the same IDs).
    sent = [(c.request["container_requests"][0]["devices_ids"], c.response["container_responses"][0])  # type: ignore[index]
            for c in node.sim.calls if c.method == "Allocate" and c.resource == RESOURCE_VCORE and c.ok]

    conn = open_reader(node.settings.log_path)
    try:
        stored = [e for e in iter_events(conn) if e.type == "alloc.granted"]
        grants = [e.event for e in stored]
        schema_v = dict(conn.execute("SELECT seq, schema_v FROM events WHERE type = 'alloc.granted'").fetchall())
        bodies = [decode_compact("alloc.granted", v, p) for v, p in conn.execute(
            "SELECT schema_v, payload FROM events WHERE type = 'alloc.granted' ORDER BY seq")]
    finally:
        conn.close()
    assert len(grants) == len(sent) == 9  # pair and staged have two GPU containers each
    assert set(schema_v.values()) == {COMPACT_V}
    for body, grant in zip(bodies, grants, strict=True):  # no response, no device-ID strings
        assert body.response is None and body.device_ids == (), body  # type: ignore[attr-defined]
        assert len(msgspec.msgpack.encode(body)) < len(encode_body(grant)) / 4  # what schema 1 stored
        # the ids as their 16 bytes, the request id left to the row's command_id (read back below)
        assert len(body.alloc_id) == len(body.pod_uid) == 16 and body.request_id == b"", body  # type: ignore[attr-defined]
    for event in stored:
        assert event.event.request_id == event.command_id  # type: ignore[attr-defined]
    for grant, (ids, received) in zip(grants, sent, strict=True):
        assert list(grant.device_ids) == ids  # type: ignore[attr-defined]  # in the kubelet's order
        reproduced = to_proto(grant.response)  # type: ignore[attr-defined]
        assert message_dict(reproduced) == received, grant.container  # type: ignore[attr-defined]
        wire = ParseDict(received, pb.ContainerAllocateResponse())
        assert reproduced.SerializeToString(deterministic=True) == wire.SerializeToString(deterministic=True)
