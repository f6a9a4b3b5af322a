"""The `nvidia-smi topo -m` parser against real-looking outputs (tests/gpu/data) and broken ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.gpu import link_level, nvlink_count, parse_topo_matrix

DATA = Path(__file__).parent / "data"

NV12_8 = [["X" if i == j else "NV12" for j in range(8)] for i in range(8)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("dgx-a100-8gpu.txt", NV12_8),
        (
            "pcie-4gpu.txt",
            [
                ["X", "PIX", "PXB", "NODE"],
                ["PIX", "X", "PXB", "NODE"],
                ["PXB", "PXB", "X", "NODE"],
                ["NODE", "NODE", "NODE", "X"],
            ],
        ),
        (
            "old-driver-soc-4gpu.txt",
            [
                ["X", "PHB", "SOC", "SOC"],
                ["PHB", "X", "SOC", "SOC"],
                ["SOC", "SOC", "X", "PHB"],
                ["SOC", "SOC", "PHB", "X"],
            ],
        ),
        ("nvlink-2gpu.txt", [["X", "NV4"], ["NV4", "X"]]),
        ("single-gpu.txt", [["X"]]),
    ],
)
def test_sample_outputs(name: str, expected: list[list[str]]) -> None:
    assert parse_topo_matrix((DATA / name).read_text()) == expected


def test_samples_really_carry_the_noise_the_parser_must_skip() -> None:
    dgx = (DATA / "dgx-a100-8gpu.txt").read_text()
    assert "\x1b[4m" in dgx and "NIC Legend:" in dgx and "NIC0" in dgx and "CPU Affinity" in dgx
    assert "\t" in dgx
    old = (DATA / "old-driver-soc-4gpu.txt").read_text()
    assert "mlx5_0" in old and "SOC" in old


def test_space_separated_without_legend_and_leading_text() -> None:
    text = (
        "some prompt text\n"
        "     GPU0  GPU1  GPU2\n"
        "GPU0   X    PHB   SYS\n"
        "GPU1  PHB    X    SYS\n"
        "GPU2  SYS   SYS    X\n"
    )
    assert parse_topo_matrix(text) == [["X", "PHB", "SYS"], ["PHB", "X", "SYS"], ["SYS", "SYS", "X"]]


def test_header_without_leading_blank_and_colour_on_rows() -> None:
    text = "\x1b[4mGPU0\tGPU1\tCPU Affinity\x1b[0m\n\x1b[1mGPU0\x1b[0m\t X \tPIX\t0-7\nGPU1\tPIX\t X \t0-7\n"
    assert parse_topo_matrix(text) == [["X", "PIX"], ["PIX", "X"]]


def test_legend_lines_are_not_read_as_rows() -> None:
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV2\t X \nLegend:\n  GPU9 = not a row\n"
    assert parse_topo_matrix(text) == [["X", "NV2"], ["NV2", "X"]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no header row"),
        ("nothing here\n", "no header row"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n", "not square"),  # a missing row
        ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tPIX\t X \n", "row GPU0 has 1 GPU columns, expected 2"),
        ("\tGPU0\tGPU1\nGPU0\tPIX\tPIX\nGPU1\tPIX\t X \n", "row GPU0, column GPU0"),  # bad diagonal
        ("\tGPU0\tGPU1\nGPU0\t X \t X \nGPU1\t X \t X \n", "row GPU0, column GPU1"),  # X off the diagonal
        ("\tGPU0\tGPU1\nGPU0\t X \tQPI\nGPU1\tQPI\t X \n", "unknown topology token 'QPI'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV0\nGPU1\tNV0\t X \n", "unknown topology token 'NV0'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPHB\t X \n", "GPU0->GPU1 is 'PIX' but GPU1->GPU0 is 'PHB'"),
        ("\tGPU0\tGPU1\nGPU1\tPIX\t X \nGPU0\t X \tPIX\n", "labelled 'GPU1', expected 'GPU0'"),
        ("\tGPU0\tGPU2\nGPU0\t X \tPIX\nGPU2\tPIX\t X \n", "column 2 is 'GPU2', expected 'GPU1'"),
    ],
)
def test_invalid_matrices(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_topo_matrix(text)
    assert message in str(info.value)


def test_asymmetry_reports_the_first_pair() -> None:
    text = (
        "  GPU0 GPU1 GPU2\n"
        "GPU0 X PIX SYS\n"
        "GPU1 PIX X PXB\n"
        "GPU2 SYS PHB X\n"
    )
    with pytest.raises(ValueError, match=r"GPU1->GPU2 is 'PXB' but GPU2->GPU1 is 'PHB'"):
        parse_topo_matrix(text)


@pytest.mark.parametrize(
    ("token", "level"),
    [("X", 0), ("NV1", 0), ("NV12", 0), ("NV18", 0), ("PIX", 10), ("PXB", 20), ("PHB", 30), ("NODE", 40),
     ("SOC", 40), ("SYS", 50)],
)
def test_link_level(token: str, level: int) -> None:
    assert link_level(token) == level


@pytest.mark.parametrize("token", ["", "x", "NV", "NV0", "NVx", "QPI", "pix", " PIX", "GPU0", "N/A"])
def test_link_level_rejects_unknown_tokens(token: str) -> None:
    with pytest.raises(ValueError, match="unknown topology token"):
        link_level(token)


@pytest.mark.parametrize(("token", "count"), [("NV12", 12), ("NV1", 1), ("NV4", 4), ("PIX", 0), ("X", 0),
                                              ("SYS", 0), ("NV", 0), ("junk", 0)])
def test_nvlink_count(token: str, count: int) -> None:
    assert nvlink_count(token) == count
