"""A package's face is its import path: ``from libs.<pkg> import name`` for every name in its
``__all__``, and nothing else is promised. The faces are frozen here, so that a face changes only
by a deliberate edit of this file, and checked for drift: each name is importable, is public in the
module that defines it, and the event contract is re-exported whole (every event type)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import libs

LIBS = Path(libs.__file__).parent

# None: no face, import the modules (libs.kubelet and libs.cri hold generated stubs).
FACES: dict[str, tuple[str, ...] | None] = {
    "libs.bus": ("Bus", "LogFollower", "NatsServer", "Relay", "ensure_stream", "find_nats_server"),
    "libs.events": (
        "EVENT_TYPES", "AllocationCorrected", "AllocationGranted", "AllocationImported", "AllocationRefused",
        "AllocationReleased", "AnyEvent", "ClaimPrepared", "ClaimUnprepared", "ContainerResponse", "DeviceNode",
        "Event", "EventRecord", "GpuHealthChanged", "GpuInfo", "GpuModeChanged", "GpuShare", "InventoryRecorded",
        "MountSpec", "StoredEvent", "Subjects", "escape_token", "from_record", "register_upcaster", "to_record",
        "unescape_token",
    ),
    "libs.fleet": (
        "FLEET_DOMAIN", "FLEET_STREAM", "Credentials", "HubServer", "NodeLogin", "add_nodes", "ensure_fleet_stream",
        "fleet_stream_config", "hub_config", "leaf_config", "load_credentials", "node_domain", "node_permissions",
        "node_user", "remove_nodes", "with_credentials",
    ),
    "libs.gpu": (
        "DEFAULT_FAKE_PROFILE", "FakeBackend", "GpuBackend", "Inventory", "NvmlBackend", "TopologyTree", "TreeNode",
        "build_tree", "link_level", "load_inventory", "nvlink_count", "open_monitor", "parse_topo_matrix",
    ),
    "libs.kube": (
        "RESOURCE_VCORE", "RESOURCE_VMEMORY", "Container", "ContainerStatus", "Pod", "is_active", "parse_quantity",
        "predicate_time",
    ),
    "libs.cri": None,
    "libs.kubelet": None,
    "libs.ledger": ("Allocation", "GpuUsage", "LedgerSnapshot", "LedgerState"),
    "libs.placement": (
        "VCUDA_MOUNTPOINT", "HamiDelivery", "Links", "ResponseSettings", "build_response", "hami_response", "place",
        "place_on_reused", "reproduce", "reuse_view", "topology", "without",
    ),
    "libs.store": ("EventLog", "create_schema", "iter_events", "open_reader", "replay", "seq_at_time"),
    "libs.witness": (
        "AddCheckpoint", "Checkpoint", "CompactRange", "FileWitnessStore", "NoteError", "ProofError", "SignedNote",
        "Signer", "Verifier", "Witness", "WitnessReply", "WitnessState", "WitnessStore",
    ),
    "libs.vcuda": (
        "SIZE", "VcudaClientError", "VcudaConfig", "config_for", "decode", "encode", "parse_driver_version",
        "register_vdevice",
    ),
}

# Modules a face re-exports whole: every name in their __all__ is in the package's.
WHOLE = {"libs.events": ("libs.events.schema",)}


def test_every_package_has_a_frozen_face() -> None:
    packages = {f"libs.{p.parent.name}" for p in LIBS.glob("*/__init__.py")}
    assert packages == set(FACES)


@pytest.mark.parametrize("name", sorted(FACES))
def test_the_face_is_as_frozen(name: str) -> None:
    package = importlib.import_module(name)
    face = FACES[name]
    if face is None:
        assert not getattr(package, "__all__", ()), f"{name} has no face; add it to FACES to give it one"
        return
    assert sorted(package.__all__) == sorted(face)
    assert len(set(package.__all__)) == len(package.__all__), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("name", sorted(n for n, face in FACES.items() if face))
def test_each_name_is_importable_and_public_where_defined(name: str) -> None:
    package = importlib.import_module(name)
    for attr in package.__all__:
        value = getattr(package, attr)  # AttributeError: a name in __all__ that is not there
        home = getattr(value, "__module__", None)
        if home and home.startswith(f"{name}."):
            assert attr in importlib.import_module(home).__all__, f"{name} re-exports {home}.{attr}, private there"


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_contract_module_is_reexported_whole(name: str) -> None:
    face = set(importlib.import_module(name).__all__)
    for module in WHOLE[name]:
        missing = set(importlib.import_module(module).__all__) - face
        assert not missing, f"{name} lacks {sorted(missing)} of {module}"
