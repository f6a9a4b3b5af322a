"""`gpuledger simulate` as a user runs it (a process), and against the real allocator on a simulated node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.builders import gpu_pod
from tests.e2e.helpers import Node

ROOT = Path(__file__).resolve().parents[2]
GPULEDGER = Path(sys.executable).parent / "gpuledger"
GIB = 1 << 30


def simulate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GPULEDGER), "simulate", *args], input=stdin, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def lines(run: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


def pod(name: str, *containers: tuple[str, int, int]) -> dict[str, Any]:
    return gpu_pod(name, *containers)


def test_the_documented_example() -> None:
    out = lines(simulate("--topology", "pcie-6gpu", "docs/examples/simulate-ops.yaml"))
    placed = [(o["pod"].split("/")[1], o.get("container"), o.get("gpus"), "error" in o) for o in out]
    assert placed == [
        ("trainer", "main", [0, 1], False),
        ("notebook", "jupyter", [2], False),
        ("inference", "warmup", [2], False),
        ("inference", "server", [2], False),
        ("odd", "main", None, True),
        ("too-much-memory", "main", None, True),
        ("big-job", "main", None, True),
        ("trainer", None, [0, 1], False),
        ("big-job-retry", "main", [0, 1, 3, 4], False),
    ]
    assert out[1]["memory"] == 16 * 256 << 20 and out[2]["init"] is True
    assert "must be multiple of 100" in out[4]["error"]
    assert out[5]["error"] == (
        "Allocate failed due to rpc error: code = InvalidArgument desc = request memory 107374182400 is "
        "larger than 51539607552, which is unexpected")
    assert out[6]["error"].startswith("Allocate failed due to requested number of devices unavailable for "
                                      "tencent.com/vcuda-core. Requested: 400, Available: 320")
    reference = (ROOT / "docs" / "cli.md").read_text()
    assert all(json.dumps(o) in reference for o in out), "docs/cli.md's example output is out of date"


def test_empty_yaml_documents_and_namespaces() -> None:
    text = ("---\n# only a comment\n---\n" + yaml.safe_dump(pod("a", ("c", 100, 0))) + "---\n"
            + yaml.safe_dump({**pod("a", ("c", 100, 0)), "metadata": {"name": "a", "namespace": "other"}})
            + "---\ndelete: other/a\n---\n")
    out = lines(simulate("--topology", "demo-4gpu", stdin=text))
    assert [(o["pod"], o["gpus"]) for o in out] == [("default/a", [0]), ("other/a", [1]), ("other/a", [1])]


def test_json_lines_on_stdin_and_a_topology_file(tmp_path: Path) -> None:
    ops = [pod("a", ("c", 200, 0)), pod("b", ("c", 100, 0)), {"delete": "a"}, pod("c", ("c", 300, 0))]
    text = "\n".join(json.dumps(o) for o in ops) + "\n"
    profile = tmp_path / "node.yaml"
    profile.write_text((ROOT / "libs/gpu/profiles/demo-4gpu.yaml").read_text())
    out = lines(simulate("--topology", str(profile), stdin=text))
    assert [o.get("gpus") for o in out] == [[0, 1], [2], [0, 1], [0, 1, 3]]
    assert out[2] == {"pod": "default/a", "deleted": True, "gpus": [0, 1]}


def test_nvlink_and_the_tree_decide_on_a_dgx() -> None:
    ops = [pod("one", ("c", 100, 0)), pod("four", ("c", 400, 0)), pod("two", ("c", 200, 0))]
    out = lines(simulate("--topology", "dgx-a100-8gpu", stdin="---\n".join(yaml.safe_dump(o) for o in ops)))
    assert [o["gpus"] for o in out] == [[0], [1, 2, 3, 4], [5, 6]]


def test_a_refused_container_gives_back_its_pods_earlier_grants() -> None:
    ops = [pod("two", ("a", 100, 0), ("b", 400, 0)), pod("next", ("c", 100, 0)), {"delete": "two"}]
    out = lines(simulate("--topology", "demo-4gpu", stdin="\n".join(json.dumps(o) for o in ops)))
    assert [(o.get("container"), o.get("gpus")) for o in out] == [("a", [0]), ("b", None), ("c", [0]), (None, [])]
    assert "Requested: 400, Available: 300" in out[1]["error"]


def test_init_containers_come_first_and_their_ids_are_reused() -> None:
    manifest = pod("p", ("main", 100, 0))
    manifest["spec"]["initContainers"] = [
        {"name": "setup", "resources": {"limits": {"tencent.com/vcuda-core": "300"}}}]
    after = pod("q", ("main", 100, 0))
    out = lines(simulate("--topology", "demo-4gpu", stdin=json.dumps(manifest) + "\n" + json.dumps(after)))
    # The kubelet counts the init container's 300 IDs once (main reuses 100 of them); as the allocator,
    # main goes on one of setup's GPUs and takes over setup's hold: the pod is charged for one GPU.
    assert [(o["container"], o["init"]) for o in out] == [("setup", True), ("main", False), ("main", False)]
    assert out[0]["gpus"] == [0, 1, 2] and len(out[1]["gpus"]) == 1 and out[1]["gpus"][0] in out[0]["gpus"]
    assert out[2]["pod"] == "default/q" and len(out[2]["gpus"]) == 1 and out[2]["gpus"] != out[1]["gpus"]


def test_show_tree() -> None:
    run = simulate("--topology", "pcie-6gpu", "--show-tree", stdin="")
    assert run.returncode == 0 and run.stdout == ""
    assert run.stderr.splitlines()[:4] == ["ROOT:6", "|---SYS (aval: 6)", "|   |---PXB (aval: 3)",
                                           "|   |   |---PIX (aval: 2)"]


def test_share_mode_off_refuses_fractions() -> None:
    out = lines(simulate("--topology", "demo-4gpu", "--no-share-mode", stdin=json.dumps(pod("s", ("c", 50, 4)))))
    assert "share mode is not enabled" in out[0]["error"]


def test_absurd_sizes_are_refused_results() -> None:
    ops = [pod("huge", ("c", 10**15, 0)), pod("mem", ("c", 50, 10**12)), pod("ok", ("c", 100, 0))]
    out = lines(simulate("--topology", "demo-4gpu", stdin="\n".join(json.dumps(o) for o in ops)))
    assert "Requested: 1000000000000000, Available: 400" in out[0]["error"]
    assert "requested number of devices unavailable for tencent.com/vcuda-memory" in out[1]["error"]
    assert out[2]["gpus"] == [0]


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        ('{"kind": "Pod"\n', "<stdin> line 1: not valid JSON"),
        ("kind: Pod\nmetadata: {name: a\n", "not valid YAML"),
        ('{"kind": "Deployment", "metadata": {"name": "d"}}\n', "kind is 'Deployment'"),
        ('{"delete": "ghost"}\n', "cannot delete pod default/ghost: no such pod was added"),
        ('{"delete": "a", "extra": 1}\n', 'a delete is {"delete": "NAME"}'),
        ('{"kind": "Pod", "metadata": {}, "spec": {"containers": [{"name": "c"}]}}\n', "no metadata.name"),
        ('{"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": '
         '[{"name": "c", "resources": {"limits": {"tencent.com/vcuda-core": "1.5"}}}]}}\n',
         "limits[tencent.com/vcuda-core]: not a whole-number quantity"),
        ('{"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": "nope"}}\n', "not a valid Pod manifest"),
        ("kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, resources: {limits: "
         "{tencent.com/vcuda-core: -5}}}]}\n", "limits[tencent.com/vcuda-core] is negative: -5"),
        ("[1, 2]\n", "expected a Pod manifest"),
    ],
)
def test_bad_operations_stop_with_a_clear_error(stdin: str, message: str) -> None:
    run = simulate("--topology", "demo-4gpu", stdin=stdin)
    assert run.returncode == 2
    assert message in run.stderr
    assert run.stdout == ""


def test_a_bad_operation_stops_after_the_good_ones() -> None:
    ops = [json.dumps(pod(name, ("c", 100, 0))) for name in ("a", "a", "b")]
    run = simulate("--topology", "demo-4gpu", stdin="\n".join(ops))
    assert run.returncode == 2
    assert "<stdin> line 2: pod default/a already exists" in run.stderr
    assert [json.loads(x)["pod"] for x in run.stdout.splitlines()] == ["default/a"]


def test_bad_topology(tmp_path: Path) -> None:
    run = simulate("--topology", "no-such-node", stdin="")
    assert run.returncode == 2 and "neither a file nor a bundled profile" in run.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("memory: 16GiB\ncount: 0\n")
    run = simulate("--topology", str(broken), stdin="")
    assert run.returncode == 2 and "count" in run.stderr


# --- the same pods through the real allocator on a simulated node ------------------------------------

AGREEMENT_OPS: list[dict[str, Any]] = [
    pod("a", ("c", 100, 0)),
    pod("b", ("c", 60, 4)),
    pod("c", ("c", 60, 4)),
    pod("d", ("c", 200, 0)),           # the kubelet runs out of vcuda-core IDs first
    pod("e", ("c", 100, 0)),
    pod("f", ("c", 50, 4)),            # IDs are there, but no GPU has 50 cores left: "no free node"
    pod("g", ("c", 30, 200)),          # 50 GiB on a 16 GiB card
    {"delete": "a"},
    pod("h", ("c", 100, 0)),
    pod("i", ("c", 40, 4)),
    pod("j", ("x", 20, 4), ("y", 20, 4)),
    {"delete": "h"},
    {"delete": "e"},
    # An init container and an app container that reuses its devices: same GPU, charged once, so
    # "l" still finds a whole GPU (with a grant per container it would get "no free node").
    {**pod("k", ("run", 50, 4)), "spec": {"initContainers": gpu_pod("x", ("prep", 100, 8))["spec"]["containers"],
                                          "containers": gpu_pod("x", ("run", 50, 4))["spec"]["containers"]}},
    pod("l", ("c", 100, 0)),
]


async def test_simulate_agrees_with_the_allocator(node: Node) -> None:
    predicted = lines(simulate("--topology", "demo-4gpu",
                               stdin="\n".join(json.dumps(o) for o in AGREEMENT_OPS)))
    seen: list[dict[str, Any]] = []
    released = 0
    for op in AGREEMENT_OPS:
        if "delete" in op:
            before = {a.pod_name: sorted(s.index for s in a.shares) for a in (await node.snapshot()).allocations}
            await node.sim.delete_pod("default", op["delete"])
            released += 1
            await node.tap.wait("alloc.released", released, timeout=20)
            seen.append({"pod": f"default/{op['delete']}", "deleted": True, "gpus": before[op["delete"]]})
            continue
        name = op["metadata"]["name"]
        got = await node.run_pod(op)
        if got["status"]["phase"] == "Failed":
            seen.append({"pod": f"default/{name}", "error": got["status"]["message"]})
            continue
        held = {a.container: sorted(s.index for s in a.shares)
                for a in (await node.snapshot()).allocations if a.pod_name == name}
        seen.extend({"pod": f"default/{name}", "container": c["name"], "gpus": held[c["name"]]}
                    for c in [*op["spec"].get("initContainers", []), *op["spec"]["containers"]])

    expected = []
    for o in predicted:
        if "error" in o:
            expected.append({"pod": o["pod"], "error": "Pod was rejected: " + o["error"]})
        elif o.get("deleted"):
            expected.append(o)
        else:
            expected.append({"pod": o["pod"], "container": o["container"], "gpus": o["gpus"]})
    assert seen == expected
    # The sequence really exercised each kind of outcome.
    errors = [o["error"] for o in predicted if "error" in o]
    assert any("requested number of devices unavailable" in e for e in errors)
    assert any("no free node" in e for e in errors)
    assert any("is larger than" in e for e in errors)
    k = [o for o in predicted if o["pod"] == "default/k"]
    assert [o["init"] for o in k] == [True, False] and k[0]["gpus"] == k[1]["gpus"]
    assert "gpus" in predicted[-1] and predicted[-1]["pod"] == "default/l"
