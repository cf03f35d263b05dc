"""The fused staging copy's host-side decisions (the kernel itself runs in tests/gpu)."""

from __future__ import annotations

import torch

from vllm_layerkv.kv import fused_copy


def test_word_is_the_widest_that_divides_every_size_and_address() -> None:
    assert fused_copy._word(65536, 32768, 32768, 0x7F0000000000) == 8
    assert fused_copy._word(48, 12, 12) == 4
    assert fused_copy._word(8192, 6, 6) == 2
    assert fused_copy._word(8, 3, 1) == 1


def test_cpu_tensors_are_left_to_torch() -> None:
    caches = [torch.zeros(4, 64, dtype=torch.uint8)]
    buf = torch.empty(256, dtype=torch.uint8)
    idx = torch.tensor([1, 2])
    assert not fused_copy.available(buf.device)
    assert not fused_copy.copy_slices(caches, [0], idx, 0, 32, buf, to_buf=True)


def test_warm_up_launches_nothing_where_torch_copies() -> None:
    assert fused_copy.warm_up(65536, torch.device("cpu"), to_buf=True) == 0
