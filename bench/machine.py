"""What ran a benchmark, for its printout: the machine and the interpreter.

The same Python version can be built with or without profile-guided optimisation: on the 2-vCPU machine
of docs/benchmarks.md, Debian 12's python3.11 spent about a tenth less CPU per pod than an unoptimised
build of 3.11 (twenty-eighth round), the deployed image's (python:3.12-slim) is an optimised build, and
the floors a benchmark compares with run on the same interpreter as gpuledger. The version alone does
not tell such builds apart; the interpreter's file does.
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["describe", "interpreter"]


def describe() -> str:
    """``x86_64 2 cpu, Python 3.11.2 (/usr/bin/python3.11)``."""
    return f"{platform.machine()} {os.cpu_count()} cpu, {interpreter()}"


def interpreter() -> str:
    """``Python 3.11.2 (/usr/bin/python3.11)``: the version and the file a virtual environment points at."""
    return f"Python {platform.python_version()} ({os.path.realpath(sys.executable)})"
