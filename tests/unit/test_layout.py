"""KV tensor geometry on CPU tensors shaped like vLLM's HND caches
``[num_blocks, kv_heads, block_size, 2*head_size]``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm_layerkv.kv import tp
from vllm_layerkv.kv.layout import (
    KVLayout,
    LayoutError,
    attention_spec,
    compat_info,
    kv_cache_format,
    layer_index,
)
from vllm_layerkv.wire.protocol import compatibility_error

NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD = 10, 2, 16, 8


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _cache(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(num_blocks, HEADS, block_size, 2 * HEAD).to(dtype)


@pytest.mark.parametrize("name,index", [
    ("model.layers.7.self_attn.attn", 7),
    ("model.layers.12.attn", 12),
    ("transformer.h.3.attn.attn", 3),
    ("model.decoder.layers.0.self_attn.attn", 0),
    ("blocks.5.attn", 5),
    ("model.language_model.layers.31.self_attn.attn", 31),
    ("encoder.stage.4.mixer", 4),           # fallback: last ".N." component
])
def test_layer_index(name: str, index: int) -> None:
    assert layer_index(name) == index


def test_layer_index_missing() -> None:
    with pytest.raises(LayoutError, match="attn_without_index"):
        layer_index("attn_without_index")


def test_shuffled_names_are_ordered_by_layer_index() -> None:
    tensors = {_name(i): _cache() for i in range(12)}
    names = list(tensors)
    random.Random(7).shuffle(names)
    assert names != sorted(names, key=layer_index)
    layout = KVLayout.from_kv_caches({n: tensors[n] for n in names}, NUM_BLOCKS)
    assert layout.layer_names == [_name(i) for i in range(12)]  # 10, 11 after 9, not after 1
    assert all(layout.tensors[i] is tensors[_name(i)] for i in range(12))
    assert layout.num_layers == 12
    assert layout.num_blocks == NUM_BLOCKS
    assert layout.block_bytes == HEADS * BLOCK_SIZE * 2 * HEAD * 4
    assert layout.device == torch.device("cpu")


def test_aliased_caches_are_sent_once() -> None:
    # KV sharing: layers 4..5 reuse the caches of layers 0..1 (same storage)
    base = [_cache() for _ in range(4)]
    caches = {_name(i): base[i] for i in range(4)}
    caches[_name(4)] = base[0]
    caches[_name(5)] = base[1].view(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD)  # alias via a view
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS)
    assert layout.num_layers == 4
    assert layout.layer_names == [_name(i) for i in range(4)]
    assert [t.data_ptr() for t in layout.tensors] == [t.data_ptr() for t in base]


def test_kernel_block_ratio_doubles_block_bytes() -> None:
    plain = KVLayout.from_kv_caches({_name(0): _cache(NUM_BLOCKS, 16)}, NUM_BLOCKS)
    # the backend splits each logical block of 32 tokens into 2 kernel blocks of 16
    split_cache = _cache(2 * NUM_BLOCKS, 16)
    split = KVLayout.from_kv_caches({_name(0): split_cache}, NUM_BLOCKS)
    assert split.block_bytes == 2 * plain.block_bytes
    view = split.host_block_views()[0]
    assert view.shape == (NUM_BLOCKS, split.block_bytes)
    # logical block b is kernel blocks 2b and 2b+1, back to back
    kernel_bytes = split_cache.view(torch.uint8).reshape(2 * NUM_BLOCKS, -1).numpy()
    for b in range(NUM_BLOCKS):
        assert bytes(view[b]) == bytes(kernel_bytes[2 * b]) + bytes(kernel_bytes[2 * b + 1])


def test_block_count_not_a_multiple_of_logical_blocks() -> None:
    with pytest.raises(LayoutError, match="not a multiple"):
        KVLayout.from_kv_caches({_name(0): _cache(15)}, NUM_BLOCKS)


def test_non_contiguous_cache_is_refused() -> None:
    t = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD).transpose(1, 2)  # NHD seen as HND
    assert not t.is_contiguous()
    with pytest.raises(LayoutError) as e:
        KVLayout.from_kv_caches({_name(0): _cache(), _name(1): t}, NUM_BLOCKS)
    assert _name(1) in str(e.value) and "not contiguous" in str(e.value)


def test_mixed_block_sizes_are_refused() -> None:
    with pytest.raises(LayoutError, match="different block sizes"):
        KVLayout.from_kv_caches({_name(0): _cache(), _name(1): _cache(block_size=32)},
                                NUM_BLOCKS)


def test_empty_and_multi_tensor_caches_are_refused() -> None:
    with pytest.raises(LayoutError, match="no KV cache"):
        KVLayout.from_kv_caches({}, NUM_BLOCKS)
    with pytest.raises(LayoutError, match="Mamba"):
        KVLayout.from_kv_caches({_name(0): [_cache(), _cache()]}, NUM_BLOCKS)  # type: ignore


def test_bfloat16_block_bytes() -> None:
    layout = KVLayout.from_kv_caches({_name(0): _cache(dtype=torch.bfloat16)}, NUM_BLOCKS)
    assert layout.block_bytes == HEADS * BLOCK_SIZE * 2 * HEAD * 2


def test_host_block_views_write_through() -> None:
    caches = {_name(i): torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD) for i in range(3)}
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS)
    views = layout.host_block_views()
    assert len(views) == 3
    assert all(v.shape == (NUM_BLOCKS, layout.block_bytes) and v.dtype.name == "uint8"
               for v in views)
    # write through a view -> exactly that layer's block changes in the tensor
    views[1][4, :] = 0xFF
    t = caches[_name(1)]
    assert torch.isnan(t[4]).all()  # 0xFFFFFFFF is a float32 NaN
    assert (t[:4] == 0).all() and (t[5:] == 0).all()
    assert (caches[_name(0)] == 0).all() and (caches[_name(2)] == 0).all()
    # and the other way round: tensor writes are visible in the view (no copy)
    caches[_name(2)][7].fill_(1.0)
    raw = bytes(views[2][7])
    assert raw == torch.ones(HEADS, BLOCK_SIZE, 2 * HEAD).numpy().tobytes()
    assert not views[2][6].any()


def _kv_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
        for i, spec in enumerate(specs)])


def test_attention_spec_page_size_matches_layout_block_bytes() -> None:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    assert attention_spec(_kv_config(spec)) is spec
    layout = KVLayout.from_kv_caches({_name(0): _cache()}, NUM_BLOCKS)
    assert spec.page_size_bytes == layout.block_bytes


def test_attention_spec_accepts_sliding_window_and_refuses_chunked_local() -> None:
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                            dtype=torch.float32, sliding_window=64)
    assert attention_spec(_kv_config(swa, full)) == swa  # the first attention group stands
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                                        head_size=HEAD, dtype=torch.float32,
                                        attention_chunk_size=64)
    with pytest.raises(LayoutError, match="ChunkedLocalAttentionSpec"):
        attention_spec(_kv_config(full, chunked))


def test_attention_spec_refuses_groups_with_different_page_sizes() -> None:
    a = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                          dtype=torch.float32)
    b = SlidingWindowSpec(block_size=2 * BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                          dtype=torch.float32, sliding_window=64)
    with pytest.raises(LayoutError, match="page sizes"):
        attention_spec(_kv_config(a, b))


def test_mamba_state_views_become_one_page_view_over_the_same_memory() -> None:
    """vLLM 0.26 registers a Mamba layer as [conv_state, ssm_state]: strided views into one
    raw page per block. The layout must address the whole page, at the same bytes."""
    page = 1024  # bytes per block, as the attention layers' pages
    raw = (torch.arange(NUM_BLOCKS * page) % 251).to(torch.uint8)
    conv = torch.as_strided(raw.view(torch.float32), (NUM_BLOCKS, 3, 8), (page // 4, 8, 1))
    ssm = torch.as_strided(raw.view(torch.float32)[24:], (NUM_BLOCKS, 4, 16),
                           (page // 4, 16, 1))
    attn = torch.zeros(NUM_BLOCKS, page // 4, dtype=torch.float32)
    layout = KVLayout.from_kv_caches({"model.layers.0.mixer": [conv, ssm], _name(1): attn},
                                     NUM_BLOCKS, {"model.layers.0.mixer": 1, _name(1): 0})
    assert layout.block_bytes == page and layout.layer_groups == [1, 0]
    view = layout.host_block_views()[0]
    assert view.shape == (NUM_BLOCKS, page)
    assert bytes(view[5]) == bytes(raw[5 * page:6 * page].numpy())
    view[5, :4] = 7  # writes land in the state tensors vLLM reads
    assert raw[5 * page:5 * page + 4].tolist() == [7, 7, 7, 7]
    assert conv[5, 0, 0].item() == torch.tensor([7, 7, 7, 7], dtype=torch.uint8).view(
        torch.float32).item()


def test_layers_of_different_groups_sharing_memory_are_all_kept() -> None:
    """Hybrid models overlay groups on shared raw tensors (each group owns different block
    ids of it): only same-group aliasing is KV sharing."""
    shared = _cache()
    layout = KVLayout.from_kv_caches(
        {_name(0): shared, _name(1): shared, _name(2): shared},
        NUM_BLOCKS, {_name(0): 0, _name(1): 1, _name(2): 1})
    assert layout.layer_names == [_name(0), _name(1)] and layout.layer_groups == [0, 1]


def test_padded_mamba_view_is_moved_as_whole_pages() -> None:
    """vLLM 0.32 registers a Mamba layer as [blocks, 1, 1, state_bytes] over pages padded to
    the attention page size (block stride = page): the layout addresses the whole page."""
    page, state = 1024, 300
    raw = torch.zeros(NUM_BLOCKS * page, dtype=torch.int8)
    mamba = torch.as_strided(raw, (NUM_BLOCKS, 1, 1, state), (page, state, state, 1))
    attn = torch.zeros(NUM_BLOCKS, page // 4, dtype=torch.float32)
    layout = KVLayout.from_kv_caches({"model.layers.0.mixer": mamba, _name(1): attn},
                                     NUM_BLOCKS, {"model.layers.0.mixer": 0, _name(1): 1})
    assert layout.block_bytes == page
    view = layout.host_block_views()[0]
    view[3, :state] = 5
    assert bool((mamba[3] == 5).all()) and int(raw[3 * page + state]) == 0 == int(mamba[4].sum())


LATENT = 576  # DeepSeek-V2/V3: kv_lora_rank 512 + rope 64


def _mla_config(layers: int = 2) -> KVCacheConfig:
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=LATENT,
                            dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([_name(i) for i in range(layers)], spec)])


def test_mla_latent_cache_is_moved_as_whole_blocks() -> None:
    """vLLM's MLA cache is ``[blocks, block_size, latent]`` (no head dimension): one block of
    one layer is one contiguous page, the size vLLM's spec gives."""
    config = _mla_config()
    spec = attention_spec(config)
    caches = {_name(i): torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT).to(torch.bfloat16)
              for i in range(2)}
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS)
    assert layout.block_bytes == spec.page_size_bytes == BLOCK_SIZE * LATENT * 2


def _vllm_config(total_kv_heads: int, **cache: object) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/models/tiny-deepseek/",
                                     get_total_num_kv_heads=lambda: total_kv_heads),
        cache_config=SimpleNamespace(**{"cache_dtype": "auto", **cache}))


def test_mla_has_one_replicated_head_whatever_vllm_reports() -> None:
    """vLLM reports the model's attention heads for MLA (here 4), but every TP rank holds the
    whole latent: CompatInfo says 1 head, so a P TP2 -> D TP1 pair is accepted and each D
    rank gets whole blocks from one P rank."""
    compat = compat_info(_vllm_config(total_kv_heads=4), _mla_config())
    assert (compat.num_kv_heads, compat.total_kv_heads) == (1, 1)
    assert compat.kv_groups == ["mla:2x16/bfloat16"] and compat.head_size == LATENT
    assert tp.peer_error(compat, 2, compat, 1, "decode") is None
    assert tp.peer_error(compat, 1, compat, 4, "decode") is None
    assert [r for p in range(2) for r in tp.routes(p, 2, 1, compat.total_kv_heads)] == \
        [tp.Route(0, 0, 0, 1, True)]
    assert tp.routes(0, 1, 2, compat.total_kv_heads) == \
        [tp.Route(0, 0, 0, 1, True), tp.Route(1, 0, 0, 1, True)]


def test_attention_models_keep_vllms_head_count() -> None:
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    compat = compat_info(_vllm_config(total_kv_heads=8), _kv_config(full))
    assert (compat.num_kv_heads, compat.total_kv_heads) == (HEADS, 8)


def _fp8_compat(cache_dtype: str, **cache: object):
    """What P or D serving a 2-layer model with ``--kv-cache-dtype cache_dtype`` reports (vLLM
    stores every fp8 format as bytes)."""
    fp8 = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                            dtype=torch.uint8)
    return compat_info(_vllm_config(8, cache_dtype=cache_dtype, **cache), _kv_config(fp8, fp8))


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16"])
def test_unquantized_caches_are_told_apart_by_their_dtype_alone(cache_dtype: str) -> None:
    assert kv_cache_format(_vllm_config(8, cache_dtype=cache_dtype)) == ""
    assert kv_cache_format(SimpleNamespace()) == ""  # a config without cache_config: vLLM's default


def test_fp8_caches_carry_their_format() -> None:
    """``fp8`` is vLLM's alias of ``fp8_e4m3``: the two agree. e4m3 and e5m2 are both stored
    as bytes of the same size, so only ``kv_cache_format`` tells them apart, and the
    mismatch message names it."""
    e4m3, alias, e5m2 = (_fp8_compat(d) for d in ("fp8_e4m3", "fp8", "fp8_e5m2"))
    assert e4m3.kv_cache_format == "fp8_e4m3" and e4m3.dtype == "uint8"
    assert e4m3.block_bytes == 2 * BLOCK_SIZE * HEADS * HEAD  # K and V, one byte each
    assert compatibility_error(e4m3, alias, "decode") is None
    err = compatibility_error(e4m3, e5m2, "decode")
    assert err is not None and "kv_cache_format: 'fp8_e4m3' != 'fp8_e5m2'" in err
    assert e4m3.differences(e5m2) == ["kv_cache_format: 'fp8_e4m3' != 'fp8_e5m2'"]


def test_fp8_with_different_tp_still_compares_the_format() -> None:
    e4m3, e5m2 = _fp8_compat("fp8_e4m3"), _fp8_compat("fp8_e5m2")
    assert tp.peer_error(e4m3, 2, e4m3, 1, "decode") is None
    err = tp.peer_error(e4m3, 2, e5m2, 1, "decode")
    assert err is not None and "kv_cache_format" in err


def test_fp8_skipped_layers_are_part_of_the_format() -> None:
    skip = _fp8_compat("fp8", kv_cache_dtype_skip_layers=["0", "sliding_window"])
    assert skip.kv_cache_format == "fp8_e4m3 skip=0,sliding_window"
    assert compatibility_error(skip, _fp8_compat("fp8"), "decode") is not None


@pytest.mark.parametrize("cache_dtype", ["fp8_per_token_head", "int8_per_token_head", "nvfp4",
                                         "turboquant_k8v4", "fp8_ds_mla", "fp8_inc"])
def test_other_quantized_caches_are_refused_naming_what_works(cache_dtype: str) -> None:
    with pytest.raises(LayoutError) as e:
        _fp8_compat(cache_dtype)
    assert f"--kv-cache-dtype {cache_dtype} is not supported" in str(e.value)
    assert "one of auto, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2" in str(e.value)


def test_fp8_with_scales_computed_at_run_time_is_refused() -> None:
    """vLLM 0.26's --calculate-kv-scales: each instance would compute its own scales."""
    with pytest.raises(LayoutError, match="drop --calculate-kv-scales"):
        _fp8_compat("fp8", calculate_kv_scales=True)
    assert _fp8_compat("fp8", calculate_kv_scales=False).kv_cache_format == "fp8_e4m3"
