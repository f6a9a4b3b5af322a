"""`nvidia-smi topo -m` tokens: their distance levels and a parser for the pasted matrix.

The allocator groups GPUs by how close they are (gpu-manager's topology tree, reference 3.4). Both backends
describe closeness with the tokens nvidia-smi prints, so that a user can paste their node's matrix into a
fake profile and get exactly what NVML would report there.
"""

from __future__ import annotations

import re

__all__ = ["KNOWN_TOKENS", "link_level", "nvlink_count", "parse_topo_matrix", "validate_matrix"]

# Levels follow NVML's nvmlGpuTopologyLevel_t (step 10). SOC is the old name of the CPU/NODE level.
_LEVELS: dict[str, int] = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SOC": 40, "SYS": 50}
KNOWN_TOKENS: tuple[str, ...] = (*_LEVELS, "NV<n>")

_NV = re.compile(r"NV([1-9][0-9]*)")
_GPU = re.compile(r"GPU([0-9]+)")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def nvlink_count(token: str) -> int:
    """Number of bonded NVLinks a token stands for: "NV12" -> 12, anything else -> 0."""
    m = _NV.fullmatch(token)
    return int(m.group(1)) if m else 0


def link_level(token: str) -> int:
    """Distance level of a token, 0 (same GPU or NVLink) .. 50 (across CPU sockets)."""
    if token in _LEVELS:
        return _LEVELS[token]
    if _NV.fullmatch(token):
        return 0
    raise ValueError(f"unknown topology token {token!r} (known: {', '.join(KNOWN_TOKENS)})")


def _is_token(word: str) -> bool:
    return word in _LEVELS or _NV.fullmatch(word) is not None


def _header(words: list[str]) -> bool:
    # A header starts with GPU0; a matrix row starts with GPU<n> followed by a token (X, NV4, ...).
    return bool(words) and words[0] == "GPU0" and (len(words) == 1 or not _is_token(words[1]))


def parse_topo_matrix(text: str) -> list[list[str]]:
    """The GPU x GPU token matrix of `nvidia-smi topo -m` output, as pasted by a user.

    Ignores colour escapes, text before the header, NIC columns and rows, the trailing
    ``CPU Affinity``/``NUMA Affinity``/``GPU NUMA ID`` columns and the legends. Raises ValueError
    naming the offending row/column when the matrix is not a valid topology.
    """
    lines = _ANSI.sub("", text).splitlines()
    start = next((i for i, line in enumerate(lines) if _header(line.split())), None)
    if start is None:
        raise ValueError("no header row starting with GPU0 found in the topology text")
    header = lines[start].split()
    n = 0
    while n < len(header) and _GPU.fullmatch(header[n]):
        if header[n] != f"GPU{n}":
            raise ValueError(f"topology header: column {n + 1} is {header[n]!r}, expected 'GPU{n}'")
        n += 1

    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        words = line.split()
        if not words:
            continue
        if words[0].lower().startswith("legend") or [w.lower() for w in words[:2]] == ["nic", "legend:"]:
            break
        if not _GPU.fullmatch(words[0]):
            continue  # NIC rows (NIC0, mlx5_0, ...)
        r = len(rows)
        if words[0] != f"GPU{r}":
            raise ValueError(f"topology row {r + 1} is labelled {words[0]!r}, expected 'GPU{r}'")
        cells = words[1 : n + 1]
        if len(cells) < n:
            raise ValueError(f"topology row GPU{r} has {len(cells)} GPU columns, expected {n}")
        rows.append(cells)
    validate_matrix(rows)
    return rows


def validate_matrix(rows: list[list[str]] | tuple[tuple[str, ...], ...]) -> None:
    """Check a token matrix: square, X exactly on the diagonal, known tokens, symmetric."""
    n = len(rows)
    if n == 0:
        raise ValueError("topology matrix has no GPU rows")
    for r, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(
                f"topology matrix is not square: row GPU{r} has {len(row)} columns, expected {n}"
            )
        for c, token in enumerate(row):
            try:
                link_level(token)
            except ValueError as exc:
                raise ValueError(f"topology row GPU{r}, column GPU{c}: {exc}") from None
            if (token == "X") != (r == c):
                expected = "'X'" if r == c else "a link token, not 'X'"
                raise ValueError(f"topology row GPU{r}, column GPU{c}: {token!r}, expected {expected}")
    for r in range(n):
        for c in range(r + 1, n):
            if rows[r][c] != rows[c][r]:
                raise ValueError(
                    f"topology matrix is not symmetric: GPU{r}->GPU{c} is {rows[r][c]!r} "
                    f"but GPU{c}->GPU{r} is {rows[c][r]!r}"
                )
