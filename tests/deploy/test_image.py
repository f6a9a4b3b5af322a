"""deploy/Dockerfile installs only what deploy/requirements.lock pins with hashes, and the lock pins every
dependency of pyproject.toml (and the build backend) at a version pyproject allows, for the image's Python.
The image build itself does not run here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.helpers import DEPLOY, ROOT

LOCK = DEPLOY / "requirements.lock"
DOCKERFILE = DEPLOY / "Dockerfile"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def pins(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a `--generate-hashes` requirements file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if match := _PIN.match(line):
            current = []
            entries[canonicalize_name(match[1])] = (match[2], current)
        elif current is not None and (hashes := re.findall(r"--hash=sha256:([0-9a-f]{64})", line)):
            current.extend(hashes)
        elif line and not line[0].isspace() and not line.startswith("#"):
            raise AssertionError(f"not a pinned requirement: {line!r}")
    return entries


def required() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build_in = (DEPLOY / "build-requirements.in").read_text().splitlines()
    names = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    names += [line for line in build_in if line.strip() and not line.startswith("#")]
    return [Requirement(name) for name in names]


def test_the_lock_pins_every_requirement_with_hashes() -> None:
    locked = pins(LOCK.read_text())
    assert len(locked) >= 20
    for requirement in required():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in {LOCK.name}: run `make lock`"
        version, _ = locked[name]
        assert requirement.specifier.contains(version, prereleases=True), \
            f"{LOCK.name} pins {name}=={version}, pyproject wants {requirement}: run `make lock`"
    unhashed = [name for name, (_, hashes) in locked.items() if not hashes]
    assert not unhashed, f"pins without a hash: {unhashed}"


def test_the_lock_parser_refuses_unpinned_lines() -> None:
    with pytest.raises(AssertionError, match="not a pinned requirement"):
        pins("aiohttp>=3\n")
    assert pins("a==1 \\\n    --hash=sha256:" + "0" * 64 + "\n")["a"] == ("1", ["0" * 64])


def test_the_lock_is_for_the_images_python() -> None:
    image_python = re.search(r"^FROM python:(\d+\.\d+)", DOCKERFILE.read_text(), re.M)
    assert image_python, "the Dockerfile's base image is not a python:X.Y image"
    makefile = (ROOT / "Makefile").read_text()
    assert f"--python-version {image_python[1]}" in makefile
    assert "make lock" in LOCK.read_text().splitlines()[1]


def test_the_dockerfile_installs_only_from_the_lock() -> None:
    text = DOCKERFILE.read_text()
    installs = re.findall(r"pip install ([^&\n]*)", text)
    assert installs, "the Dockerfile installs nothing"
    for options in installs:
        hashed = "--require-hashes -r requirements.lock" in options
        own = "--no-deps" in options and "--no-build-isolation" in options and options.rstrip().endswith(" .")
        assert hashed or own, f"an install that fetches unpinned packages: pip install {options}"
    assert "COPY deploy/requirements.lock" in text
    assert text.index("--require-hashes") < text.index("--no-build-isolation")
    assert Path(DEPLOY / "build-requirements.in").exists()
