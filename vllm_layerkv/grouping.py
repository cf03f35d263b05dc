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

One exception to "fewer groups for long steps": a route that moves each group in staging-buffer
pieces anyway (``host_bounce``; head slices when P and D use different TP) pays the per-transfer
overhead per piece, not per group. Splitting a step into more groups then costs nothing as long
as each group still fills a piece, and the first group goes out sooner: such steps get
``min(max_pipeline_stages, step_bytes // piece_bytes)`` groups when that is more than the rule
gives. (Measured on the bounce path, where the link is slower than the prefill: the first of two
16-layer groups of an 8K chunk waited 88 ms for its compute before a byte moved.)
"""

from __future__ import annotations

from vllm_layerkv.config import LayerKVConfig


def plan_group_size(num_layers: int, step_tokens: int, config: LayerKVConfig,
                    step_bytes: int = 0, piece_bytes: int = 0) -> int:
    """Layers per group for a step that streams ``step_tokens`` new tokens (``step_bytes`` of
    KV) per request on average; ``piece_bytes``: the staging-buffer piece its routes move a
    group in (0: whole groups at once)."""
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
    if piece_bytes > 0:  # groups down to one piece each cost no extra transfers
        target_iters = max(target_iters, min(hi_stages, step_bytes // piece_bytes))
    target_iters = min(max(target_iters, 1), num_layers)
    return max(1, num_layers // target_iters)


def split_layers(num_layers: int, group_size: int) -> list[range]:
    """Contiguous layer ranges of ``group_size`` (the last one may be shorter)."""
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return [range(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]
