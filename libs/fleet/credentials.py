"""The credentials file a node (or the recorder) logs in to the central cluster with.

A small YAML file, readable only by the agent::

    user: node-ip-10-0-0-1
    password: 5c0f...

``gpuledger fleet join`` prints it for a node; the central servers' configuration holds the same pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import yaml

from libs.errors import GpuledgerError

__all__ = ["Credentials", "load_credentials", "with_credentials"]


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str


def load_credentials(path: str | Path) -> Credentials:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise GpuledgerError(f"cannot read the fleet credentials file {path}: {exc}") from exc
    if not isinstance(data, dict) or not data.get("user") or not data.get("password"):
        raise GpuledgerError(f"the fleet credentials file {path} must hold 'user:' and 'password:'")
    return Credentials(str(data["user"]), str(data["password"]))


def with_credentials(urls: str, creds: Credentials | None) -> str:
    """``nats://h1:4222,nats://h2:4222`` with the user and password in each URL (a client connect)."""
    if creds is None:
        return urls
    out = []
    for url in (u.strip() for u in urls.split(",") if u.strip()):
        parts = urlsplit(url)
        out.append(f"{parts.scheme}://{quote(creds.user, safe='')}:{quote(creds.password, safe='')}@"
                   f"{parts.hostname}:{parts.port or 4222}")
    return ",".join(out)
