"""Configuration: every agent option as a flag, a GPULEDGER_* variable and a --config file key, with
precedence flag > environment > file > default; gpu-manager's flag names as aliases."""

from __future__ import annotations

import json
import re
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


# The configuration reference: its first table lists every setting.
CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def configuration_table(text: str | None = None) -> list[list[str]]:
    """The rows of the first table in docs/configuration.md, as cells."""
    text = CONFIGURATION.read_text() if text is None else text
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def undocumented_options(rows: list[list[str]]) -> list[str]:
    """What is wrong between the options and the table's rows (empty: nothing)."""
    problems = []
    documented: dict[str, list[str]] = {}
    for row in rows:
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", row[0]):  # first column: the option and its aliases
            documented[flag] = row
    options = [p for p in show.params if isinstance(p, click.Option)]
    for param in options:
        name = param.opts[0]
        if name not in documented:
            problems.append(f"{name} is not in the configuration table")
            continue
        row = documented[name]
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
        problems += [f"{name}: {var} missing from its row" for var in envvars if f"`{var}`" not in row[1]]
        if not row[2]:
            problems.append(f"{name}: no default in its row")
        problems += [f"{name}: alias {a} not documented" for a in param.opts[1:] if a not in documented]
    known = {opt for p in options for opt in p.opts + p.secondary_opts}
    problems += [f"docs/configuration.md documents an unknown option {f}" for f in sorted(set(documented) - known)]
    return problems


def test_every_option_is_a_row_of_the_configuration_table() -> None:
    rows = configuration_table()
    assert len(rows) > 30
    assert undocumented_options(rows) == []


def test_the_configuration_table_check_can_fail() -> None:
    text = CONFIGURATION.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `--hami-lock-dir`"))
    assert undocumented_options(configuration_table(text.replace(row + "\n", ""))) == \
        ["--hami-lock-dir is not in the configuration table"]
    wrong_var = text.replace("`GPULEDGER_USAGE_INTERVAL`", "`GPULEDGER_USAGE_PERIOD`")
    assert undocumented_options(configuration_table(wrong_var)) == \
        ["--usage-interval: GPULEDGER_USAGE_INTERVAL missing from its row"]
    stale = text.replace("| `--hami-lock-dir`", "| `--hami-lock-path`")
    assert ("docs/configuration.md documents an unknown option --hami-lock-path"
            in undocumented_options(configuration_table(stale)))
