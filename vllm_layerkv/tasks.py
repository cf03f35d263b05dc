"""Work orders the scheduler hands the worker's threads through the step metadata: which blocks
P sends to which decode instance, which blocks D expects. Plain dataclasses without vLLM, so the
sender, the receiver and the processes that drive them outside vLLM (the link probe, the
multi-process transfer tests) load without importing it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Peer:
    """A decode instance that registered for a transfer."""

    engine_id: str
    tp_size: int
    data_endpoints: list[str]


@dataclass
class SendTask:
    """P: push KV of ``src_blocks`` (P's ids) into ``dst_blocks`` (D's ids), per KV cache
    group: layers of group g send ``src_blocks[g]`` into ``dst_blocks[g]`` (an empty list: that
    group sends nothing in this task; see kv/groups.py for which blocks each kind sends)."""

    req_id: str
    transfer_id: str
    peer: Peer
    src_blocks: list[list[int]]
    dst_blocks: list[list[int]]
    final: bool
    """No more sends follow for this transfer: close it with TransferDone."""
    new_tokens: int
    """Tokens this task carries that D did not have (drives the group-size rule)."""
    streamed: bool = True
    """Send layer group by layer group during this step's forward (False: after the step)."""


@dataclass
class RecvTask:
    """D: KV for ``req_id`` will arrive under ``transfer_id`` into ``block_ids`` (D's blocks of
    every KV cache group, without the null block: the only blocks P may write)."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    wants_first_token: bool = False
    """Report the request only once D's scheduler also has P's first token
    (``LayerKVMetadata.first_tokens``), and never early."""


@dataclass
class RecvClose:
    """D: stop accepting KV for a transfer and report the request (as failed if ``failed``)."""

    req_id: str
    transfer_id: str
    failed: bool
    reason: str
