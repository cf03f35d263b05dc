"""LayerKV wire format: every message that crosses a process boundary, as msgspec structs.

Two channels use it:

* the **control channel**, D scheduler -> P scheduler: ``Register`` (D's block ids and data
  endpoints for one transfer), ``Cancel``; answered by ``RegisterAck`` / ``Refused``.
* the **data channel**, P worker -> D worker: ``Hello`` (compatibility check) answered by
  ``HelloAck`` / ``Refused``; then ``BlockData`` headers each followed by raw KV bytes,
  ``TransferDone`` / ``TransferAbort``; D answers each finished transfer with ``TransferAck``.
  ``TransferNearlyDone`` (P's last layer group is being computed) lets an idle D start
  scheduling the request before the last bytes land (``early_release``).
  When P can write into D's memory itself (``Hello.direct`` lists how: CUDA IPC on one host,
  NIXL, Mooncake), ``HelloAck.exports`` carries what P needs for each (``KVExport`` IPC
  handles, ``NixlExport`` agent metadata, ``MooncakeExport`` session: the planes and their
  exports are registered in ``planes.py``) and P moves blocks itself: each write is bracketed
  by ``DirectWrite`` (P asks) / ``WriteGrant`` (D allows) / ``DirectWritten`` (P is done), so
  D's bookkeeping guards its blocks exactly as it does for bytes it receives.

Framing: a 4-byte big-endian length, then the msgpack-encoded message (a tagged union, so the
receiver decodes without knowing the type). ``BlockData`` is followed by ``nbytes`` of payload.

``PROTOCOL_VERSION`` changes whenever a message changes shape or meaning; ``CompatInfo`` carries
it together with everything that must match for raw KV bytes to mean the same on both sides.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Union

import msgspec

from vllm_layerkv.wire.planes import PlaneExports

PROTOCOL_VERSION = 8
FRAME_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(RuntimeError):
    """A peer sent something that does not follow this protocol."""


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What must be equal on P and D for P's KV bytes to be valid in D's cache."""

    protocol_version: int = PROTOCOL_VERSION
    vllm_version: str
    model: str
    dtype: str
    kv_layout: str
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    block_bytes: int
    total_kv_heads: int = 0
    """The model's KV heads over all TP ranks (``num_kv_heads`` and ``block_bytes`` are one
    rank's): what lets P and D with different TP map heads (tp.py)."""
    kv_groups: list[str] = []
    """Each KV cache group's kind, layer count, block size (and window) and storage dtype:
    hybrid models must be split into the same groups on both sides for block ids to mean the
    same, and a block must hold the same kind of numbers."""
    kv_cache_format: str = ""
    """The fp8 format of a quantized KV cache (``fp8_e4m3``, ``fp8_e5m2``), empty when the
    cache is unquantized; ``dtype`` is then the element type, while both fp8 formats are
    stored as bytes (``layout.kv_cache_format``)."""

    def hash(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def differences(self, other: CompatInfo) -> list[str]:
        """Names of the fields that differ, each as ``name: mine != theirs``."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {a!r} != {b!r}")
        return out


def compatibility_error(local: CompatInfo, remote: CompatInfo, remote_name: str) -> str | None:
    """None if compatible, else an error message naming every differing field."""
    if local.hash() == remote.hash():
        return None
    diffs = local.differences(remote)
    return (
        f"LayerKV compatibility check failed against {remote_name}: "
        + "; ".join(diffs)
        + ". Prefill and decode must serve the same model with the same dtype, block size and "
        "vLLM/LayerKV versions."
    )


# ---------------------------------------------------------------- control channel (schedulers)


class Register(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: D has allocated blocks for ``transfer_id``; push the KV there."""

    transfer_id: str
    engine_id: str
    compat: CompatInfo
    tp_size: int
    data_endpoints: list[str]
    """host:port of each D TP rank's data listener, indexed by rank."""
    block_ids: list[list[int]]
    """D's block ids, one list per KV cache group (vLLM's group order), each in token order;
    the null block (0) marks slots D does not hold (freed sliding-window blocks)."""
    start_token: int
    """D already holds tokens [0, start_token) (local prefix-cache hit); send from here."""
    num_tokens: int
    """Tokens D needs KV for (prompt length as D sees it)."""
    wants_first_token: bool = False
    """D continues from the token P samples after the prompt: P sends it as ``FirstToken``
    on this connection when its request finishes (``first_token_from_prefill``)."""


class Cancel(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: forget ``transfer_id`` (D aborted or timed out)."""

    transfer_id: str
    reason: str


class FirstToken(msgspec.Struct, tag=True, kw_only=True):
    """P -> D, unasked, on the connection that registered ``transfer_id``: the token P's
    request sampled after the prompt. D appends it to its request and decodes from there."""

    transfer_id: str
    token_id: int


class RegisterAck(msgspec.Struct, tag=True, kw_only=True):
    transfer_id: str
    tp_size: int
    """P's TP size: each D rank expects one TransferDone per mapped P rank."""


class Refused(msgspec.Struct, tag=True, kw_only=True):
    """Answer to Register or Hello that cannot be honoured. ``reason`` is shown to users."""

    transfer_id: str
    reason: str


# ---------------------------------------------------------------- data channel (workers)


class Hello(msgspec.Struct, tag=True, kw_only=True):
    """P worker -> D worker, first message on a data connection."""

    compat: CompatInfo
    engine_id: str
    tp_rank: int
    tp_size: int
    host_id: str = ""
    """P's host identity (boot id + hostname); D offers CUDA IPC handles only to its own
    host."""
    direct: list[str] = []
    """Direct-write planes P can drive, in P's order of preference ("cuda_ipc", "nixl",
    "mooncake"); empty: P only sends bytes."""


class HelloAck(msgspec.Struct, tag=True, kw_only=True):
    tp_rank: int
    exports: list[PlaneExports] = []
    """How P may write into D's KV itself, for the planes P listed that D offers to it; empty:
    send bytes. Each is its plane's export struct (``planes.py``)."""


class BlockData(msgspec.Struct, tag=True, kw_only=True):
    """Header of one bulk write; ``nbytes`` of payload follow. Payload order: for each layer in
    ``layers``, for each block in ``dst_blocks``, the block's bytes for that layer (with
    ``num_heads``: only that head slice of the block, ``block_bytes`` per block)."""

    transfer_id: str
    layers: list[int]
    dst_blocks: list[int]
    block_bytes: int
    nbytes: int
    first_head: int = 0
    num_heads: int = 0
    """0: whole blocks. Else P and D split the KV heads differently (tp.py): the payload holds
    heads [first_head, first_head + num_heads) of D's blocks, counted in D's block."""


class DirectWrite(msgspec.Struct, tag=True, kw_only=True):
    """P -> D: P wants to copy ``layers`` x ``dst_blocks`` into D's mapped KV now. Answered by
    ``WriteGrant``; a grant holds the transfer open on D until ``DirectWritten``."""

    transfer_id: str
    seq: int
    layers: list[int]
    dst_blocks: list[int]
    first_head: int = 0
    num_heads: int = 0
    """Non-zero: the write goes through D's receive ring (a head slice with mismatched TP,
    or whole blocks with ``host_bounce``). P writes ``nbytes`` of gathered slices into the
    ring slot D grants, and D scatters them into ``dst_blocks`` on ``DirectWritten``."""
    nbytes: int = 0
    plane: str = ""
    """For a ring write: the plane P writes with (D may have a ring per plane)."""


class WriteGrant(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: ok=False means the transfer is closed on D (or unknown): skip the copy."""

    seq: int
    ok: bool
    slot: int = -1
    """For a head-slice write: the receive-ring slot P may write into (D keeps it until it
    has scattered P's ``DirectWritten`` bytes: the ring's back-pressure)."""


class DirectWritten(msgspec.Struct, tag=True, kw_only=True):
    """P -> D: the granted copy ``seq`` is complete on the device (nbytes=0: it failed)."""

    transfer_id: str
    seq: int
    nbytes: int


class TransferDone(msgspec.Struct, tag=True, kw_only=True):
    """P rank ``tp_rank`` has sent everything for ``transfer_id``."""

    transfer_id: str
    tp_rank: int
    frames: int
    nbytes: int


class TransferNearlyDone(msgspec.Struct, tag=True, kw_only=True):
    """P rank ``tp_rank`` has sent all of ``transfer_id`` but its final step's last layer group,
    and expects that group's TransferDone in about ``eta_s`` seconds. A hint: D may report the
    request to vLLM early, but still waits for TransferDone before the request's forward."""

    transfer_id: str
    tp_rank: int
    eta_s: float


class TransferAbort(msgspec.Struct, tag=True, kw_only=True):
    """P gives up on ``transfer_id``: D must fail the request."""

    transfer_id: str
    reason: str


class TransferAck(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: D is done with ``transfer_id`` (ok=False: D dropped it, e.g. aborted)."""

    transfer_id: str
    ok: bool
    reason: str = ""


Message = Union[
    Register, Cancel, RegisterAck, Refused, FirstToken, Hello, HelloAck, BlockData, DirectWrite,
    WriteGrant, DirectWritten, TransferNearlyDone, TransferDone, TransferAbort, TransferAck,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Length-prefixed frame for ``msg``."""
    body = _encoder.encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


def decode(body: bytes | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable LayerKV message: {e}") from None
