"""Layer-group planning: how many layers go out per transfer within one engine step.

The rule is the adaptive one of SGLang PR #23515 (layer-pipelined P/D transfer):

    sat_tokens   = 3 * min_prompt_tokens
    t            = clamp((tokens - min_prompt_tokens) / (sat_tokens - min_prompt_tokens), 0, 1)
    target_iters = round(max_stages - t * (max_stages - min_stages))
    group_size   = max(1, num_layers // target_iters)

Why fewer, larger groups as the step grows: the pipeline's total time is about
``compute + transfer / N`` when the link keeps up and ``compute / N + transfer`` when it does
not; N (groups) hides all but one group's transfer, but each group costs a fixed per-transfer
overhead. Short steps have little compute to hide behind, so they get many small groups; long
steps already have long per-group compute, so a few large transfers win. Prompts below
``min_prompt_tokens`` are not pipelined at all (the seed measured +18 % TTFT at 256 tokens when
it did): they go as one group after the step's last layer.

That rule knows the step's size but not the link. On a link slower than the prefill (its
measured rate: ``link_rate.py``), a step of two large groups starts sending only after half
the layers are computed and leaves the link idle meanwhile, and when the link is a little
faster than the prefill, the last group's whole transfer is exposed after the forward. So the
number of groups is raised until one group's share of the step's transfer takes at most
``group_transfer_ms`` on the link:

    target_iters = max(target_iters, ceil(transfer_s / group_transfer_ms))

On a link fast enough that the step's whole KV moves within ``group_transfer_ms`` (NVLink)
the adaptive rule stands unchanged.

Whatever the link, the transfer of the step's last group starts only after P's last layer, so
it is exposed in full: half the step's KV with two groups. So the last group is split, halving,
until its final piece has at most ``last_group_layers`` layers (``taper_last_group``): a
32-layer step of two groups goes out as 16, 8, 4, 2, 1 and 1 layers, and only one layer's KV
(1/32) is left to move after the forward. Each piece is sent as soon as its layers are
computed, so the pieces before the last overlap the layers that follow them.
"""

from __future__ import annotations

import math

from vllm_layerkv.config import LayerKVConfig


def plan_group_size(num_layers: int, step_tokens: int, config: LayerKVConfig,
                    transfer_s: float = 0.0) -> int:
    """Layers per group for a step that streams ``step_tokens`` new tokens on average and
    whose KV takes about ``transfer_s`` on the link (0: not known yet)."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    if not config.layerwise:
        return num_layers
    if config.group_size > 0:
        return min(config.group_size, num_layers)
    low = config.min_prompt_tokens
    sat = 3 * low
    if sat > low:
        t = (step_tokens - low) / (sat - low)
    else:  # min_prompt_tokens == 0: every step is "saturated"
        t = 1.0
    t = min(max(t, 0.0), 1.0)
    hi_stages, lo_stages = config.max_pipeline_stages, config.min_pipeline_stages
    target_iters = round(hi_stages - t * (hi_stages - lo_stages))
    if config.group_transfer_ms > 0 and transfer_s > 0:
        target_iters = max(target_iters, math.ceil(transfer_s * 1e3 / config.group_transfer_ms))
    target_iters = min(max(target_iters, 1), num_layers)
    return max(1, num_layers // target_iters)


def split_layers(num_layers: int, group_size: int) -> list[range]:
    """Contiguous layer ranges of ``group_size`` (the last one may be shorter)."""
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return [range(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]


def taper_last_group(groups: list[range], last_layers: int) -> list[range]:
    """``groups`` with the last one split, halving (the larger half first), until the final
    piece has at most ``last_layers`` layers; 0 leaves it whole. E.g. 16 layers, 1 -> 8, 4, 2,
    1, 1."""
    if last_layers < 0:
        raise ValueError(f"last_layers must be >= 0, got {last_layers}")
    if last_layers == 0 or not groups or len(groups[-1]) <= last_layers:
        return list(groups)
    last = groups[-1]
    pieces: list[range] = []
    start, left = last.start, len(last)
    while left > last_layers:
        head = left - left // 2
        pieces.append(range(start, start + head))
        start, left = start + head, left - head
    pieces.append(range(start, last.stop))
    return [*groups[:-1], *pieces]


def plan_groups(num_layers: int, step_tokens: int, config: LayerKVConfig,
                transfer_s: float = 0.0) -> tuple[list[range], int]:
    """The step's layer groups, and the index of the group after which only the last group
    of the even split is left (-1: none). P announces a transfer's end there
    (``TransferNearlyDone``), as early as it would without the taper, so that D's early release
    keeps that group's compute to overlap. The taper applies to the adaptive rule only: a fixed
    ``group_size`` is kept as it is."""
    groups = split_layers(num_layers, plan_group_size(num_layers, step_tokens, config,
                                                      transfer_s))
    announce = len(groups) - 2
    if config.layerwise and config.group_size == 0:
        groups = taper_last_group(groups, config.last_group_layers)
    return groups, announce
