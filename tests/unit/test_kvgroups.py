"""Which blocks each kind of KV cache group sends, and when (vllm_layerkv.kv.groups)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm_layerkv.compat import kv_groups
from vllm_layerkv.kv.groups import (
    NULL_BLOCK,
    BlockTableError,
    KVGroupInfo,
    prefill_backoff,
    select_blocks,
    state_block,
    unsupported_kinds,
)

BS = 16
FULL = KVGroupInfo("full", ("l.1",), BS, 4096)
MLA = KVGroupInfo("mla", ("l.1",), BS, 4096)
SWA = KVGroupInfo("sliding", ("l.0",), BS, 4096, sliding_window=64)
MAMBA = KVGroupInfo("mamba", ("l.2",), 2048, 4096)
MAMBA_SPEC = KVGroupInfo("mamba", ("l.2",), 2048, 4096, num_spec_blocks=2)


def sel(group: KVGroupInfo, src: list[int], dst: list[int], *, sent: int = 0, upto: int,
        start: int = 0, n: int, final: bool | None = None) -> tuple[list[int], list[int]]:
    return select_blocks(group, src, dst, sent_tokens=sent, upto=upto, start_token=start,
                         num_tokens=n, final=upto >= n if final is None else final)


def test_full_attention_sends_from_the_watermark_block_every_step() -> None:
    src, dst = list(range(10, 20)), list(range(30, 40))
    # first chunk: tokens [0, 40) -> blocks 0..2 (block 2 partly filled)
    assert sel(FULL, src, dst, upto=40, n=150) == ([10, 11, 12], [30, 31, 32])
    # next chunk resends the partly filled block 2
    assert sel(FULL, src, dst, sent=40, upto=80, n=150) == ([12, 13, 14], [32, 33, 34])


def test_mla_streams_like_full_attention() -> None:
    """MLA's latent cache is one vector per token that every later token attends to: the
    same blocks go at the same time as for full attention, in every step."""
    src, dst = list(range(10, 20)), list(range(30, 40))
    for kw in (dict(upto=20, n=100), dict(sent=16, upto=40, n=100),
               dict(sent=96, upto=100, n=100)):
        assert sel(MLA, src, dst, **kw) == sel(FULL, src, dst, **kw) != ([], [])
    assert not unsupported_kinds([MLA, FULL])


def test_sliding_window_sends_nothing_before_the_last_chunk() -> None:
    src, dst = list(range(10, 20)), list(range(30, 40))
    assert sel(SWA, src, dst, upto=64, n=150) == ([], [])


def test_sliding_window_sends_only_the_tail_window_at_the_end() -> None:
    # P freed the blocks below the window (vLLM puts the null block there)
    src = [NULL_BLOCK] * 5 + [15, 16, 17, 18, 19]
    dst = list(range(30, 40))
    # 150 tokens, window 64: D needs tokens [86, 150) -> blocks 5..9
    assert sel(SWA, src, dst, sent=128, upto=150, n=150) == (
        [15, 16, 17, 18, 19], [35, 36, 37, 38, 39])


def test_sliding_window_skips_what_decode_does_not_hold_or_already_has() -> None:
    src = list(range(10, 20))
    dst = [NULL_BLOCK] * 6 + [36, 37, 38, 39]  # D only allocated the window
    assert sel(SWA, src, dst, upto=150, n=150) == ([16, 17, 18, 19], [36, 37, 38, 39])
    # D's own prefix hit covers [0, 128): only block 8 onwards is sent
    assert sel(SWA, src, list(range(30, 40)), start=128, upto=150, n=150) == (
        [18, 19], [38, 39])


def test_sliding_window_refuses_a_block_prefill_already_freed() -> None:
    src = [NULL_BLOCK] * 7 + [17, 18, 19]
    with pytest.raises(BlockTableError, match="freed"):
        sel(SWA, src, list(range(30, 40)), upto=150, n=150)


def test_mamba_sends_the_running_state_slot_once_at_the_end() -> None:
    assert sel(MAMBA, [7], [9], upto=64, n=150) == ([], [])
    assert sel(MAMBA, [7], [9], sent=128, upto=150, n=150) == ([7], [9])
    # speculative scratch slots trail the state slot; placeholders precede it
    assert sel(MAMBA_SPEC, [NULL_BLOCK, 5, 6, 7], [8, 9, 10], upto=150, n=150) == ([5], [8])


def test_state_block_follows_vllm_clipping() -> None:
    assert state_block([], 0) == NULL_BLOCK
    assert state_block([4], 3) == 4  # the state slot survives even before scratch allocation
    assert state_block([1, 2, 3], 0) == 3
    assert state_block([1, 2, 3], 1) == 2


def test_a_short_block_table_is_an_error_not_a_short_send() -> None:
    with pytest.raises(BlockTableError, match="needs blocks"):
        sel(FULL, [1, 2], [3, 4, 5], upto=40, n=40)


def test_backoff_only_for_state_groups() -> None:
    assert prefill_backoff([FULL, SWA]) == 0
    assert prefill_backoff([MAMBA, FULL]) == 1


def test_groups_read_from_a_real_vllm_kv_cache_config() -> None:
    attn = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.mixer"], MambaSpec(
            block_size=BS, shapes=((3, 8), (4, 16)), dtypes=(torch.float32, torch.float32),
            page_size_padded=FullAttentionSpec(**attn).page_size_bytes)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**attn)),
        KVCacheGroupSpec(["model.layers.2.self_attn.attn"],
                         SlidingWindowSpec(**attn, sliding_window=64)),
    ])
    groups = kv_groups(cfg)
    assert [g.kind for g in groups] == ["mamba", "full", "sliding"]
    assert len({g.page_bytes for g in groups}) == 1
    assert groups[2].sliding_window == 64 and not unsupported_kinds(groups)
    assert [g.signature() for g in groups] == [
        "mamba:1x16/float32+float32", "full:1x16/float32", "sliding:1x16/w64/float32"]


def test_state_dtypes_are_in_the_signature_though_the_page_is_the_same() -> None:
    """``--mamba-ssm-cache-dtype float32`` on one side only: Mamba's state page is padded up to
    the attention page either way, so only the dtypes tell the two apart."""
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def mamba(ssm: torch.dtype) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], MambaSpec(
                block_size=BS, shapes=((3, 8), (4, 16)), dtypes=(torch.bfloat16, ssm),
                page_size_padded=attn.page_size_bytes)),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], attn)])

    bf16, fp32 = kv_groups(mamba(torch.bfloat16))[0], kv_groups(mamba(torch.float32))[0]
    assert bf16.page_bytes == fp32.page_bytes
    assert (bf16.signature(), fp32.signature()) == (
        "mamba:1x16/bfloat16+bfloat16", "mamba:1x16/bfloat16+float32")
