"""What a refusal may tell the peer about a mismatch: the names of the settings that differ,
never their values.

P's registration server and D's data listener compare the peer's ``CompatInfo`` (and TP size)
with their own. The full comparison, values included, goes to the refusing side's log; the
peer is told which fields to look at. Values would tell a peer what to claim to be let in,
and a model name or a vLLM version is not the peer's business.
"""

from __future__ import annotations

import msgspec

from vllm_layerkv.wire.protocol import CompatInfo


def differing_fields(local: CompatInfo, local_tp: int, remote: CompatInfo,
                     remote_tp: int) -> list[str]:
    """Names of what differs: ``tensor_parallel_size`` first when the TP sizes do, then every
    ``CompatInfo`` field that differs (per KV head when the TP sizes differ, since a rank's
    head count and block bytes then differ legitimately)."""
    names = []
    a, b = local, remote
    if local_tp != remote_tp:
        names.append("tensor_parallel_size")
        a, b = _per_head(local), _per_head(remote)
    names += [n for n in CompatInfo.__struct_fields__ if getattr(a, n) != getattr(b, n)]
    return names


def mismatch_refusal(local: CompatInfo, local_tp: int, remote: CompatInfo, remote_tp: int,
                     side: str) -> str:
    """The reason sent to a refused peer; ``side`` names the refusing side ("prefill" or
    "decode"), whose log has the values."""
    names = differing_fields(local, local_tp, remote, remote_tp) or ["compatibility info"]
    verb = "differs" if len(names) == 1 else "differ"
    return (f"LayerKV compatibility check failed: {', '.join(names)} {verb} between prefill "
            f"and decode (the {side} instance's log has the values). Prefill and decode must "
            "serve the same model with the same dtype, block size and vLLM/LayerKV versions, "
            "with TP sizes that split the KV heads evenly.")


def _per_head(c: CompatInfo) -> CompatInfo:
    return msgspec.structs.replace(c, num_kv_heads=0,
                                   block_bytes=c.block_bytes // max(1, c.num_kv_heads))
