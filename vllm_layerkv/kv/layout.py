"""KV tensor geometry: which bytes hold layer L, logical block b, on this worker.

LayerKV asks vLLM for the "HND" layout (an accepted alias of LBHNC in 0.26, 0.32 and 0.33).
Every attention layer's tensor is then ``[num_blocks, kv_heads, block_size, content]`` with the
block dimension outermost, so one logical block of one layer is one contiguous run of bytes,
whatever the backend packs inside it (FlashAttention: per-token [K|V] rows; CPU attention:
per-head [K rows | V rows]). LayerKV copies whole blocks and never interprets their interior,
which keeps it backend-agnostic.

Scheduler block ids are *logical* (cache_config.block_size); a backend may split them into
``r`` smaller kernel blocks. Kernel blocks of one logical block are adjacent, so a logical block
is simply ``r`` kernel blocks' worth of bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_layerkv.kv.groups import KVGroupInfo
    from vllm_layerkv.wire.protocol import CompatInfo

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|decoder_layers)\.(\d+)(?:\.|$)")


class LayoutError(RuntimeError):
    """The KV cache cannot be addressed as whole contiguous blocks."""


def layer_index(name: str) -> int:
    """Model layer index of an attention layer name such as ``model.layers.7.self_attn.attn``."""
    found = _LAYER_INDEX.findall(name)
    if not found:
        nums = re.findall(r"\.(\d+)\.", "." + name + ".")
        if not nums:
            raise LayoutError(f"cannot find a layer index in attention layer name {name!r}")
        return int(nums[-1])
    return int(found[-1])


def _raw_pages(name: str, first: torch.Tensor, num_blocks: int, page: int) -> torch.Tensor:
    """A ``[num_blocks, page]`` uint8 view over the memory ``first`` starts at."""
    start = first.storage_offset() * first.element_size()
    if start + num_blocks * page > first.untyped_storage().nbytes():
        raise LayoutError(f"layer {name!r}: {num_blocks} pages of {page} B overrun its storage")
    view = torch.empty(0, dtype=torch.uint8, device=first.device)
    view.set_(first.untyped_storage(), start, (num_blocks, page), (page, 1))
    return view


def _page_view(name: str, cache: object, num_blocks: int) -> torch.Tensor:
    """One layer's KV cache as a tensor whose first dimension is the block and whose blocks
    are whole pages.

    Mamba-style state fills only part of its page (vLLM pads it to the attention page size so
    that all groups share one block pool), so vLLM's view of it skips the padding: 0.32+ hands
    over ``[blocks, 1, 1, state_bytes]`` with a page-sized block stride; 0.26 hands over
    ``[conv_state, ssm_state]``, two strided views into the same page (conv state first).
    LayerKV moves whole pages, padding included, so it rebuilds a page view over the same
    memory. Attention caches (contiguous in HND) are returned as they are."""
    if not isinstance(cache, (list, tuple)):
        t = cache
        assert isinstance(t, torch.Tensor)
        es = t.element_size()
        if (not t.is_contiguous() and t.dim() >= 2 and t.shape[0] == num_blocks
                and t[0].is_contiguous() and t.stride(0) * es >= t[0].numel() * es):
            return _raw_pages(name, t, num_blocks, t.stride(0) * es)
        return t  # a non-contiguous cache of another shape is refused by the caller
    first = cache[0]
    if not isinstance(first, torch.Tensor) or first.shape[0] != num_blocks:
        raise LayoutError(f"layer {name!r}: unexpected multi-tensor KV cache "
                          f"{[tuple(t.shape) for t in cache]}")
    page = first.stride(0) * first.element_size()
    ptr0 = first.data_ptr()
    for t in cache[1:]:
        off = t.data_ptr() - ptr0
        if (t.shape[0] != num_blocks or t.stride(0) * t.element_size() != page
                or not 0 <= off < page):
            raise LayoutError(f"layer {name!r}: Mamba state tensors do not share one page per "
                              "block")
    return _raw_pages(name, first, num_blocks, page)


@dataclass
class KVLayout:
    """The registered KV caches of one worker, in forward order, addressable by logical block."""

    layer_names: list[str]
    tensors: list[torch.Tensor]
    num_blocks: int
    block_bytes: int
    """Bytes of one logical block of one layer (the same for every KV cache group)."""
    device: torch.device
    layer_groups: list[int] = field(default_factory=list)
    """KV cache group of each layer (index into ``kv_cache_config.kv_cache_groups``)."""

    @classmethod
    def from_kv_caches(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                       group_of: dict[str, int] | None = None) -> KVLayout:
        """``group_of``: KV cache group of each layer name (all in group 0 if None)."""
        if not kv_caches:
            raise LayoutError("vLLM registered no KV cache tensors")
        group_of = group_of or {}
        seen: set[tuple[int, int]] = set()
        entries: list[tuple[int, str, torch.Tensor, int]] = []
        for name, cache in kv_caches.items():
            tensor = _page_view(name, cache, num_blocks)
            group = group_of.get(name, 0)
            # KV-sharing layers alias their target's cache: send it once. Only within a group:
            # in a hybrid model, layers of different groups share raw memory on purpose (each
            # group owns different block ids of it).
            key = (tensor.data_ptr(), group)
            if key in seen:
                continue
            seen.add(key)
            entries.append((layer_index(name), name, tensor, group))
        entries.sort(key=lambda e: e[0])
        tensors = [e[2] for e in entries]
        first = tensors[0]
        block_bytes = None
        for (_, name, t, _) in entries:
            if not t.is_contiguous():
                raise LayoutError(
                    f"KV cache of {name!r} is not contiguous (shape {tuple(t.shape)}, stride "
                    f"{t.stride()}): LayerKV needs the block dimension outermost; is the KV "
                    "layout forced to something other than HND (VLLM_KV_CACHE_LAYOUT)?"
                )
            if t.shape[0] % num_blocks:
                raise LayoutError(
                    f"KV cache of {name!r} has {t.shape[0]} blocks, not a multiple of the "
                    f"scheduler's {num_blocks} logical blocks"
                )
            nbytes = t.numel() * t.element_size() // num_blocks
            if block_bytes is None:
                block_bytes = nbytes
            elif nbytes != block_bytes:
                raise LayoutError(
                    f"KV cache layers have different block sizes ({nbytes} vs {block_bytes} "
                    "bytes); models with mixed page sizes are not supported yet"
                )
        assert block_bytes is not None
        return cls(
            layer_names=[e[1] for e in entries],
            tensors=tensors,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            device=first.device,
            layer_groups=[e[3] for e in entries],
        )

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    def block_tensors(self) -> list[torch.Tensor]:
        """Per layer, a ``[num_blocks, block_bytes]`` uint8 view of the KV, on its device."""
        return [t.view(torch.uint8).view(self.num_blocks, self.block_bytes)
                for t in self.tensors]

    def host_block_views(self) -> list[np.ndarray]:
        """Per layer, a ``[num_blocks, block_bytes]`` uint8 numpy view over host KV memory.

        The TCP transport reads (P) and writes (D) KV through these views with no copy."""
        if self.device.type != "cpu":
            raise LayoutError(
                f"KV cache is on {self.device}; the host-memory path needs CPU tensors"
            )
        return [t.numpy() for t in self.block_tensors()]


def attention_spec(kv_cache_config: KVCacheConfig) -> KVCacheSpec:
    """The KV spec standing for the model's geometry in ``CompatInfo`` (the first attention
    group's, else the first group's); refuses group kinds this version cannot move."""
    from vllm_layerkv.compat import group_spec, kv_groups
    from vllm_layerkv.kv.groups import ATTENTION_KINDS, unsupported_kinds

    groups = kv_groups(kv_cache_config)
    unsupported = unsupported_kinds(groups)
    if unsupported:
        raise LayoutError(
            f"KV cache groups of kind {unsupported} (e.g. chunked-local or sink attention) "
            "are not supported by this LayerKV version; supported: full attention, MLA, "
            "sliding window, Mamba-style state"
        )
    pages = {g.page_bytes for g in groups}
    if len(pages) > 1:
        raise LayoutError(f"KV cache groups have different page sizes {sorted(pages)}; "
                          "LayerKV needs vLLM's unified page size")
    index = next((i for i, g in enumerate(groups) if g.kind in ATTENTION_KINDS), 0)
    return group_spec(kv_cache_config.kv_cache_groups[index])


FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
"""The quantized ``--kv-cache-dtype`` values LayerKV moves, by the format they name (``fp8`` is
vLLM's alias of ``fp8_e4m3``). Their scales are one K and one V scale per layer, which the
model holds (from the checkpoint, else 1.0), not the cache: P and D serving the same
checkpoint read each other's bytes alike."""
UNQUANTIZED_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""Values whose storage dtype (``CompatInfo.dtype``) says everything about a block."""


def kv_cache_format(vllm_config: VllmConfig) -> str:
    """What a peer must match about ``--kv-cache-dtype`` beyond the storage dtype: ``""`` for
    an unquantized cache, else the fp8 format (plus ``--kv-cache-dtype-skip-layers``). Both fp8
    formats are stored as bytes, so the storage dtype alone would let an e4m3 P feed an e5m2 D.

    Raises ``LayoutError`` for the other quantized formats (per-token-head, NVFP4,
    TurboQuant, DeepSeek's ``fp8_ds_mla``): their scales are per token, and where vLLM keeps
    them has not been checked against LayerKV's whole-page copies, so moving their pages could
    leave D reading values under scales that never arrived."""
    from vllm_layerkv.compat import computes_kv_scales, kv_cache_dtype, kv_cache_dtype_skip_layers

    name = kv_cache_dtype(vllm_config)
    if name in UNQUANTIZED_CACHE_DTYPES:
        return ""
    if name not in FP8_CACHE_DTYPES:
        raise LayoutError(
            f"--kv-cache-dtype {name} is not supported by this LayerKV version (its per-token "
            "scales are not known to travel with the cache pages); serve prefill and decode "
            f"with one of {', '.join([*UNQUANTIZED_CACHE_DTYPES, *FP8_CACHE_DTYPES])}")
    if computes_kv_scales(vllm_config):
        raise LayoutError(
            "--calculate-kv-scales with an fp8 KV cache: prefill and decode would each compute "
            "their own scales from their own first batch, so decode would read prefill's fp8 "
            "values with other scales; drop --calculate-kv-scales (the scales then come from "
            "the checkpoint, else 1.0)")
    skipped = kv_cache_dtype_skip_layers(vllm_config)
    return FP8_CACHE_DTYPES[name] + (f" skip={','.join(map(str, skipped))}" if skipped else "")


def _total_kv_heads(vllm_config: VllmConfig, groups: list[KVGroupInfo]) -> int:
    """The model's KV heads before the TP split (0 if vLLM cannot say).

    MLA caches one latent vector per token, which every TP rank holds whole: one "head" that
    TP replicates (``tp.py`` then sends each D rank one P rank's copy). vLLM reports the
    model's attention heads instead (``num_key_value_heads`` of the config), which would have
    ``tp.py`` split the latent as if it were per-head K and V."""
    if any(g.kind == "mla" for g in groups):
        return 1
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - attention-free models, test doubles
        return 0


def compat_info(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CompatInfo:
    """What a peer must match, derived identically in the scheduler and in every worker."""
    import os

    from vllm_layerkv.compat import VLLM_VERSION, kv_groups, spec_geometry
    from vllm_layerkv.wire.protocol import CompatInfo

    spec = spec_geometry(attention_spec(kv_cache_config))
    groups = kv_groups(kv_cache_config)
    model = str(vllm_config.model_config.model).rstrip("/")
    num_layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    return CompatInfo(
        vllm_version=VLLM_VERSION,
        model=os.path.basename(model),
        dtype=spec.dtype,
        kv_layout="HND",
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        total_kv_heads=_total_kv_heads(vllm_config, groups),
        head_size=spec.head_size,
        num_layers=num_layers,
        block_bytes=spec.page_bytes,
        kv_groups=[g.signature() for g in groups],
        kv_cache_format=kv_cache_format(vllm_config),
    )
