"""One fused Triton kernel for staging's gather and scatter on the GPU.

``staging.gather`` / ``staging.scatter`` move the head slice of every (layer, block) of a layer
group between the KV cache and a contiguous staging buffer. In torch that is one
``index_select`` / ``index_copy_`` per layer; this kernel does the whole group in one launch:
program (i, c) copies chunk c of slice i = (layer, block), reading the layer's base address
from a small pointer table (the layers' caches are separate tensors). Words are as wide as the
addresses and sizes allow (8 bytes for real models), so the copy runs at memory bandwidth.

Used when Triton is importable and the KV is on CUDA; ``staging`` falls back to torch
otherwise (CPU, no Triton), and for good if a launch ever fails (logged once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.kv.bounds import check_indices, check_span

logger = init_logger(__name__)

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - missing or broken (CPU images): torch's copies serve
    triton = None

_CHUNK = 1024
"""Words per program: 8 KiB with 8-byte words."""
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_broken = False
"""Set after a failed launch: every later call uses torch."""

if triton is not None:

    @triton.jit
    def _copy_slices(bases, blocks, buf, num_blocks, block_words, offset_words, slice_words,
                     TO_BUF: tl.constexpr, CHUNK: tl.constexpr):
        i = tl.program_id(0)  # slice index: layer * num_blocks + block
        layer = i // num_blocks
        block = tl.load(blocks + i % num_blocks).to(tl.int64)
        cache = tl.load(bases + layer).to(tl.pointer_type(buf.dtype.element_ty))
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < slice_words
        kv = cache + block * block_words + offset_words + offs
        staged = buf + i.to(tl.int64) * slice_words + offs
        if TO_BUF:
            tl.store(staged, tl.load(kv, mask=mask), mask=mask)
        else:
            tl.store(kv, tl.load(staged, mask=mask), mask=mask)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and not _broken


def _word(*sizes: int) -> int:
    """The widest word that divides every size and address."""
    for w in (8, 4, 2, 1):
        if all(s % w == 0 for s in sizes):
            return w
    return 1


def copy_slices(tensors: Sequence[torch.Tensor], layers: Sequence[int], idx: torch.Tensor,
                offset: int, nbytes: int, buf: torch.Tensor, to_buf: bool) -> bool:
    """Gather (``to_buf``) or scatter bytes ``[offset, offset + nbytes)`` of blocks ``idx`` of
    each of ``layers`` to or from ``buf`` in (layer, block) order. False if it did not run (the
    caller then copies with torch). The kernel computes addresses unchecked, so the byte range,
    the layers and ``buf``'s size are checked here (BoundsError); the block ids in ``idx`` are
    on the device, and the caller has checked them (``staging.gather`` / ``scatter``)."""
    global _broken
    check_indices("layers", layers, len(tensors))
    check_span("head slice", offset, nbytes, tensors[0].shape[1])
    check_span("staging buffer", 0, len(layers) * idx.numel() * nbytes, buf.numel())
    if not available(buf.device) or not layers or idx.numel() == 0:
        return False
    caches = [tensors[layer] for layer in layers]
    block_bytes = caches[0].shape[1]
    word = _word(block_bytes, offset, nbytes, buf.data_ptr(),
                 *(t.data_ptr() for t in caches))
    bases = torch.tensor([t.data_ptr() for t in caches], dtype=torch.int64, device=buf.device)
    words = buf[:len(caches) * idx.numel() * nbytes].view(_WORDS[word])
    slice_words = nbytes // word
    grid = (len(caches) * idx.numel(), triton.cdiv(slice_words, _CHUNK))
    try:
        _copy_slices[grid](bases, idx, words, idx.numel(), block_bytes // word, offset // word,
                           slice_words, TO_BUF=to_buf, CHUNK=_CHUNK)
    except Exception as e:  # noqa: BLE001 - any compile/launch failure: torch copies instead
        _broken = True
        logger.warning("LayerKV: the fused staging copy failed (%s); using torch copies", e)
        return False
    return True


WARM_UP_BLOCKS = (1, 3, 16)
"""Block counts ``warm_up`` launches with: Triton specialises an integer argument on being 1
or a multiple of 16, so these three reach every variant a request's block count can select."""


def warm_up(block_bytes: int, device: torch.device, to_buf: bool) -> int:
    """Compile the kernel for whole blocks of ``block_bytes`` now, one direction (``to_buf``:
    gather), by copies between scratch tensors (never the KV itself). Triton compiles on the
    first launch of each variant: 0.1-0.5 s that otherwise falls on the first request's
    transfer. Returns the launches made (0 where the kernel is not used)."""
    if not available(device):
        return 0
    n = max(WARM_UP_BLOCKS)
    cache = torch.zeros(n, block_bytes, dtype=torch.uint8, device=device)
    buf = torch.zeros(n * block_bytes, dtype=torch.uint8, device=device)
    launched = 0
    for count in WARM_UP_BLOCKS:
        idx = torch.arange(count, dtype=torch.long, device=device)
        launched += copy_slices([cache], [0], idx, 0, block_bytes, buf, to_buf)
    torch.cuda.synchronize(device)
    return launched
