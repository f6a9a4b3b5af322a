"""The fleet setting: one URL plus a credentials file makes the embedded broker a leaf node; none
changes nothing; bad input gets a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from gpuledger.launcher import _leaf_config
from libs.config import Settings
from libs.errors import GpuledgerError
from libs.fleet.credentials import load_credentials, with_credentials
from libs.fleet.natsconf import leaf_config


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
