"""Body version 4's packed identifiers and kubelet IDs (``libs.store.packed``) spell back exactly, and
values of another shape take the escape."""

from __future__ import annotations

import random

import pytest

from libs.store.packed import (
    gpu_text,
    hex_text,
    pack_gpu,
    pack_hex,
    pack_uuid,
    pack_vcores,
    unpack_vcores,
    uuid_text,
)

_ODD = ["", "a1", "x" * 16, "é" * 8, "ABCDEF0123456789ABCDEF0123456789", "import:u1/main", "\u00ff" * 20]


@pytest.mark.parametrize("text", ["0123456789abcdef" * 2, *_ODD])
def test_hex_ids_round_trip(text: str) -> None:
    packed = pack_hex(text)
    assert hex_text(packed) == text
    assert (len(packed) == 16) == (text == "0123456789abcdef" * 2)


@pytest.mark.parametrize("text", ["a48bacd1-2648-4203-87e9-66c534c40e8c", "A48BACD1-2648-4203-87E9-66C534C40E8C",
                                  "a48bacd126484203 87e966c534c40e8c", *_ODD])
def test_uuids_round_trip(text: str) -> None:
    packed = pack_uuid(text)
    assert uuid_text(packed) == text
    assert (len(packed) == 16) == (text == "a48bacd1-2648-4203-87e9-66c534c40e8c")


@pytest.mark.parametrize("text", ["GPU-c5a438ad-b219-54fc-a1ab-92abbc41c347",
                                  "MIG-c5a438ad-b219-54fc-a1ab-92abbc41c347", "GPU-1", "GPU-c5a438ad", *_ODD])
def test_gpu_uuids_round_trip(text: str) -> None:
    packed = pack_gpu(text)
    assert gpu_text(packed) == text
    assert (len(packed) == 16) == (text == "GPU-c5a438ad-b219-54fc-a1ab-92abbc41c347")


@pytest.mark.parametrize("numbers", [[], [0], [255], [256, 0], [3, 1, 2], list(range(100)), [2**40, 7]])
def test_vcores_keep_their_order(numbers: list[int]) -> None:
    assert unpack_vcores(pack_vcores(numbers)) == numbers


def test_scattered_vcores_take_about_nine_bits_each_on_a_node_of_four_gpus() -> None:
    numbers = random.Random(1).sample(range(400), 90)
    packed = pack_vcores(numbers)
    assert unpack_vcores(packed) == numbers
    assert len(packed) == 1 + (90 * 9 + 7) // 8


def test_a_width_under_eight_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="width 7"):
        unpack_vcores(b"\x07\x00")
