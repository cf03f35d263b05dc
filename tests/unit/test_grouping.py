"""Layer-group planning: the adaptive rule, its overrides, and the layer split.

Worked numbers for num_layers=30, min_prompt_tokens=256, stages 8..2 (sat = 3*256 = 768):

    tokens   t      target_iters        group size  groups
    <=256    0      8                   30//8 = 3    10
    384      0.25   round(6.5)=6        30//6 = 5     6
    512      0.5    5                   30//5 = 6     5
    640      0.75   round(3.5)=4        30//4 = 7     5 (7,7,7,7,2)
    >=768    1      2                   30//2 = 15    2
"""

from __future__ import annotations

import pytest

from vllm_layerkv.config import ConfigError, LayerKVConfig
from vllm_layerkv.worker.grouping import (
    plan_group_size,
    plan_groups,
    split_layers,
    taper_last_group,
)

ADAPTIVE = LayerKVConfig(min_prompt_tokens=256, max_pipeline_stages=8, min_pipeline_stages=2)


@pytest.mark.parametrize("tokens,size,groups", [
    (1, 3, 10), (100, 3, 10), (256, 3, 10),
    (384, 5, 6), (512, 6, 5), (640, 7, 5),
    (768, 15, 2), (1000, 15, 2), (100_000, 15, 2),
])
def test_adaptive_rule_30_layers(tokens: int, size: int, groups: int) -> None:
    got = plan_group_size(30, tokens, ADAPTIVE)
    assert got == size
    assert len(split_layers(30, got)) == groups


def test_adaptive_group_size_is_monotone_between_the_thresholds() -> None:
    sizes = [plan_group_size(30, t, ADAPTIVE) for t in range(0, 1200, 7)]
    assert sizes[0] == 3 and sizes[-1] == 15
    assert all(a <= b for a, b in zip(sizes, sizes[1:])), sizes
    assert len(set(sizes)) >= 5  # it actually adapts in between, not a step function


def test_target_iterations_never_exceed_layers() -> None:
    # 4 layers, 8 stages wanted: one layer per group, never 0
    assert plan_group_size(4, 0, ADAPTIVE) == 1
    assert plan_group_size(1, 0, ADAPTIVE) == 1
    assert plan_group_size(1, 10_000, ADAPTIVE) == 1


def test_min_prompt_tokens_zero_means_always_saturated() -> None:
    cfg = LayerKVConfig(min_prompt_tokens=0, max_pipeline_stages=8, min_pipeline_stages=2)
    assert plan_group_size(30, 0, cfg) == 15
    assert plan_group_size(30, 5000, cfg) == 15


def test_equal_stage_bounds_give_a_constant_group_size() -> None:
    cfg = LayerKVConfig(min_pipeline_stages=4, max_pipeline_stages=4)
    assert {plan_group_size(32, t, cfg) for t in (0, 300, 600, 900, 5000)} == {8}


@pytest.mark.parametrize("fixed,expected", [(1, 1), (4, 4), (29, 29), (30, 30), (100, 30)])
def test_fixed_group_size_overrides_the_rule(fixed: int, expected: int) -> None:
    cfg = ADAPTIVE.replace(group_size=fixed)
    for tokens in (1, 256, 512, 10_000):
        assert plan_group_size(30, tokens, cfg) == expected


def test_layerwise_off_is_one_group_even_with_group_size() -> None:
    for cfg in (ADAPTIVE.replace(layerwise=False),
                ADAPTIVE.replace(layerwise=False, group_size=2)):
        for tokens in (1, 500, 10_000):
            size = plan_group_size(30, tokens, cfg)
            assert size == 30
            assert split_layers(30, size) == [range(30)]


def test_plan_rejects_no_layers() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        plan_group_size(0, 100, ADAPTIVE)


@pytest.mark.parametrize("num_layers", [1, 2, 7, 8, 30, 31, 80])
def test_split_layers_covers_each_layer_once_in_order(num_layers: int) -> None:
    for size in range(1, num_layers + 3):
        groups = split_layers(num_layers, size)
        flat = [layer for g in groups for layer in g]
        assert flat == list(range(num_layers))
        assert all(len(g) == size for g in groups[:-1])
        assert 1 <= len(groups[-1]) <= size
        assert len(groups) == -(-num_layers // size)


def test_split_layers_examples() -> None:
    assert split_layers(8, 3) == [range(3), range(3, 6), range(6, 8)]
    assert split_layers(30, 15) == [range(15), range(15, 30)]


def test_split_layers_rejects_non_positive_size() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="group_size"):
            split_layers(8, bad)


# ---------------------------------------------------------------- the link-rate rule
# Llama-3.1-8B: 32 layers; an 8K-token step is 1.07 GB of KV.

@pytest.mark.parametrize("transfer_ms,size", [
    (0.0, 16),      # rate not measured yet: the adaptive rule alone (2 groups)
    (3.0, 16),      # NVLink: the step's KV moves within group_transfer_ms
    (20.0, 16),     # exactly one group's worth: still the adaptive rule
    (60.0, 10),     # ceil(60 / 20) = 3 groups' worth: 32 // 3 = 10 layers
    (368.0, 1),     # a 2.9 GB/s path: ceil(368 / 20) = 19 -> 32 // 19 = 1 layer
    (5000.0, 1),    # never fewer than one layer per group
])
def test_a_slow_link_raises_the_number_of_groups(transfer_ms: float, size: int) -> None:
    config = LayerKVConfig(min_prompt_tokens=256, min_pipeline_stages=2)
    assert plan_group_size(32, 8192, config, transfer_ms / 1e3) == size


def test_the_link_rule_never_lowers_the_adaptive_number_of_groups() -> None:
    config = LayerKVConfig(min_prompt_tokens=256)
    for tokens in (1, 256, 384, 512, 768, 8192):
        base = plan_group_size(32, tokens, config)
        for transfer_ms in (0.5, 5, 50, 500):
            assert plan_group_size(32, tokens, config, transfer_ms / 1e3) <= base


def test_group_transfer_ms_zero_turns_the_link_rule_off() -> None:
    off = LayerKVConfig(min_prompt_tokens=256, group_transfer_ms=0)
    assert plan_group_size(32, 8192, off, 0.368) == 16


def test_a_fixed_group_size_or_layerwise_off_ignores_the_link() -> None:
    assert plan_group_size(32, 8192, LayerKVConfig(group_size=8), 0.368) == 8
    assert plan_group_size(32, 8192, LayerKVConfig(layerwise=False), 0.368) == 32


def test_group_transfer_ms_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="group_transfer_ms=-1.0 must be >= 0"):
        LayerKVConfig(group_transfer_ms=-1.0).validate()


# ---------------------------------------------------------------- the last group's taper

@pytest.mark.parametrize("sizes,last,expected", [
    ([16, 16], 1, [16, 8, 4, 2, 1, 1]),
    ([16, 16], 2, [16, 8, 4, 2, 2]),
    ([16, 16], 0, [16, 16]),
    ([15, 15], 1, [15, 8, 4, 2, 1]),
    ([3, 3, 3, 1], 1, [3, 3, 3, 1]),        # the last group is small enough already
    ([4, 4, 4, 4, 4, 4, 4, 4], 1, [4] * 7 + [2, 1, 1]),
    ([32], 1, [16, 8, 4, 2, 1, 1]),         # one group: split as well
])
def test_taper_splits_the_last_group_by_halves(sizes: list[int], last: int,
                                               expected: list[int]) -> None:
    groups, start = [], 0
    for n in sizes:
        groups.append(range(start, start + n))
        start += n
    tapered = taper_last_group(groups, last)
    assert [len(g) for g in tapered] == expected
    assert [layer for g in tapered for layer in g] == list(range(start))


def test_taper_rejects_a_negative_size() -> None:
    with pytest.raises(ValueError, match="last_layers"):
        taper_last_group([range(4)], -1)


def test_plan_groups_announces_where_the_even_split_did() -> None:
    """The end is announced after the first group of 16, as without the taper: D's early
    release keeps the compute of 16 layers to overlap its hand-over."""
    config = LayerKVConfig(min_prompt_tokens=256, min_pipeline_stages=2)
    groups, announce = plan_groups(32, 8192, config)
    assert [len(g) for g in groups] == [16, 8, 4, 2, 1, 1]
    assert announce == 0 and groups[announce].stop == 16
    groups, announce = plan_groups(32, 8192, config.replace(last_group_layers=0))
    assert [len(g) for g in groups] == [16, 16] and announce == 0


def test_plan_groups_keeps_a_fixed_group_size_and_one_group_whole() -> None:
    groups, announce = plan_groups(32, 8192, LayerKVConfig(group_size=8))
    assert [len(g) for g in groups] == [8, 8, 8, 8] and announce == 2
    groups, announce = plan_groups(32, 8192, LayerKVConfig(layerwise=False))
    assert groups == [range(32)] and announce == -1


def test_last_group_layers_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="last_group_layers=-1 must be >= 0"):
        LayerKVConfig(last_group_layers=-1).validate()
