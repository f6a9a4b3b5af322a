"""Configuration: every agent option as a flag, a GPULEDGER_* variable and a --config file key, with
precedence flag > environment > file > default; gpu-manager's flag names as aliases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from gpuledger.options import agent_options, settings_from
from libs.config import Settings, parse_node_labels


@click.command()
@agent_options
def show(**values: Any) -> None:
    settings = settings_from(values)
    click.echo(json.dumps({f: getattr(settings, f) for f in Settings.__struct_fields__}))


def run(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    result = CliRunner().invoke(show, args, env=env or {}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = tmp_path / "gpuledger.yaml"
    cfg.write_text("node-name: from-file\nallocate_timeout: 7\nnode-labels: a=1\nshare-mode: false\n")
    assert run([])["allocation_check_period"] == 30.0  # default
    got = run(["--config", str(cfg)])
    assert (got["node_name"], got["allocate_timeout"], got["node_labels"], got["share_mode"]) == \
        ("from-file", 7.0, "a=1", False)
    got = run(["--config", str(cfg)], env={"GPULEDGER_NODE_NAME": "from-env", "GPULEDGER_ALLOCATE_TIMEOUT": "8"})
    assert (got["node_name"], got["allocate_timeout"]) == ("from-env", 8.0)
    got = run(["--config", str(cfg), "--node-name", "from-flag"], env={"GPULEDGER_NODE_NAME": "from-env"})
    assert got["node_name"] == "from-flag" and got["allocate_timeout"] == 7.0
    got = run([], env={"GPULEDGER_CONFIG": str(cfg)})
    assert got["node_name"] == "from-file"


def test_every_settings_field_has_a_flag_a_variable_and_a_file_key(tmp_path: Path) -> None:
    params = {p.name: p for p in show.params if isinstance(p, click.Option)}
    for name in Settings.__struct_fields__:
        assert name in params, f"no option for Settings.{name}"
        envvars = params[name].envvar
        envvars = [envvars] if isinstance(envvars, str) else list(envvars or [])
        assert f"GPULEDGER_{name.upper()}" in envvars, name
    # and Settings.to_env() round-trips through the variables
    settings = Settings(node_name="n", state_dir=str(tmp_path), node_labels="x=y", allocation_check_period=3,
                        share_mode=False)
    got = run([], env=settings.to_env())
    assert Settings(**got) == settings


def test_gpu_manager_flag_names_are_aliases(tmp_path: Path) -> None:
    got = run(["--hostname-override", "h", "--device-plugin-path", "/dp", "--virtual-manager-path", "/vm",
               "--allocation-check-period", "5"])
    assert (got["node_name"], got["device_plugin_dir"], got["vm_dir"], got["allocation_check_period"]) == \
        ("h", "/dp", "/vm", 5.0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("hostname-override: h2\n")
    assert run(["--config", str(cfg)])["node_name"] == "h2"


@pytest.mark.parametrize(("content", "message"), [
    ("no-such-option: 1\n", "unknown key 'no-such-option'"),
    ("- a\n- b\n", "must hold a mapping"),
    ("node-name: [unclosed\n", "cannot read"),
    ("node-labels: 'novalue'\n", "is not key=value"),
])
def test_a_bad_config_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(content)
    result = CliRunner().invoke(show, ["--config", str(cfg)])
    assert result.exit_code == 2 and message in result.output, result.output


def test_node_labels_syntax() -> None:
    assert parse_node_labels("a=1, example.com/b=x-y ,c=") == {"a": "1", "example.com/b": "x-y", "c": ""}
    assert parse_node_labels("") == {}
    for bad in ("a", "a=b c", "-a=1", "Bad_Prefix/a=1", "a=" + "x" * 64):
        with pytest.raises(ValueError):
            parse_node_labels(bad)
