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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_layerkv.protocol import CompatInfo

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


@dataclass
class KVLayout:
    """The registered KV caches of one worker, in forward order, addressable by logical block."""

    layer_names: list[str]
    tensors: list[torch.Tensor]
    num_blocks: int
    block_bytes: int
    """Bytes of one logical block of one layer."""
    device: torch.device

    @classmethod
    def from_kv_caches(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
        if not kv_caches:
            raise LayoutError("vLLM registered no KV cache tensors")
        by_ptr: dict[int, str] = {}
        entries: list[tuple[int, str, torch.Tensor]] = []
        for name, tensor in kv_caches.items():
            if isinstance(tensor, (list, tuple)):
                raise LayoutError(
                    f"layer {name!r} has a multi-tensor (Mamba) KV cache; hybrid models are not "
                    "supported by this LayerKV version"
                )
            ptr = tensor.data_ptr()
            if ptr in by_ptr:  # KV-sharing layers alias their target's cache: send it once
                continue
            by_ptr[ptr] = name
            entries.append((layer_index(name), name, tensor))
        entries.sort(key=lambda e: e[0])
        tensors = [e[2] for e in entries]
        first = tensors[0]
        block_bytes = None
        for (_, name, t) in entries:
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
                    f"attention layers have different block sizes ({nbytes} vs {block_bytes} "
                    "bytes); models with mixed attention geometry are not supported yet"
                )
        assert block_bytes is not None
        return cls(
            layer_names=[e[1] for e in entries],
            tensors=tensors,
            num_blocks=num_blocks,
            block_bytes=block_bytes,
            device=first.device,
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


def attention_spec(kv_cache_config: "object"):
    """The KV spec of the attention groups; refuses group kinds this version cannot move."""
    from vllm_layerkv.compat import kv_cache_group_kinds

    kinds = kv_cache_group_kinds(kv_cache_config)
    unsupported = sorted({k for k in kinds if k != "full"})
    if unsupported:
        raise LayoutError(
            f"KV cache groups of kind {unsupported} (hybrid / sliding-window / MLA models) are "
            "not supported by this LayerKV version; serve a model with full attention only"
        )
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec  # type: ignore[attr-defined]


def compat_info(vllm_config: "object", kv_cache_config: "object") -> "CompatInfo":
    """What a peer must match, derived identically in the scheduler and in every worker."""
    import os

    from vllm_layerkv.compat import VLLM_VERSION
    from vllm_layerkv.protocol import CompatInfo

    spec = attention_spec(kv_cache_config)
    model = str(vllm_config.model_config.model).rstrip("/")  # type: ignore[attr-defined]
    num_layers = sum(len(g.layer_names)
                     for g in kv_cache_config.kv_cache_groups)  # type: ignore[attr-defined]
    return CompatInfo(
        vllm_version=VLLM_VERSION,
        model=os.path.basename(model),
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout="HND",
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        num_layers=num_layers,
        block_bytes=spec.page_size_bytes,
    )
