"""``gpuledger simulate``: where would these pods go? A placement dry run on a described node.

Input (OPS_FILE, or stdin when it is left out or ``-``): a sequence of operations, either as YAML
documents separated by ``---`` or as JSON lines (one JSON object per line; chosen when the first
non-blank character is ``{``). Two kinds of operation:

- a Kubernetes Pod manifest (``kind: Pod``; ``apiVersion`` is not checked): add the pod. Namespace
  ``default`` unless given; the name must be new.
- ``{"delete": "NAME"}`` or ``{"delete": "NAMESPACE/NAME"}``: delete a pod added before (also one
  that was refused), releasing its GPUs.

Output: one JSON line per container that asks for ``tencent.com/vcuda-core`` (or vcuda-memory), in
the kubelet's order (init containers first). As on a node, an app container that reuses its init
containers' kubelet devices goes on their GPUs and takes over their hold (the pod is charged once)::

    {"pod": "default/a", "container": "main", "init": false, "cores": 200, "memory": 0, "gpus": [0, 1]}
    {"pod": "default/b", "container": "main", "init": false, "cores": 50, "memory": 1073741824,
     "error": "Allocate failed due to rpc error: code = Unavailable desc = no free node: ..., which is unexpected"}

``memory`` is the vcuda-memory limit in bytes. ``error`` is the message the pod's
``UnexpectedAdmissionError`` status would carry; the kubelet then stops admitting the pod, so its
later containers get no line and its earlier ones give their GPUs back. A delete prints
``{"pod": ..., "deleted": true, "gpus": [...]}``.

Exit status: 0 when every operation was read (refused pods are results, not failures); 2 when the
topology or an operation is not valid (a malformed document, a manifest that is not a Pod, an
unknown pod in a delete, a duplicate name, a resource that is not a whole number): the message on
stderr names the document and line, and nothing after it is run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import click
import msgspec
import yaml

from gpuledger.simulation import Simulation
from libs.errors import GpuError
from libs.gpu.fake import PROFILES_DIR, FakeBackend
from libs.gpu.inventory import Inventory
from libs.gpu.tree import build_tree
from libs.kube.pods import RESOURCE_VCORE, RESOURCE_VMEMORY, Pod

__all__ = ["read_operations", "simulate"]


class OpError(Exception):
    """An operation that cannot be run; ``where`` says which document and line."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")


def load_topology(spec: str) -> Inventory:
    """A fake-profile file, or the name of a bundled profile (libs/gpu/profiles)."""
    path = Path(spec)
    if not path.exists() and (PROFILES_DIR / f"{spec}.yaml").is_file():
        path = PROFILES_DIR / f"{spec}.yaml"
    if not path.exists():
        names = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise click.BadParameter(f"{spec!r} is neither a file nor a bundled profile ({names})",
                                 param_hint="--topology")
    try:
        return FakeBackend(path).inventory()
    except GpuError as exc:
        raise click.BadParameter(str(exc), param_hint="--topology") from None


def read_operations(text: str, source: str) -> Iterator[tuple[str, Any]]:
    """(where, document) pairs: JSON lines when the text starts with ``{``, else YAML documents."""
    if text.lstrip().startswith("{"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"{source} line {n}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise OpError(where, f"not valid JSON ({exc.msg}, column {exc.colno})") from None
        return
    loader = yaml.SafeLoader(text)
    try:
        n = 0
        while loader.check_node():
            node = loader.get_node()
            n += 1
            if node is None:
                continue
            where = f"{source} document {n} (line {node.start_mark.line + 1})"
            doc = loader.construct_document(node)
            if doc is not None:  # an empty document (a trailing ---, only comments)
                yield where, doc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise OpError(f"{source}{line}", f"not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    finally:
        loader.dispose()


def to_pod(where: str, doc: dict[str, Any]) -> Pod:
    try:
        pod = msgspec.convert(doc, Pod, strict=False)
    except msgspec.ValidationError as exc:
        raise OpError(where, f"not a valid Pod manifest: {exc}") from None
    if not pod.metadata.name:
        raise OpError(where, "the Pod has no metadata.name")
    if not pod.spec.containers:
        raise OpError(where, f"pod {pod.key} has no spec.containers")
    names = [c.name for c in (*pod.spec.init_containers, *pod.spec.containers)]
    if len(set(names)) != len(names):
        raise OpError(where, f"pod {pod.key}: container names are not unique: {names}")
    for c in (*pod.spec.init_containers, *pod.spec.containers):
        for resource in (RESOURCE_VCORE, RESOURCE_VMEMORY):
            try:
                value = c.limit(resource)
            except (ValueError, AttributeError) as exc:
                raise OpError(where, f"pod {pod.key} container {c.name}: limits[{resource}]: {exc}") from None
            if value < 0:
                raise OpError(where, f"pod {pod.key} container {c.name}: limits[{resource}] is negative: {value}")
    return pod


def run_operation(sim: Simulation, where: str, doc: Any) -> list[dict[str, Any]]:
    if not isinstance(doc, dict):
        raise OpError(where, f"expected a Pod manifest or {{\"delete\": NAME}}, got {type(doc).__name__}")
    if "delete" in doc:
        if set(doc) != {"delete"} or not isinstance(doc["delete"], str) or not doc["delete"]:
            raise OpError(where, 'a delete is {"delete": "NAME"} or {"delete": "NAMESPACE/NAME"}, nothing else')
        key = doc["delete"] if "/" in doc["delete"] else f"default/{doc['delete']}"
        try:
            return [sim.delete(key)]
        except KeyError:
            raise OpError(where, f"cannot delete pod {key}: no such pod was added") from None
    kind = doc.get("kind")
    if kind != "Pod":
        raise OpError(where, f'kind is {kind!r}: only Pod manifests and {{"delete": NAME}} are operations')
    pod = to_pod(where, doc)
    try:
        return sim.add(pod)
    except ValueError as exc:
        raise OpError(where, str(exc)) from None


def _emit(out: TextIO, line: dict[str, Any]) -> None:
    out.write(json.dumps(line) + "\n")
    out.flush()


@click.command()
@click.option("--topology", "topology", required=True, metavar="FILE|PROFILE",
              help="The node: a fake GPU file (libs/gpu/fake.py format, with pasted `nvidia-smi topo -m`) "
                   "or the name of a bundled profile (libs/gpu/profiles: demo-4gpu, dgx-a100-8gpu, "
                   "dgx1-v100-8gpu, pcie-4gpu, pcie-6gpu).")
@click.option("--share-mode/--no-share-mode", default=True, show_default=True,
              help="Whether requests under 100 vcuda-core are allowed (as the agent's option).")
@click.option("--show-tree", is_flag=True,
              help="Print the node's topology tree (groups per level, gpu-manager's PrintGraph style) "
                   "to stderr first.")
@click.argument("ops_file", type=click.File("r", encoding="utf-8"), default="-")
def simulate(topology: str, share_mode: bool, show_tree: bool, ops_file: TextIO) -> None:
    """Dry-run placement: add pods / delete pods from OPS_FILE, print one JSON line per GPU container.

    OPS_FILE holds Pod manifests (add) and {"delete": NAME} (delete), as YAML documents or JSON
    lines; without it, stdin. The same placement code as the allocator runs.
    """
    inventory = load_topology(topology)
    if show_tree:
        click.echo(build_tree(inventory.links, len(inventory.gpus)).render(), err=True)
    sim = Simulation(inventory, share_mode=share_mode)
    source = "<stdin>" if ops_file.name in ("-", "<stdin>") else ops_file.name
    try:
        for where, doc in read_operations(ops_file.read(), source):
            for line in run_operation(sim, where, doc):
                _emit(sys.stdout, line)
    except OpError as exc:
        click.echo(f"gpuledger simulate: {exc}", err=True)
        sys.exit(2)
