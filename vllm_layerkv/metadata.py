"""Scheduler -> worker metadata for one engine step (pickled by vLLM to every worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_layerkv.compat import KVConnectorHandshakeMetadata, KVConnectorMetadata
from vllm_layerkv.tasks import Peer, RecvClose, RecvTask, SendTask


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
