"""What each kind of KV cache group sends, and when (hybrid models).

vLLM splits a hybrid model's layers into KV cache groups, each with its own block table: full
attention, sliding-window attention, Mamba-style state (Mamba/Mamba2, gated delta net, short
conv: vLLM's ``MambaSpec``). All groups share one page size, so a block of any layer is one
contiguous run of ``page_bytes`` and the transport moves them alike; what differs is *which*
blocks go and *when*:

* **full**: the blocks covering the tokens computed since the last send, every step (layer
  group by layer group while the forward runs), exactly as for dense models.
* **mla**: the same as full. Multi-head latent attention (DeepSeek-V2/V3) caches one latent
  vector per token instead of per-head K and V, but it is still a block of tokens that every
  later token attends to; a block is one contiguous page like any other.
* **sliding**: only at the end, and only the blocks still inside the window. P's scheduler frees
  out-of-window blocks during a long chunked prefill (they become the null block), so earlier
  chunks' blocks are not safely readable later; and D only ever attends to the last window.
* **mamba**: only at the end: one state block per layer (conv + SSM state), valid only once the
  prompt's last chunk has run. P computes the prompt minus its last token (the *backoff*, see
  ``prefill_backoff``) so that D, which recomputes that token, derives h(N) from h(N-1) itself.

Pure functions over block-id lists; no vLLM import, so the rules are unit-testable alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0
"""vLLM's placeholder block id (freed sliding-window blocks, Mamba placeholders). Never read
from or written to."""
FULL_KINDS = ("full", "mla")
"""Kinds whose every block stays needed: streamed as the prompt is computed."""
ATTENTION_KINDS = (*FULL_KINDS, "sliding")
"""Kinds whose block size counts tokens."""
SUPPORTED_KINDS = (*ATTENTION_KINDS, "mamba")


class BlockTableError(RuntimeError):
    """P's or D's block table cannot provide the blocks a send needs."""


@dataclass(frozen=True)
class KVGroupInfo:
    """What LayerKV needs to know about one KV cache group, read off vLLM's spec
    (``compat.kv_groups``)."""

    kind: str
    """"full", "mla", "sliding", "mamba" or the spec class name of a kind LayerKV cannot
    move."""
    layer_names: tuple[str, ...]
    block_size: int
    """Tokens per block (attention kinds); Mamba's value is not a token count."""
    page_bytes: int
    """Bytes of one block of one layer."""
    sliding_window: int = 0
    num_spec_blocks: int = 0
    """Mamba: trailing speculative-decoding scratch slots after the running state."""
    dtype: str = ""
    """How a block stores its values: the spec's torch dtype (``uint8`` for fp8 caches), or
    Mamba's state dtypes joined by ``+`` (conv, SSM). Empty if vLLM does not say."""

    def signature(self) -> str:
        """The group as P and D must both see it (part of ``CompatInfo``). The dtype is in it
        because equal page sizes do not mean equal contents: Mamba pads its state page up to
        the attention page, so an SSM state kept in float32 on one side and bfloat16 on the
        other (``--mamba-ssm-cache-dtype``) fills pages of the same size."""
        extra = f"/w{self.sliding_window}" if self.kind == "sliding" else ""
        dtype = f"/{self.dtype}" if self.dtype else ""
        return f"{self.kind}:{len(self.layer_names)}x{self.block_size}{extra}{dtype}"


def unsupported_kinds(groups: Sequence[KVGroupInfo]) -> list[str]:
    return sorted({g.kind for g in groups if g.kind not in SUPPORTED_KINDS})


def has_state(groups: Sequence[KVGroupInfo]) -> bool:
    return any(g.kind == "mamba" for g in groups)


def prefill_backoff(groups: Sequence[KVGroupInfo]) -> int:
    """Trailing prompt tokens P must not compute (D recomputes them). Mamba state is a running
    summary: if P sent h(N), D's recompute of the last token would fold it in twice. So P stops
    at N-1 and D loads N-1 tokens. Attention-only models need none (recomputing a token
    rewrites the same KV)."""
    return 1 if has_state(groups) else 0


def state_block(blocks: Sequence[int], num_spec_blocks: int) -> int:
    """The slot holding a request's running Mamba state: the last one before the speculative
    scratch slots (vLLM's ``clip_ssm_state_blocks``)."""
    if not blocks:
        return NULL_BLOCK
    scratch = min(num_spec_blocks, len(blocks) - 1)
    return blocks[len(blocks) - 1 - scratch]


def select_blocks(group: KVGroupInfo, src: Sequence[int], dst: Sequence[int], *,
                  sent_tokens: int, upto: int, start_token: int, num_tokens: int,
                  final: bool) -> tuple[list[int], list[int]]:
    """(P's block ids, D's block ids) of ``group`` to send now.

    ``sent_tokens``: D already holds the full-attention KV of ``[0, sent_tokens)``;
    ``upto``: tokens computed once this step ran; ``start_token``: D's own prefix-cache hit;
    ``num_tokens``: tokens P computes in all; ``final``: this send completes the prompt.
    Pairs whose D block is the null block are dropped (D does not need them)."""
    if group.kind in FULL_KINDS:
        first, last = sent_tokens // group.block_size, math.ceil(upto / group.block_size)
    elif group.kind == "sliding":
        if not final:
            return [], []
        lo = max(start_token, num_tokens - group.sliding_window, 0)
        first, last = lo // group.block_size, math.ceil(num_tokens / group.block_size)
    elif group.kind == "mamba":
        if not final:
            return [], []
        s, d = state_block(src, group.num_spec_blocks), state_block(dst, group.num_spec_blocks)
        if d == NULL_BLOCK:
            return [], []
        if s == NULL_BLOCK:
            raise BlockTableError("prefill has no Mamba state block for this request")
        return [s], [d]
    else:
        raise BlockTableError(f"KV cache group kind {group.kind!r} cannot be transferred")
    if first >= last:
        return [], []
    if last > len(src) or last > len(dst):
        raise BlockTableError(
            f"{group.kind} group needs blocks [{first}, {last}) but prefill has {len(src)} "
            f"and decode has {len(dst)}")
    pairs = [(s, d) for s, d in zip(src[first:last], dst[first:last]) if d != NULL_BLOCK]
    if any(s == NULL_BLOCK for s, _ in pairs):
        raise BlockTableError(
            f"{group.kind} group: prefill already freed a block in [{first}, {last}) "
            "that decode needs")
    return [s for s, _ in pairs], [d for _, d in pairs]
