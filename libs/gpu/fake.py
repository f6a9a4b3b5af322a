"""The fake backend: a node's GPUs described in a small YAML file (``--gpus fake:PATH``).

It lets the agent, the simulator and the tests run without GPUs, and lets a user reproduce their own
node by pasting ``nvidia-smi topo -m`` into a file. Errors name the file, the line and the field,
because the file is hand-written.

File format (every key optional except what gives the memory and the GPU count)::

    profile: my-node        # name the fake UUIDs derive from; default: the file name without .yaml
    driver_version: "550.54.15"   # default ""
    name: Tesla T4          # default model name for every GPU; default ""
    memory: 16GiB           # default memory for every GPU
    count: 2                # number of GPUs
    gpus:                   # per-GPU overrides, in index order (0, 1, ...); any key may be left out
      - {memory: 16GiB, uuid: GPU-..., pci_bus_id: "00000000:3B:00.0", name: Tesla T4, minor: 0}
      - {}
    topology: |2            # `nvidia-smi topo -m` output, pasted verbatim, every line indented by 2 spaces
              GPU0    GPU1    CPU Affinity    NUMA Affinity
      GPU0     X      NV4     0-23            0
      GPU1    NV4      X      0-23            0

      Legend: ...

``|2`` (not just ``|``) is needed because the pasted header line is indented deeper than the rows;
``|2`` tells YAML the block is indented by exactly 2 spaces. Tabs inside the pasted lines are fine.

GPU count: the topology's, else the length of ``gpus``, else ``count``; when two of them are given
they must agree. Links: from ``topology``; without it every pair is ``PHB`` (one PCIe host bridge:
no pair is preferred over another). NIC columns, affinity columns and legends in the pasted text
are ignored.

Memory (per GPU, else the top-level default; one of them is required): an integer number of bytes,
or a number with a binary unit: ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB`` (case-insensitive, space
allowed: ``16GiB``, ``16384 MiB``, ``1.5GiB``). Decimal units (``GB``, ``MB``...) are refused as
ambiguous: "80GB" on a GPU box means 80 GiB, in SI it means 80 * 10^9 bytes.

Defaults per GPU i: ``uuid`` ``GPU-<uuid5(profile, i)>`` (stable for the same profile name),
``pci_bus_id`` ``00000000:<0x10+i>:00.0``, ``minor`` i. UUIDs, minors and bus ids must be unique.
Text values are taken as written: an unquoted ``driver_version: 535.10`` stays "535.10" and
``pci_bus_id: 00000000:10:00.0`` needs no quotes. Unknown keys are errors, so that a typo is never
silently ignored.
"""

from __future__ import annotations

import difflib
import os
import re
import uuid
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from libs.errors import GpuError
from libs.events.schema import GpuInfo
from libs.gpu.inventory import Inventory
from libs.gpu.topology import parse_topo_matrix

__all__ = [
    "DEFAULT_FAKE_PROFILE",
    "PROFILES_DIR",
    "FakeBackend",
    "fake_uuid",
    "parse_fake_profile",
    "parse_memory",
]

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_FAKE_PROFILE = PROFILES_DIR / "demo-4gpu.yaml"

_TOP_KEYS = ("profile", "driver_version", "name", "memory", "count", "gpus", "topology")
_GPU_KEYS = ("memory", "uuid", "pci_bus_id", "name", "minor")
_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SI = {"k", "kb", "m", "mb", "g", "gb", "t", "tb"}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_INDENT_HINT = (
    "a pasted topology starts with an indented header line, so YAML must be told the block's "
    "indentation: write `topology: |2` and indent every pasted line by 2 spaces"
)
_UUID_NS = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpuledger/fake-gpu")


def parse_memory(value: object) -> int:
    """Bytes from ``17179869184``, ``"16GiB"``, ``"16384 MiB"``...; ValueError explains a bad value."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a size; write bytes as an integer, or e.g. 16GiB or 16384MiB")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.fullmatch(value)
        if not m:
            raise ValueError(f"{value!r} is not a size; write e.g. 16GiB, 16384MiB or a number of bytes")
        unit = m.group(2).lower() or "b"
        if unit in _SI:
            raise ValueError(
                f"ambiguous unit {m.group(2)!r} in {value!r}: use binary units (KiB, MiB, GiB, TiB) or bytes"
            )
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {m.group(2)!r} in {value!r}: use B, KiB, MiB, GiB or TiB")
        try:
            exact = Decimal(m.group(1)) * _UNITS[unit]
        except InvalidOperation:
            raise ValueError(f"{value!r} is not a size") from None
        if exact != exact.to_integral_value():
            raise ValueError(f"{value!r} is not a whole number of bytes")
        size = int(exact)
    if size <= 0:
        raise ValueError(f"{value!r}: memory must be more than 0 bytes")
    return size


class _Source:
    """Where values come from, for error messages: the file and the YAML node's line."""

    def __init__(self, name: str) -> None:
        self.name = name

    def error(self, node: yaml.Node | None, field: str, problem: str) -> GpuError:
        line = f", line {node.start_mark.line + 1}" if node is not None else ""
        where = f" {field}:" if field else ""
        return GpuError(f"fake GPU file {self.name}{line}:{where} {problem}")

    def mapping(self, node: yaml.Node, field: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node]:
        """Key -> value node of a mapping, refusing duplicate and unknown keys."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, field, f"expected a mapping with keys {', '.join(allowed)}")
        out: dict[str, yaml.Node] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            if name not in allowed:
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.error(key, field, f"unknown key {name!r}{hint}; allowed: {', '.join(allowed)}")
            if name in out:
                raise self.error(key, field, f"key {name!r} is given twice")
            out[name] = value
        return out

    def text(self, node: yaml.Node, field: str) -> str:
        # The raw scalar, so that 535.10 stays "535.10" and 00000000:10:00.0 is not read as a number.
        if not isinstance(node, yaml.ScalarNode) or node.tag == "tag:yaml.org,2002:null":
            raise self.error(node, field, "expected text")
        return str(node.value).strip()

    def value(self, node: yaml.Node, field: str) -> Any:
        try:
            return yaml.SafeLoader("").construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise self.error(node, field, getattr(exc, "problem", None) or str(exc)) from None

    def integer(self, node: yaml.Node, field: str, minimum: int) -> int:
        value = self.value(node, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(node, field, f"expected a whole number >= {minimum}, got {_show(node)}")
        return value

    def memory(self, node: yaml.Node, field: str) -> int:
        try:
            return parse_memory(self.value(node, field))
        except ValueError as exc:
            raise self.error(node, field, str(exc)) from None


def _show(node: yaml.Node) -> str:
    return repr(node.value) if isinstance(node, yaml.ScalarNode) else f"a {node.id}"


def _topology(src: _Source, node: yaml.Node) -> list[list[str]]:
    if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:str":
        raise src.error(node, "topology", "expected pasted `nvidia-smi topo -m` text (use `topology: |2`)")
    try:
        return parse_topo_matrix(node.value)
    except ValueError as exc:
        raise src.error(node, "topology", str(exc)) from None


def parse_fake_profile(text: str, *, source: str = "<text>", profile: str = "fake") -> Inventory:
    """An Inventory from the YAML text of a fake profile; `profile` is the default UUID seed."""
    src = _Source(source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        bare = re.search(r"^topology:[ \t]*[|>][-+]?[ \t]*(#.*)?$", text, re.MULTILINE)
        if bare and mark is not None and mark.line >= text.count("\n", 0, bare.start()):
            problem += f" ({_INDENT_HINT})"
        raise GpuError(f"fake GPU file {source}{line}: not valid YAML: {problem}") from None
    if root is None:
        raise GpuError(f"fake GPU file {source}: is empty; give at least memory and count")
    top = src.mapping(root, "", _TOP_KEYS)

    profile = src.text(top["profile"], "profile") if "profile" in top else profile
    driver = src.text(top["driver_version"], "driver_version") if "driver_version" in top else ""
    default_name = src.text(top["name"], "name") if "name" in top else ""
    default_memory = src.memory(top["memory"], "memory") if "memory" in top else None

    counts: dict[str, int] = {}
    matrix = _topology(src, top["topology"]) if "topology" in top else None
    if matrix is not None:
        counts["topology"] = len(matrix)
    entries: list[tuple[yaml.Node, dict[str, yaml.Node]]] = []
    if "gpus" in top:
        seq = top["gpus"]
        if not isinstance(seq, yaml.SequenceNode):
            raise src.error(seq, "gpus", "expected a list with one entry per GPU, in index order")
        for i, item in enumerate(seq.value):
            empty = isinstance(item, yaml.ScalarNode) and item.tag == "tag:yaml.org,2002:null"
            entries.append((item, {} if empty else src.mapping(item, f"gpus[{i}]", _GPU_KEYS)))
        counts["gpus"] = len(entries)
    if "count" in top:
        counts["count"] = src.integer(top["count"], "count", 1)
    if not counts:
        raise src.error(None, "", "no GPU count: give count, gpus or topology")
    if len(set(counts.values())) > 1:
        said = ", ".join(f"{k} gives {v}" for k, v in counts.items())
        raise src.error(None, "", f"the GPU count disagrees: {said}")
    n = next(iter(counts.values()))
    if n == 0:
        raise src.error(top["gpus"], "gpus", "the list is empty; a fake node needs at least one GPU")

    gpus = [
        _gpu(src, i, entries[i] if entries else None, profile, default_name, default_memory) for i in range(n)
    ]
    for key in ("uuid", "minor", "pci_bus_id"):
        seen: dict[object, int] = {}
        for g in gpus:
            value = getattr(g, key)
            if value in seen:
                raise src.error(None, key, f"GPU {seen[value]} and GPU {g.index} both have {key} {value!r}")
            seen[value] = g.index
    links = matrix or [["X" if i == j else "PHB" for j in range(n)] for i in range(n)]
    return Inventory(
        backend="fake",
        driver_version=driver,
        gpus=tuple(gpus),
        links=tuple(tuple(row) for row in links),
    )


def _gpu(
    src: _Source,
    i: int,
    entry: tuple[yaml.Node, dict[str, yaml.Node]] | None,
    profile: str,
    name: str,
    memory: int | None,
) -> GpuInfo:
    node, fields = entry if entry is not None else (None, {})
    where = f"gpus[{i}]"
    if "memory" in fields:
        memory = src.memory(fields["memory"], f"{where}.memory")
    if memory is None:
        raise src.error(
            node, where if node is not None else "", f"no memory for GPU {i}: set a top-level memory "
            "default (e.g. memory: 16GiB) or memory for this GPU"
        )
    gpu_uuid = src.text(fields["uuid"], f"{where}.uuid") if "uuid" in fields else fake_uuid(profile, i)
    if not gpu_uuid:
        raise src.error(fields["uuid"], f"{where}.uuid", "is empty; leave it out to get a fake UUID")
    return GpuInfo(
        index=i,
        minor=src.integer(fields["minor"], f"{where}.minor", 0) if "minor" in fields else i,
        uuid=gpu_uuid,
        pci_bus_id=(
            src.text(fields["pci_bus_id"], f"{where}.pci_bus_id")
            if "pci_bus_id" in fields
            else f"00000000:{(0x10 + i) % 0x100:02X}:00.0"
        ),
        memory=memory,
        name=src.text(fields["name"], f"{where}.name") if "name" in fields else name,
    )


def fake_uuid(profile: str, index: int) -> str:
    """A GPU UUID that stays the same for the same profile name and index."""
    return f"GPU-{uuid.uuid5(_UUID_NS, f'{profile}/{index}')}"


class FakeBackend:
    """GpuBackend over a fake profile file; the file is read and checked when the backend is created."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else DEFAULT_FAKE_PROFILE
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise GpuError(f"fake GPU file {self.path}: cannot read it: {reason}") from None
        self._inventory = parse_fake_profile(text, source=str(self.path), profile=self.path.stem)

    def inventory(self) -> Inventory:
        return self._inventory

    def close(self) -> None:
        """Nothing to release."""
