"""Each service process imports only what it uses: heavy libraries stay out of the services that do not
need them (every service is its own interpreter, so each needless import is paid once per service)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# module -> top-level packages that importing it must not load
RULES = {
    "services.registrar.app": ("sqlalchemy", "lightkube", "simulator"),
    "services.vmanager.app": ("sqlalchemy", "lightkube", "simulator"),
    "services.watchdog.app": ("sqlalchemy", "simulator"),
    # the allocator creates the log's schema with SQLAlchemy, but only when the log is new
    "services.allocator.app": ("sqlalchemy", "simulator"),
    # `gpuledger run` starts a service without the rest of the CLI
    "gpuledger.run_cmd": ("gpuledger.cli", "simulator", "sqlalchemy", "lightkube", "elftools"),
}


@pytest.mark.parametrize("module", sorted(RULES))
def test_a_service_does_not_import_what_it_does_not_use(module: str) -> None:
    code = (f"import sys, {module}\n"
            f"print(' '.join(m for m in {RULES[module]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [], f"{module} imports {out.stdout.strip()}"
