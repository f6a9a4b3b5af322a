"""The fleet setting: one URL plus a credentials file makes the embedded broker a leaf node; none
changes nothing; bad input gets a clear error; a leaf broker starts with its hub out of reach."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import nats
import pytest

from gpuledger.launcher import _leaf_config
from libs.bus.server import NatsServer, is_fatal
from libs.config import Settings
from libs.errors import GpuledgerError
from libs.fleet.credentials import load_credentials, with_credentials
from libs.fleet.natsconf import leaf_config
from tests.fleet.helpers import free_ports


def test_no_fleet_url_keeps_a_lone_broker(tmp_path: Path) -> None:
    assert _leaf_config(Settings(state_dir=str(tmp_path))) is None


def test_a_fleet_url_makes_the_broker_a_leaf_in_its_own_domain(tmp_path: Path) -> None:
    creds = tmp_path / "fleet.yaml"
    creds.write_text("user: node-a.b\npassword: p@ss:word\n")
    settings = Settings(node_name="a.b", state_dir=str(tmp_path), fleet_url="nats://hub-0:7422, nats://hub-1:7422",
                        fleet_credentials=str(creds))
    conf = json.loads(_leaf_config(settings) or "")
    assert conf["jetstream"] == {"store_dir": str(tmp_path / "nats"), "domain": "node-a_2Eb"}
    assert conf["leafnodes"]["remotes"][0]["urls"] == ["nats://node-a.b:p%40ss%3Aword@hub-0:7422",
                                                       "nats://node-a.b:p%40ss%3Aword@hub-1:7422"]


def test_bad_fleet_settings_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(msgspec.ValidationError, match="fleet_credentials"):
        Settings(fleet_url="nats://hub:7422")
    with pytest.raises(ValueError, match="nats://HOST:PORT"):
        leaf_config("n", tmp_path, remote_urls=["http://hub"], user="u", password="p")
    (tmp_path / "bad.yaml").write_text("user: only\n")
    with pytest.raises(GpuledgerError, match="must hold 'user:' and 'password:'"):
        load_credentials(tmp_path / "bad.yaml")


def test_client_urls_carry_the_credentials(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("user: recorder\npassword: s3cret\n")
    creds = load_credentials(tmp_path / "c.yaml")
    assert with_credentials("nats://a:4222,nats://b", creds) == "nats://recorder:s3cret@a:4222,nats://recorder:s3cret@b:4222"


def test_a_refused_hub_link_is_not_a_failed_start() -> None:
    # Seen in CI: a node's broker restarted while its fleet link was cut logged this before it was ready.
    refused = ('[15362] 2026/12/02 13:13:33.056688 [ERR] Error trying to connect as leafnode to remote server '
               '"127.0.0.1:45781" (attempt 1): dial tcp 127.0.0.1:45781: connect: connection refused')
    assert not is_fatal(refused)
    assert is_fatal("[1] 2026/12/02 13:13:33.0 [ERR] Error listening on port: 127.0.0.1:4222, \"address in use\"")
    assert is_fatal("[1] 2026/12/02 13:13:33.0 [FTL] Error trying to connect as leafnode: bad config")


async def test_a_node_broker_starts_with_its_hub_out_of_reach(short_dir: Path) -> None:
    [closed] = free_ports(1)  # nothing listens there
    server = NatsServer(short_dir / "store", config=leaf_config(
        "n", short_dir / "store", remote_urls=[f"nats://127.0.0.1:{closed}"], user="u", password="p"))
    try:
        for _ in range(3):  # in CI the refusal came before readiness at a restart, JetStream's store in place
            url = await server.start(timeout=15)
            bus = await nats.connect(url, connect_timeout=5)
            await bus.jetstream().add_stream(name="S", subjects=["s.>"])
            await bus.close()
            await server.stop()
    finally:
        await server.stop()
