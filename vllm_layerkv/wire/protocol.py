"""LayerKV wire format: every message that crosses a process boundary, as msgspec structs.

Two channels use it:

* the **control channel**, D scheduler -> P scheduler: ``Register`` (D's block ids and data
  endpoints for one transfer), ``Cancel``; answered by ``RegisterAck`` / ``Refused``.
* the **data channel**, P worker -> D worker: ``Hello`` (compatibility check) answered by
  ``HelloAck`` / ``Refused``; then ``BlockData`` headers each followed by raw KV bytes,
  ``TransferDone`` / ``TransferAbort``; D answers each finished transfer with ``TransferAck``.
  A payload may be dealt over further TCP streams of the connection, each opened with
  ``StreamJoin`` / ``StreamJoinAck`` (``transport/tcp_streams.py``).
  ``TransferNearlyDone`` (P's last layer group is being computed) lets an idle D start
  scheduling the request before the last bytes land (``early_release``).
  When P can write into D's memory itself (``Hello.direct`` lists how: CUDA IPC on one host,
  NIXL, Mooncake), ``HelloAck.exports`` carries what P needs for each (``KVExport`` IPC
  handles, ``NixlExport`` agent metadata, ``MooncakeExport`` session: the planes and their
  exports are registered in ``planes.py``) and P moves blocks itself: each write is bracketed
  by ``DirectWrite`` (P asks) / ``WriteGrant`` (D allows) / ``DirectWritten`` (P is done), so
  D's bookkeeping guards its blocks exactly as it does for bytes it receives.
  When D reads instead (``cuda_ipc_reads``: P offers its own KV in ``Hello.exports``, D maps it
  and says so in its export), P sends ``DirectRead`` for each group and D copies the blocks
  itself before it answers with the ``WriteGrant``, which then means the bytes are in.

Framing: a 4-byte big-endian length, then the msgpack-encoded message (a tagged union, so the
receiver decodes without knowing the type). ``BlockData`` is followed by ``nbytes`` of payload.
Every message type has a size limit (``MessageLimits``, at the end of this module): a receiver
reads a frame only when its length is within the limit of what the connection accepts next.

``PROTOCOL_VERSION`` changes whenever a message changes shape or meaning; ``CompatInfo`` carries
it together with everything that must match for raw KV bytes to mean the same on both sides.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Union

import msgspec

from vllm_layerkv.wire.planes import PlaneExports

PROTOCOL_VERSION = 10
FRAME_HEADER = struct.Struct("!I")


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


REASON_CHARS = 2000
"""Free-text reasons (``Cancel``, ``Refused``, ``TransferAbort``, ``TransferAck``) are cut to
this many characters when a message is made, so that an honest message always fits its type's
size limit, however long the error it reports."""


def cut_reason(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."


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

    def __post_init__(self) -> None:
        self.reason = cut_reason(self.reason)


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

    def __post_init__(self) -> None:
        self.reason = cut_reason(self.reason)


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
    exports: list[PlaneExports] = []
    """P's own KV, for a decode that reads it itself (with ``cuda_ipc_reads``: a ``KVExport``
    of P's cache); D ignores it unless that setting is on there too."""
    streams: int = 1
    """TCP streams P would deal byte payloads over (its ``tcp_streams``;
    ``transport/tcp_streams.py``)."""


class HelloAck(msgspec.Struct, tag=True, kw_only=True):
    tp_rank: int
    exports: list[PlaneExports] = []
    """How P may write into D's KV itself, for the planes P listed that D offers to it; empty:
    send bytes. Each is its plane's export struct (``planes.py``)."""
    streams: int = 1
    """TCP streams D accepts on this connection, this one included (at most what P asked)."""
    stream_token: str = ""
    """With ``streams`` > 1: what each further stream's ``StreamJoin`` presents."""


class StreamJoin(msgspec.Struct, tag=True, kw_only=True):
    """P worker -> D worker, first message on a further TCP stream of a data connection
    (instead of a ``Hello``), after the authentication handshake."""

    token: str
    """The ``HelloAck.stream_token`` of the connection this stream belongs to."""
    index: int
    """1 .. ``HelloAck.streams`` - 1."""


class StreamJoinAck(msgspec.Struct, tag=True, kw_only=True):
    index: int


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
    streams: int = 1
    """The connection's TCP streams the payload is dealt over (``transport/tcp_streams.py``);
    1: all of it follows this header on this connection."""


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


class DirectRead(msgspec.Struct, tag=True, kw_only=True):
    """P -> D, when D maps P's KV (``KVExport.reads``): copy ``layers`` x ``src_blocks`` of P's
    KV into ``dst_blocks`` of yours now. D answers with ``WriteGrant`` once the bytes are in
    its memory (ok=False: the transfer is closed on D, or the copy failed and D failed the
    transfer). The blocks are P's to keep until then, so P waits for the answer."""

    transfer_id: str
    seq: int
    layers: list[int]
    src_blocks: list[int]
    dst_blocks: list[int]


class WriteGrant(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: ok=False means the transfer is closed on D (or unknown): skip the copy. The
    answer to a ``DirectRead`` comes once D has copied the blocks."""

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
    """P rank ``tp_rank`` has sent all of ``transfer_id`` but its final step's last layers (the
    last group of the even split, which goes out in smaller pieces), and expects the
    TransferDone in about ``eta_s`` seconds. A hint: D may report the request to vLLM early,
    but still waits for TransferDone before the request's forward."""

    transfer_id: str
    tp_rank: int
    eta_s: float


class TransferAbort(msgspec.Struct, tag=True, kw_only=True):
    """P gives up on ``transfer_id``: D must fail the request."""

    transfer_id: str
    reason: str

    def __post_init__(self) -> None:
        self.reason = cut_reason(self.reason)


class TransferAck(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: D is done with ``transfer_id`` (ok=False: D dropped it, e.g. aborted)."""

    transfer_id: str
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        self.reason = cut_reason(self.reason)


Message = Union[
    Register, Cancel, RegisterAck, Refused, FirstToken, Hello, HelloAck, StreamJoin,
    StreamJoinAck, BlockData, DirectWrite, DirectRead, WriteGrant, DirectWritten,
    TransferNearlyDone, TransferDone, TransferAbort, TransferAck,
]

PREFILL_TO_DECODE = (BlockData, DirectWrite, DirectRead, DirectWritten, TransferNearlyDone,
                     TransferDone, TransferAbort)
"""What a data connection carries from P to D after the ``Hello``."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Length-prefixed frame for ``msg``."""
    body = _encoder.encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable LayerKV message: {e}") from None


# ---------------------------------------------------------------- size limits
#
# Each limit is the largest encoding an honest peer produces for that message type, summed from
# what its fields can hold (the allowances below). A receiver reads a frame only when its length
# header is within the limit of what the connection accepts next (``Accepting``: e.g. only a
# ``Hello`` before the first ``Hello``), reads the body as its bytes arrive, and checks the
# decoded message against its own type's limit (``framing.recv_message``). So a peer can make a
# receiver hold no more than the bytes it has actually sent, and never more than one honest
# message of a type it may send at that point.

KIB, MIB = 1 << 10, 1 << 20
FIELDS_BYTES = 1 * KIB
"""Field names (a struct is encoded as a map), the tag, the scalar fields and the short lists
(``Hello.direct``, a registration's per-group list headers) of any one message."""
ID_BYTES = 1 * KIB
"""One identifier as UTF-8: a transfer id has at most 256 characters (``request_params``), an
engine or host id fewer."""
REASON_BYTES = 4 * REASON_CHARS
"""A reason cut to ``REASON_CHARS`` characters, at up to 4 UTF-8 bytes each."""
COMPAT_BYTES = 16 * KIB
"""``CompatInfo``: the model's name or path (up to 4 KiB, Linux's PATH_MAX), the signatures of
a few dozen KV cache groups at most, versions and sizes."""
ENDPOINTS_BYTES = 64 * KIB
"""A registration's data endpoints, one ``host:port`` per decode TP rank (a host name has at
most 253 bytes): up to 128 ranks, with room to spare."""
LAYERS_BYTES = 12 * KIB
"""A frame's layer indices: up to 4,096 layers at 3 bytes each (msgpack uint16)."""
BLOCK_ID_BYTES = 5
"""One block id: a msgpack uint32 (vLLM's block ids stay below 2**32)."""
PLANE_EXPORTS_BYTES = 1 * MIB
"""``HelloAck.exports`` and ``Hello.exports``: about 1 KiB per layer at most for any plane (a
layer's CUDA IPC handles take about 250 B; NIXL agent metadata about 50 B per registered region
over TCP, a few hundred with RDMA keys; Mooncake 9 B per layer address), for up to 512 layers,
doubled."""
DEFAULT_MAX_TRANSFER_BLOCKS = 1 << 18
"""Default of the ``max_transfer_blocks`` setting: 262,144 block ids, e.g. a 4M-token prompt
in one KV cache group of 16-token blocks, or 1M tokens in four groups (a ``Register`` of about
1.4 MiB)."""

MESSAGE_BYTES: dict[type, int] = {
    Register: FIELDS_BYTES + 2 * ID_BYTES + COMPAT_BYTES + ENDPOINTS_BYTES,
    Cancel: FIELDS_BYTES + ID_BYTES + REASON_BYTES,
    RegisterAck: FIELDS_BYTES + ID_BYTES,
    Refused: FIELDS_BYTES + ID_BYTES + REASON_BYTES,
    FirstToken: FIELDS_BYTES + ID_BYTES,
    Hello: FIELDS_BYTES + 2 * ID_BYTES + COMPAT_BYTES + PLANE_EXPORTS_BYTES,
    HelloAck: FIELDS_BYTES + ID_BYTES + PLANE_EXPORTS_BYTES,
    StreamJoin: FIELDS_BYTES + ID_BYTES,
    StreamJoinAck: FIELDS_BYTES,
    BlockData: FIELDS_BYTES + ID_BYTES + LAYERS_BYTES,
    DirectWrite: FIELDS_BYTES + ID_BYTES + LAYERS_BYTES,
    DirectRead: FIELDS_BYTES + ID_BYTES + LAYERS_BYTES,
    WriteGrant: FIELDS_BYTES,
    DirectWritten: FIELDS_BYTES + ID_BYTES,
    TransferNearlyDone: FIELDS_BYTES + ID_BYTES,
    TransferDone: FIELDS_BYTES + ID_BYTES,
    TransferAbort: FIELDS_BYTES + ID_BYTES + REASON_BYTES,
    TransferAck: FIELDS_BYTES + ID_BYTES + REASON_BYTES,
}
"""Each message type's largest encoding, without the block ids of ``CARRIES_BLOCKS``."""
CARRIES_BLOCKS: dict[type, int] = {Register: 1, BlockData: 1, DirectWrite: 1, DirectRead: 2}
"""Types that also carry block ids, and how many lists of up to ``max_transfer_blocks`` each: a
registration lists, per KV cache group, one id per block of the prompt
(``cdiv(prompt_tokens, block_size)``); a frame lists some of one registration's (a
``DirectRead`` both P's and D's)."""
if set(MESSAGE_BYTES) != set(Message.__args__):  # type: ignore[attr-defined]
    raise TypeError("every message type needs its size limit in MESSAGE_BYTES")


@dataclass(frozen=True)
class MessageLimits:
    """The largest encoded size of every message type, for ``max_transfer_blocks`` block ids
    per registration or frame (the setting of that name)."""

    max_transfer_blocks: int = DEFAULT_MAX_TRANSFER_BLOCKS
    _accepting: dict[tuple[type, ...], Accepting] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)
    """``accepting``'s answers by kinds (each connection asks for the same few, per frame)."""

    def of(self, kind: type) -> int:
        base = MESSAGE_BYTES[kind]
        if kind in CARRIES_BLOCKS:
            return base + CARRIES_BLOCKS[kind] * BLOCK_ID_BYTES * self.max_transfer_blocks
        return base

    def accepting(self, *kinds: type) -> Accepting:
        """What a connection that may receive only ``kinds`` next reads (none: any type)."""
        accepting = self._accepting.get(kinds)
        if accepting is None:
            some = kinds or tuple(MESSAGE_BYTES)
            accepting = Accepting(some, self, max(self.of(k) for k in some))
            self._accepting[kinds] = accepting
        return accepting

    def check(self, msg: Message, nbytes: int) -> None:
        """Raise ProtocolError when ``msg``, ``nbytes`` long encoded, exceeds its type's
        limit."""
        kind = type(msg)
        limit = self.of(kind)
        if nbytes > limit:
            raise ProtocolError(f"{kind.__name__} of {nbytes} B exceeds its limit of {limit} B"
                                f"{self.hint((kind,))}")

    def hint(self, kinds: tuple[type, ...]) -> str:
        """What to change when a frame of ``kinds`` is too long, for those carrying block
        ids (an honest peer's transfer may be longer than this instance was set up for)."""
        carrying = [k.__name__ for k in kinds if k in CARRIES_BLOCKS]
        if not carrying:
            return ""
        return (f" ({' / '.join(carrying)} with at most max_transfer_blocks="
                f"{self.max_transfer_blocks} block ids; if real transfers carry more, raise "
                "max_transfer_blocks on this instance)")


@dataclass(frozen=True)
class Accepting:
    """The message types a connection may receive next, and the longest frame it reads for
    them (the largest of their limits)."""

    kinds: tuple[type, ...]
    limits: MessageLimits
    max_bytes: int

    def frame_refusal(self, nbytes: int) -> str:
        """Why a frame of ``nbytes`` is not read."""
        names = " / ".join(k.__name__ for k in self.kinds) if len(self.kinds) < 8 else "message"
        return (f"frame of {nbytes} B exceeds {self.max_bytes} B, the largest {names} this "
                f"connection accepts now{self.limits.hint(self.kinds)}")


LIMITS = MessageLimits()
"""The limits with every setting at its default."""
