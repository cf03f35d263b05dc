"""Scheduler -> worker metadata for one engine step (pickled by vLLM to every worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_layerkv.compat import KVConnectorHandshakeMetadata, KVConnectorMetadata


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


@dataclass
class LayerKVMetadata(KVConnectorMetadata):
    sends: list[SendTask] = field(default_factory=list)
    """Streamed with this step's forward (layer hooks)."""
    flushes: list[SendTask] = field(default_factory=list)
    """KV computed in earlier steps (late registration): sent right away."""
    releases: list[tuple[str, str]] = field(default_factory=list)
    """(req_id, transfer_id): the scheduler holds this finished request's blocks; report it in
    finished_sending once every send for the transfer is acknowledged or given up."""
    aborts: list[tuple[str, str, Peer]] = field(default_factory=list)
    """(transfer_id, reason, peer): stop sending, tell D (the peer) to fail the request."""
    recvs: list[RecvTask] = field(default_factory=list)
    recv_closes: list[RecvClose] = field(default_factory=list)
    empty_step: bool = False
    """No tokens scheduled: workers may wait briefly for completions instead of spinning."""
    first_tokens: list[str] = field(default_factory=list)
    """D: transfer ids whose first token from P the scheduler now has."""
    first_steps: list[str] = field(default_factory=list)
    """D: received requests whose first token this step computes (a request reported early
    waits for its KV before the forward; tracing marks the step)."""


@dataclass
class LayerKVHandshake(KVConnectorHandshakeMetadata):
    """Worker -> its own scheduler at start-up (vLLM's handshake-metadata channel)."""

    data_endpoint: str
    """host:port of this D worker's data listener ("" on a prefill-only worker)."""
