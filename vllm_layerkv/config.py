"""LayerKV settings: read from ``kv_connector_extra_config``, then ``LAYERKV_*`` environment
variables, then defaults. Validated once, with errors that say what to change.

vLLM's ``KVTransferConfig`` rejects unknown fields, so every LayerKV knob lives in
``kv_connector_extra_config``. docs/configuration.md lists each one; keep the two in sync
(tests/unit/test_config.py checks that every field is documented).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_layerkv.wire.auth import SECRET_ENV, ChannelAuth
from vllm_layerkv.wire.planes import TRANSPORTS
from vllm_layerkv.wire.protocol import DEFAULT_MAX_TRANSFER_BLOCKS

MOONCAKE_PROTOCOLS = ("tcp", "rdma")
SECRET_SETTING = "auth_secret"
"""The secret itself: refused in kv_connector_extra_config (auth_secret_file or
LAYERKV_AUTH_SECRET carry it)."""
BOUNCE_NIXL_THREADS = 4
"""``nixl_num_threads`` by default with host_bounce: each ring WRITE over 4 UCX workers, each
its own TCP connection over UCX tcp."""
BOUNCE_PIPELINE_DEPTH, PIPELINE_DEPTH = 4, 2
"""``staging_buffers`` and ``writes_in_flight`` by default with host_bounce and otherwise. With
host_bounce the buffers are pinned host memory too; 4 in flight keep NIXL's threads fed."""


def nixl_threads(setting: int, host_bounce: bool) -> int:
    """``nixl_num_threads`` resolved for a plane: -1 (the default) depends on host_bounce."""
    if setting >= 0:
        return setting
    return BOUNCE_NIXL_THREADS if host_bounce else 0


def pipeline_depth(setting: int, host_bounce: bool) -> int:
    """``staging_buffers`` / ``writes_in_flight`` resolved for a sender: 0 (the default)
    depends on host_bounce."""
    if setting > 0:
        return setting
    return BOUNCE_PIPELINE_DEPTH if host_bounce else PIPELINE_DEPTH


class ConfigError(ValueError):
    """A LayerKV setting is invalid. The message names the setting and what to change."""


@dataclass(frozen=True)
class LayerKVConfig:
    # --- where things listen -------------------------------------------------------------
    host: str = field(default_factory=lambda: os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
    """Address this instance advertises to its peers (P's registration endpoint, D's data
    endpoint). Defaults to VLLM_HOST_IP, else 127.0.0.1: set it for cross-host P/D."""
    registration_port: int = 0
    """P only: TCP port of the registration listener in the scheduler process. 0 = any free
    port; the proxy discovers it."""
    bootstrap_port: int = 8998
    """P only: TCP port of the bootstrap endpoint (``GET /query``), the one vLLM's
    MooncakeConnector serves and P/D routers read to find a prefill instance
    (``vllm-router --kv-connector mooncake``, llm-d's sidecar in mooncake mode). 8998 is
    vLLM's default. 0 = no bootstrap endpoint (LayerKV's own proxy does not need it). With
    data parallelism, rank 0's engine serves it and the other ranks register with it."""
    data_port: int = 0
    """D only: first TCP port of the data listeners; TP rank r listens on data_port + r.
    0 = any free port (published to the scheduler through vLLM's handshake metadata)."""
    transport: str = "auto"
    """How KV moves. "auto": per decode peer, CUDA IPC when P and D share a host and keep KV on
    CUDA devices, else NIXL if installed, else Mooncake if installed, else bytes over TCP.
    "tcp": always bytes over TCP (pinned host staging on GPU). "cuda_ipc" / "nixl" /
    "mooncake": that engine only; a peer it cannot reach fails the transfer with the reason.
    Control messages always use LayerKV's TCP connection."""
    nixl_backends: str = "UCX"
    """transport nixl/auto: comma-separated NIXL backends for the agent (e.g. "UCX",
    "LIBFABRIC"). UCX's own settings (UCX_TLS, UCX_NET_DEVICES) come from the environment."""
    nixl_num_threads: int = -1
    """transport nixl/auto with the UCX backend: NIXL's ``num_threads``. With N > 0 NIXL runs N
    UCX worker threads, each with its own connections, and splits every WRITE of two or more
    descriptors among them; a ``host_bounce`` ring WRITE is cut into N descriptors. 0 = one UCX
    worker. -1 (default): ``BOUNCE_NIXL_THREADS`` with host_bounce, else 0. Measured on two
    H200s over UCX tcp (one TCP connection moves about 4 GB/s, the host's loopback several times
    that): the real path moved 4.45 GB/s with 4 threads against 3.82 with one worker, 5.06 with
    4 threads and 4 pieces in flight."""
    host_bounce: str = "auto"
    """NIXL / Mooncake with KV on a GPU: move each layer group through pinned host memory
    (P copies it into a registered pinned host buffer, the engine writes that into a ring in
    D's host memory, D copies it into its blocks) instead of handing GPU memory to the engine.
    For engine paths that cannot move GPU memory well: NIXL with UCX over tcp moved KV at
    0.47 GB/s from GPU to GPU, where it moves host memory at several GB/s. "on" / "off";
    "auto": on for NIXL when ``UCX_TLS`` is set and names no transport that reaches GPU
    memory itself (RDMA, CUDA IPC, gdr_copy), e.g. ``tcp,cuda_copy,self``; off otherwise and
    for Mooncake. Takes effect when both P and D have it on; D then holds ``recv_ring_slots``
    x ``staging_buffer_mb`` of pinned host memory for the ring."""
    cuda_ipc_reads: bool = True
    """D, CUDA IPC (same host, same TP): map P's KV and copy each layer group itself when P
    announces it (``DirectRead``), as NixlConnector's D does, instead of P writing into D's
    memory. A decode GPU whose CUDA context maps a peer's memory this way runs its decode graph
    with shorter gaps between kernels (4.64 against 4.80 ms per step on an H200 pair), so TPOT
    under load matches NixlConnector's. Takes effect when both P (which then offers its KV to
    the decode instances it connects to) and D have it on; otherwise, with another TP, or when
    the mapping fails, P writes into D. False: P always writes (P's KV is then mapped by no
    other process)."""
    mooncake_protocol: str = "tcp"
    """transport mooncake/auto: the TransferEngine protocol, "tcp" or "rdma"."""
    mooncake_device: str = ""
    """transport mooncake/auto with rdma: RDMA device names for the engine (e.g.
    "mlx5_0,mlx5_1"); empty lets Mooncake choose."""

    # --- layer-group streaming -----------------------------------------------------------
    layerwise: bool = True
    """Stream KV per layer group while prefill runs. False sends each step's KV once, after
    the step's last layer (still per chunk)."""
    min_prompt_tokens: int = 256
    """Prompts shorter than this are sent as one group at the end of the step (streaming
    costs more than it saves on short prompts)."""
    max_pipeline_stages: int = 8
    """Adaptive grouping: target number of layer groups for a step whose average new tokens
    per request are at most min_prompt_tokens (groups = num_layers // (num_layers // target),
    so it can come out slightly higher)."""
    min_pipeline_stages: int = 2
    """Adaptive grouping: target number of layer groups once the step's average new tokens
    reach 3 x min_prompt_tokens."""
    group_size: int = 0
    """Fixed number of layers per group; 0 = adaptive (the rule above)."""
    last_group_layers: int = 1
    """Adaptive grouping: split a step's last layer group, halving, until its final piece has
    at most this many layers (two groups of 16 go out as 16, 8, 4, 2, 1, 1). That piece's
    transfer is what remains after P's last layer; 0 keeps the last group whole."""
    group_transfer_ms: float = 20.0
    """Adaptive grouping on a slow link: raise the number of groups until one group's share
    of the step's KV takes at most this long on the link (its rate as the sender measures
    it). 0 turns this off. Links that move a step's KV within it (NVLink) are unaffected."""
    piecewise_cudagraph: bool = False
    """GPU prefill instances: set true so vLLM uses PIECEWISE CUDA graphs and the per-layer
    hooks fire during replays (FULL graphs skip them; LayerKV then sends the step's KV at its
    end). Leave false on decode instances so they keep FULL decode graphs."""

    early_release: bool = True
    """D: when P says a transfer's last layer group is being computed (``TransferNearlyDone``)
    and this instance runs nothing else, report the request to vLLM ahead of the last bytes,
    so that vLLM's scheduling of it overlaps P's last group; the step that runs it waits for
    the KV before its forward. Models with one KV cache group only (vLLM takes load errors of
    a running request per block only there)."""
    early_release_lead_ms: float = 10.0
    """D: report that long before P expects the transfer done: about the time from a report to
    the request's forward in vLLM's engine loop (a few ms with CUDA graphs, more when eager)."""

    # --- robustness ----------------------------------------------------------------------
    registration_wait_s: float = 0.5
    """P: a new prefill waits at most this long for the decode instance's registration before
    it starts computing (only a registered request can stream its first chunk). 0 = never
    wait; KV computed before the registration then goes out with the next chunk or at the
    end."""
    kv_wait_timeout_s: float = 120.0
    """D: a request parked waiting for KV fails after this long (vLLM's
    kv_load_failure_policy then fails or recomputes it)."""
    registration_timeout_s: float = 60.0
    """P: how long a finished prefill keeps its blocks for a decode instance that has not
    registered yet (with a sequential router, the lease on the blocks until D's request
    arrives)."""
    remote_prefill_fallback: str = "local"
    """D: what happens to a request that asks for a remote prefill (``do_remote_prefill``) with
    ``kv_transfer_params`` LayerKV cannot use (another connector's, or malformed). Either way it
    is counted in ``vllm:layerkv_remote_prefill_fallbacks_total`` and logged (rate-limited),
    with the reason in the response's ``kv_transfer_params.layerkv_error``. "local": D computes
    the prompt itself. "fail": the request takes vLLM's KV-load-failure path, so vLLM's
    ``kv_load_failure_policy`` decides: "fail" (vLLM's default) ends it with finish reason
    "error", "recompute" computes it locally."""
    ack_timeout_s: float = 60.0
    """P: how long a sent transfer waits for D's acknowledgement before its blocks are freed
    anyway."""
    connect_timeout_s: float = 10.0
    """Timeout for opening a control or data connection and for its handshake."""
    io_timeout_s: float = 60.0
    """A data connection that makes no progress for this long is closed and its transfers
    fail (the kernel's send and receive timeouts of its blocking sockets)."""
    tcp_streams: int = 4
    """KV bytes over TCP (``transport: tcp``, or ``auto`` where no direct plane reaches D): the
    TCP connections each (P rank, D rank) pair deals its payloads over, the data connection
    included (``transport/tcp_streams.py``). One connection moves a few GB/s, its bytes copied
    by one core at each end; on an H200 host's loopback the link probe moved 2.8-3x as much
    over four. The pair uses the smaller of P's and D's setting; each stream is one more
    connection on D's data listener (``max_connections``) and one thread at each end. 1 = one
    connection."""

    # --- prefill TP != decode TP (tp.py, staging.py) --------------------------------------
    tp_staging: bool = True
    """When P and D use different tensor parallelism, gather the head slices bound for one
    decode rank into a staging buffer and send them in one transfer per (layer group, rank).
    False sends one transfer per (layer, block) slice instead (for comparison only: tens of
    thousands of transfers per long prompt)."""
    staging_buffer_mb: int = 64
    """Size of one staging buffer (P) and of one receive-ring slot (D), in MiB. A layer
    group's slices larger than this go in several transfers."""
    staging_buffers: int = 0
    """P: staging buffers per worker, allocated on first use and reused; a sender that finds
    none free waits (up to io_timeout_s), never overwriting data not yet sent. 0 (default):
    ``pipeline_depth``: 4 with host_bounce, else 2."""
    writes_in_flight: int = 0
    """P: ring writes (different TP through a direct plane, or ``host_bounce``) a sender keeps
    in flight per layer group and decode rank: P posts the next piece before it waits for the
    last, and D scatters one piece while the next is written. Each holds a staging buffer, so the
    sender uses at most ``staging_buffers``; D's ``recv_ring_slots`` bound it too (D delays
    grants). 1 = one piece at a time. 0 (default): ``pipeline_depth``: 4 with host_bounce, else
    2."""
    recv_ring_slots: int = 4
    """D: receive-ring slots per worker for direct planes (CUDA IPC, NIXL, Mooncake) with
    mismatched TP, allocated when the first such prefill rank connects. P writes into a slot
    D granted and D scatters it into its KV blocks before reusing it; when all slots are busy
    D delays its grant (back-pressure)."""

    # --- engine loop ---------------------------------------------------------------------
    idle_backoff: str = "auto"
    """While every request only waits (for KV, an ack or a registration), vLLM steps the engine
    with empty steps as fast as it can. "on": LayerKV slows those steps down, waiting for what
    they wait for with a growing timeout (workers up to 50 ms, P's scheduler up to 1.25 s) that
    ends the moment it arrives; needed where instances share CPU cores, whose spinning workers
    otherwise starve each other. "off": a fixed 2 ms wait per empty worker step. "auto": on for
    CPU instances, off on GPUs (where it would delay a request arriving at an idle engine)."""

    gil_switch_interval_ms: float = 0.0
    """Workers: Python's GIL switch interval in the worker process, in ms (``sys.
    setswitchinterval``); 0 leaves Python's 5 ms. LayerKV's sender and receiver threads block
    several times per piece of KV, and after each they wait for the GIL while vLLM's engine
    thread runs Python, up to this long. Shorter hands the GIL over sooner, for every thread of
    the process. Off by default: its effect on a serving instance is not measured."""

    # --- security: authentication (docs/security.md) -----------------------------------
    # (authentication settings go here)
    auth_secret_file: str = ""
    """Path of a file holding the shared secret P and D prove to each other, by HMAC
    challenge-response, before any LayerKV message (whitespace around it is ignored; at least
    16 characters, e.g. ``openssl rand -hex 32``; keep the file mode 600). The secret may come
    from the environment variable ``LAYERKV_AUTH_SECRET`` instead (one of the two, never both),
    never from ``kv_connector_extra_config``, which shows in process lists and logs. Neither
    set: the channels run unauthenticated (a warning is logged once when a listener is not on
    loopback). P and D must agree: a secret on one side only refuses every connection, saying
    so."""
    allowed_peers: str = ""
    """Comma-separated addresses or CIDRs (e.g. "10.0.0.0/8,192.168.1.7") whose connections
    LayerKV's listeners accept, checked before anything is read; empty = any address."""
    bootstrap_query_auth: bool = False
    """P: with a shared secret set, require the signed header on the bootstrap endpoint's
    ``GET /query`` too. Off by default because routers (vllm-router, llm-d) read /query without
    it; ``POST /register`` always requires it when a secret is set."""

    # --- security: resource limits (docs/security.md) ----------------------------------
    # (resource-limit settings go here)
    max_connections: int = 256
    """Connections each LayerKV listener (P's registration server, D's data listener per worker,
    P's bootstrap endpoint) serves at once, one thread each. At the cap a new connection closes
    the oldest one still in its authentication handshake, or is refused when all have
    authenticated."""
    handshake_timeout_s: float = 5.0
    """A new connection that has not completed the authentication handshake within this long is
    closed (listeners); also bounds each bootstrap request."""
    message_timeout_s: float = 10.0
    """P's registration server: once a message has started to arrive, each read of the rest
    must return within this long, or the connection is closed. (Data connections use
    io_timeout_s.)"""
    max_early_registrations: int = 4096
    """P: registrations held for prefill requests P has not received yet (D registers first).
    Beyond this, new ones are refused, saying so, until some are matched, cancelled or
    expire."""
    early_registration_ttl_s: float = 180.0
    """P: how long such a registration waits for its prefill request before it is dropped and
    D is told. Keep it above the decode instances' kv_wait_timeout_s (default 120): a request
    can wait in P's queue that long under load, and an honest D cancels its own registration
    when it gives up, so the TTL only bounds registrations whose D went away silently."""
    max_closed_transfers: int = 65536
    """D worker: closed transfer ids remembered, so that late frames for them are dropped at
    once; beyond this the oldest are forgotten (a late frame for one then waits
    connect_timeout_s before it is dropped; it is never written)."""
    closed_transfer_ttl_s: float = 600.0
    """D worker: how long a closed transfer id is remembered."""
    max_transfer_blocks: int = DEFAULT_MAX_TRANSFER_BLOCKS
    """The most block ids one registration (all KV cache groups together: per group, one per
    block of the prompt) or one KV frame may carry; it sizes the largest ``Register`` P's
    registration server reads (about 5 B per id, so 1.4 MiB by default) and the largest
    ``BlockData`` / ``DirectWrite`` header D reads. The default, 262,144, covers a 4M-token
    prompt in 16-token blocks with one KV cache group, or 1M tokens with four. Longer prompts
    need more: set it on P and D alike (a larger frame closes its connection, logging this
    setting's name)."""

    # --- link emulation (benchmarks only) ------------------------------------------------
    # (pacing settings go here)
    tcp_pacing_gbps: float = 0.0
    """Benchmarks only: pace the TCP transport's KV bytes on P to this many gigabits per second
    per worker (a token bucket, ``transport/pacing.py``), so that instances on one host
    emulate a slower link in a link-rate sweep. 0 = off. Bytes over TCP only (transport tcp,
    or auto where no direct plane reaches D); never set it in production."""

    # --- diagnostics ---------------------------------------------------------------------
    trace_path: str = ""
    """If set, workers append one JSON line per transfer event to this file + ".p.<rank>"
    (prefill: step plans, layer-group hooks, group sends, TransferDone) or ".d.<rank>" (decode:
    transfer expected, closed, reported). For benchmarks and debugging; off by default."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> LayerKVConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        if SECRET_SETTING in extra:
            raise ConfigError(
                f"{SECRET_SETTING} is not accepted in kv_connector_extra_config, which shows in "
                f"process lists and logs; put the shared secret in a file named by "
                f"auth_secret_file, or in the environment variable {SECRET_ENV}")
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown LayerKV setting(s) {unknown} in kv_connector_extra_config; "
                f"valid settings are {sorted(known)} (see docs/configuration.md)"
            )
        values: dict[str, Any] = {}
        for name, f in known.items():
            env_name = "LAYERKV_" + name.upper()
            if name in extra:
                values[name] = _coerce(name, extra[name], f, source="kv_connector_extra_config")
            elif env_name in os.environ:
                values[name] = _coerce(name, os.environ[env_name], f, source=env_name)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.transport in TRANSPORTS,
             f"transport={self.transport!r} is not available; use one of {list(TRANSPORTS)}")
        need(self.mooncake_protocol in MOONCAKE_PROTOCOLS,
             f"mooncake_protocol={self.mooncake_protocol!r} is not supported; use one of "
             f"{list(MOONCAKE_PROTOCOLS)}")
        need(bool(self.nixl_backends.strip()) and all(
            b.strip() for b in self.nixl_backends.split(",")),
             f"nixl_backends={self.nixl_backends!r} must name at least one NIXL backend, "
             "comma-separated (e.g. UCX)")
        for name in ("registration_port", "bootstrap_port", "data_port"):
            port = getattr(self, name)
            need(0 <= port <= 65535, f"{name}={port} is not a TCP port; use 0..65535 (0 = any)")
        need(self.nixl_num_threads >= -1,
             f"nixl_num_threads={self.nixl_num_threads} must be >= -1 (0 = one UCX worker, "
             "-1 = the default for the path)")
        need(self.min_prompt_tokens >= 0, "min_prompt_tokens must be >= 0")
        need(self.min_pipeline_stages >= 1,
             f"min_pipeline_stages={self.min_pipeline_stages} must be >= 1")
        need(self.max_pipeline_stages >= self.min_pipeline_stages,
             f"max_pipeline_stages={self.max_pipeline_stages} must be >= "
             f"min_pipeline_stages={self.min_pipeline_stages}")
        need(self.group_size >= 0, f"group_size={self.group_size} must be >= 0 (0 = adaptive)")
        need(self.last_group_layers >= 0,
             f"last_group_layers={self.last_group_layers} must be >= 0 (0 = no split)")
        need(self.group_transfer_ms >= 0,
             f"group_transfer_ms={self.group_transfer_ms} must be >= 0 (0 = off)")
        need(self.registration_wait_s >= 0, "registration_wait_s must be >= 0 seconds")
        need(0 <= self.early_release_lead_ms <= 1000,
             f"early_release_lead_ms={self.early_release_lead_ms} must be between 0 and 1000")
        for name in ("kv_wait_timeout_s", "registration_timeout_s", "ack_timeout_s",
                     "connect_timeout_s", "io_timeout_s"):
            need(getattr(self, name) > 0, f"{name} must be > 0 seconds")
        need(bool(self.host), "host must not be empty")
        try:
            ChannelAuth.from_config(self)
        except ValueError as e:  # the secret's source or allowed_peers
            raise ConfigError(str(e)) from None
        need(1 <= self.max_connections <= 65536,
             f"max_connections={self.max_connections} must be between 1 and 65536")
        for name in ("handshake_timeout_s", "message_timeout_s", "closed_transfer_ttl_s"):
            need(getattr(self, name) > 0, f"{name} must be > 0 seconds")
        need(self.early_registration_ttl_s > 0,
             "early_registration_ttl_s must be > 0 seconds (keep it above the decode "
             "instances' kv_wait_timeout_s)")
        for name in ("max_early_registrations", "max_closed_transfers"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        need(1 <= self.max_transfer_blocks <= 1 << 26,
             f"max_transfer_blocks={self.max_transfer_blocks} must be between 1 and 67108864")
        need(1 <= self.staging_buffer_mb <= 4096,
             f"staging_buffer_mb={self.staging_buffer_mb} must be between 1 and 4096 (MiB)")
        need(self.host_bounce in ("auto", "on", "off"),
             f"host_bounce={self.host_bounce!r}: use auto, on or off")
        need(self.remote_prefill_fallback in ("local", "fail"),
             f"remote_prefill_fallback={self.remote_prefill_fallback!r}: use local or fail")
        need(self.idle_backoff in ("auto", "on", "off"),
             f"idle_backoff={self.idle_backoff!r}: use auto, on or off")
        need(0 <= self.gil_switch_interval_ms <= 100,
             f"gil_switch_interval_ms={self.gil_switch_interval_ms} must be between 0 and 100 "
             "(0 = Python's default, 5 ms)")
        need(1 <= self.tcp_streams <= 16,
             f"tcp_streams={self.tcp_streams} must be between 1 and 16")
        need(self.tcp_pacing_gbps >= 0,
             f"tcp_pacing_gbps={self.tcp_pacing_gbps} must be >= 0 (0 = no pacing)")
        need(1 <= self.recv_ring_slots <= 64,
             f"recv_ring_slots={self.recv_ring_slots} must be between 1 and 64")
        for name in ("staging_buffers", "writes_in_flight"):
            need(0 <= getattr(self, name) <= 64, f"{name}={getattr(self, name)} must be "
                 "between 1 and 64, or 0 for the default of the path")

    def backs_off_when_idle(self, device_type: str) -> bool:
        """``idle_backoff`` resolved for an instance on ``device_type`` ("cpu", "cuda", ...)."""
        if self.idle_backoff == "auto":
            return device_type == "cpu"
        return self.idle_backoff == "on"

    def replace(self, **changes: Any) -> LayerKVConfig:
        return dataclasses.replace(self, **changes)


def _coerce(name: str, value: Any, f: dataclasses.Field, source: str) -> Any:
    kind = type(f.default) if f.default is not dataclasses.MISSING else str
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(
            f"LayerKV setting {name}={value!r} (from {source}) is not a valid "
            f"{kind.__name__}"
        ) from None
