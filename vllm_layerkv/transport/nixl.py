"""NIXL plane (``transport=nixl``, or ``auto`` when NIXL is importable): P posts NIXL WRITEs
straight into D's registered KV memory, over whatever NIXL's backend picks (UCX: RDMA, CUDA
IPC, shared memory, TCP...).

* Each worker creates one NIXL agent and registers its KV tensors (DRAM or VRAM) at start.
* D offers its agent metadata and per-layer base addresses in ``HelloAck`` (LayerKV's own
  handshake: no NIXL listener thread, no side channel port).
* P adds D's agent on attach and, per write, builds one descriptor per (layer, run of blocks
  adjacent on both sides, counting up or down): a prompt's blocks are often a few runs, so a
  layer group is a few descriptors. Scattered block lists (more than ``MAX_COALESCED_RUNS``
  runs) use per-block descriptor lists prepared once per peer and reused by index for every
  later request.
* Every descriptor is computed from a request ``AddressedPeer`` checked first: layers and
  block ids against P's KV and D's export, the granted slot and the size against D's ring
  (``kv/bounds.py``).
* Completion: P polls the request with a growing sleep (no busy spin) and only then reports
  ``DirectWritten`` on the control connection; NIXL's DONE means the bytes are in the target's
  memory. Ring writes are posted and polled in two halves (``post_span`` / ``wait_span``), so
  the sender can keep several in flight.
* Different TP (head slices): D registers its receive ring when the first such sender connects
  and offers it with fresh agent metadata (a NIXL agent's metadata names its registered
  memory); P registers each staging buffer once, on first use, and writes a gathered slice
  into the granted ring slot with one descriptor.
* P and D on one GPU: UCX's cuda_ipc fails its copies between two processes on the same device
  (``NIXL_ERR_BACKEND``). D's export names its host and GPU, so P warns at attach and a failed
  WRITE's reason says what to use instead (``ONE_GPU_HINT``).
* ``host_bounce``: the same ring, in D's pinned host memory and offered to every sender; P
  writes every layer group into it from a registered pinned host buffer, so UCX moves host
  memory only (DRAM -> DRAM). ``ucx_reaches_gpu`` decides "auto" from ``UCX_TLS``. With NIXL's
  thread pool (``nixl_num_threads``, 4 by default here) each ring WRITE is one descriptor per
  thread, and NIXL moves each over its own UCX worker and connection: over UCX tcp one TCP
  connection carries about 4 GB/s, a host's loopback several times that.

NIXL's Python wrapper starts the agent's progress thread with a 0 us delay, which spins a core
for ever (measured: 2 agents used 4 s of CPU per 2 s idle). The UCX progress thread waits on
its event descriptors, so a long delay costs no latency; ``_new_agent`` sets one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from vllm_layerkv.common.backoff import Backoff
from vllm_layerkv.common.log import init_logger
from vllm_layerkv.config import nixl_threads
from vllm_layerkv.kv.staging import RecvRing
from vllm_layerkv.transport.direct import (
    AddressedPeer,
    AddressedPlane,
    DirectUnavailable,
    DirectWriteFailed,
    RemoteKV,
    device_uuid,
    host_id,
    layer_geometry,
    memory_regions,
)
from vllm_layerkv.wire.planes import DirectExport, NixlExport

if TYPE_CHECKING:
    from vllm_layerkv.config import LayerKVConfig

logger = init_logger(__name__)
MAX_COALESCED_RUNS = 16
"""Up to this many block runs per layer are written as coalesced descriptors; beyond, the
per-block prepared lists are used."""
PROGRESS_DELAY_US = 100_000
POLL_FIRST_S, POLL_MAX_S = 20e-6, 1e-3
SPLIT_DESCRIPTORS = 1
"""NIXL's thread-pool UCX engine (``nixl_num_threads`` > 0) splits a WRITE among its threads only
from this many descriptors on (NIXL's default: 1,024). LayerKV's WRITEs carry a few large
descriptors, so any WRITE of two or more is split."""
MIN_CUT_BYTES = 1 << 20
"""A ring WRITE is cut into one descriptor per NIXL thread, but no piece below this size."""
ONE_GPU_HINT = ("P and D share one GPU, where UCX's cuda_ipc fails its copies between two "
                "processes (NIXL_ERR_BACKEND); use transport=auto (CUDA IPC), or "
                "UCX_TLS=tcp,cuda_copy,self (host_bounce)")
INSTALL_HINT = ("install it with: pip install 'vllm-layerkv[nixl]' (GPU images: nixl-cu12 or "
                "nixl-cu13 matching CUDA)")
_agent_lock = threading.Lock()


def nixl_api() -> Any:
    """The ``nixl._api`` module, or DirectUnavailable naming the extra to install."""
    try:
        import nixl._api as api
    except ImportError as e:
        raise DirectUnavailable(f"NIXL is not installed ({e}); {INSTALL_HINT}") from None
    return api


def _new_agent(name: str, backends: Sequence[str], num_threads: int = 0) -> Any:
    """A NIXL agent whose progress thread sleeps on events instead of spinning (see the module
    docstring): the wrapper hard-codes ``pthrDelay = 0``, so its binding is wrapped for the
    duration of this one construction. ``num_threads`` > 0: NIXL's thread-pool UCX engine, which
    splits a WRITE of several descriptors among that many worker threads (``SPLIT_DESCRIPTORS``),
    each with its own UCX worker and connections."""
    api = nixl_api()
    bind = api.nixlBind

    class _Bind:
        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

        @staticmethod
        def nixlAgent(agent_name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
            config.pthrDelay = PROGRESS_DELAY_US
            return bind.nixlAgent(agent_name, config)

    # The wrapper passes no engine setting but the thread count, so with threads the UCX
    # engine is created here.
    threads = ucx_threads(backends, num_threads)
    config = api.nixl_agent_config(enable_prog_thread=True,
                                   backends=[] if threads else list(backends))
    with _agent_lock:
        api.nixlBind = _Bind()
        try:
            agent = api.nixl_agent(name, config)
        finally:
            api.nixlBind = bind
    if threads:
        try:
            agent.create_backend("UCX", {"num_threads": str(threads),
                                         "split_batch_size": str(SPLIT_DESCRIPTORS)})
        except Exception as e:  # noqa: BLE001 - nixl raises its own exception types
            raise DirectUnavailable(f"NIXL's UCX engine with {threads} threads: {e}") from None
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise DirectUnavailable(f"NIXL backend(s) {missing} unavailable; this NIXL has "
                                f"{agent.get_plugin_list()}")
    return agent


def ucx_threads(backends: Sequence[str], num_threads: int) -> int:
    """The thread count an agent gets: like NixlConnector, a UCX engine setting; an agent with
    other backends gets none."""
    return num_threads if [b.strip() for b in backends] == ["UCX"] else 0


def span_cuts(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """(offset, bytes) of a ring WRITE's descriptors: ``parts`` about equal pieces, none below
    ``MIN_CUT_BYTES`` (a small write gains nothing from more connections), at least one."""
    parts = max(1, min(parts, nbytes // MIN_CUT_BYTES))
    if parts == 1:
        return [(0, nbytes)]
    step = -(-nbytes // parts)
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


GPU_REACHING_UCX_TLS = ("all", "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x",
                        "dc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5", "cuda_ipc",
                        "gdr_copy", "rocm_ipc", "rocm_gdr")
"""UCX transports (and aliases) that read or write GPU memory themselves: RDMA (GPUDirect),
CUDA IPC, gdr_copy. Any other GPU-memory path in UCX goes through its own host staging
(``cuda_copy``), which is what ``host_bounce`` replaces."""


def ucx_reaches_gpu(ucx_tls: str | None) -> tuple[bool, str]:
    """Whether UCX, configured by ``UCX_TLS``, can move GPU memory without staging it in host
    memory itself, and why: unset, an exclusion list (``^...``) or any GPU-reaching transport
    means yes (UCX picks); a list of only host transports (e.g. ``tcp,cuda_copy,self``) no."""
    if not ucx_tls or not ucx_tls.strip():
        return True, "UCX_TLS is not set (UCX picks its transports)"
    if ucx_tls.strip().startswith("^"):
        return True, f"UCX_TLS={ucx_tls} only excludes transports"
    names = {t.strip().split(":")[0] for t in ucx_tls.split(",") if t.strip()}
    reaching = sorted(names & set(GPU_REACHING_UCX_TLS))
    if reaching:
        return True, f"UCX_TLS={ucx_tls} includes {','.join(reaching)}"
    return False, f"UCX_TLS={ucx_tls} names no transport that reaches GPU memory"


def shares_gpu(export: NixlExport, device: torch.device) -> bool:
    """D's VRAM KV is on ``device`` (where P's KV is), in another process."""
    return (export.mem_type == "VRAM" and device.type == "cuda" and export.host_id == host_id()
            and export.device_uuid == device_uuid(device))


def _mem(local: Sequence[torch.Tensor]) -> tuple[str, int]:
    dev = local[0].device
    return ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)


class NixlPeer(AddressedPeer):
    """P side: one decode rank's KV, reached through this worker's NIXL agent."""

    def __init__(self, plane: NixlPlane, export: NixlExport):
        super().__init__(plane, RemoteKV.of(export))
        self._agent = plane.agent
        self._export = export
        self._mem, self._dev = _mem(self.local)
        self._io_timeout = plane.io_timeout
        self._streams = max(1, plane.num_threads)
        """Descriptors per ring WRITE: one per NIXL thread."""
        try:
            remote = self._agent.add_remote_agent(export.agent_metadata)
        except Exception as e:  # noqa: BLE001 - nixl raises its own exception types
            raise DirectUnavailable(f"nixl: cannot load decode's agent metadata: {e}") from None
        self._remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        self._prepped: tuple[Any, Any] | None = None
        self._hint = ""
        """Added to a failed WRITE's reason: what to change."""
        if not plane.host_bounce and shares_gpu(export, self.local[0].device):
            self._hint = f"; {ONE_GPU_HINT}"
            logger.warning("LayerKV nixl: writing into decode agent %s on this GPU: %s",
                           self._remote, ONE_GPU_HINT)
        self.description = (f"NIXL DRAM->DRAM, agent {self._remote}, KV in {self._mem} through "
                            "pinned host memory (host_bounce)" if self.host_bounce else
                            f"NIXL {self._mem}->{export.mem_type}, agent {self._remote}")

    def write_runs(self, layers: Sequence[int], runs: list[tuple[int, int, int]],
                   src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        try:
            if len(runs) <= MAX_COALESCED_RUNS:
                handle = self._coalesced(layers, runs)
            else:
                handle = self._indexed(layers, src_blocks, dst_blocks)
        except Exception as e:  # noqa: BLE001
            raise DirectWriteFailed(f"nixl: cannot create the WRITE: {e}") from None
        self._post_and_wait(handle)

    def post_span(self, buffer: torch.Tensor, nbytes: int, remote_addr: int) -> Any:
        """One WRITE of a staging buffer into D's ring slot, cut into one descriptor per NIXL
        thread: each thread moves its piece over its own UCX worker and connection (over UCX
        tcp one TCP stream carries about 4 GB/s, a host's loopback several times that)."""
        ex, a = self._export, self._agent
        local_mem, local_dev = _mem([buffer])
        remote_mem, remote_dev = ("DRAM", 0) if ex.ring_in_host else (ex.mem_type, ex.device_id)
        cuts = span_cuts(nbytes, self._streams)
        try:
            local = np.array([(buffer.data_ptr() + off, n, local_dev) for off, n in cuts],
                             dtype=np.uint64)
            remote = np.array([(remote_addr + off, n, remote_dev) for off, n in cuts],
                              dtype=np.uint64)
            handle = a.initialize_xfer("WRITE", a.get_xfer_descs(local, local_mem),
                                       a.get_xfer_descs(remote, remote_mem), self._remote)
        except Exception as e:  # noqa: BLE001 - nixl raises its own exception types
            raise DirectWriteFailed(f"nixl: cannot create the ring WRITE: {e}") from None
        return self._post(handle)

    def wait_span(self, pending: Any) -> None:
        self._wait(*pending)

    def span_done(self, pending: Any) -> bool:
        handle, state, _ = pending
        if state != "PROC":
            return True
        try:
            return self._agent.check_xfer_state(handle) != "PROC"
        except Exception:  # noqa: BLE001 - nixl's types; wait_span reports the failure
            return True

    def _coalesced(self, layers: Sequence[int], runs: list[tuple[int, int, int]]) -> Any:
        ex, bb = self._export, self.block_bytes
        local = np.array([(self.local_addrs[layer] + s * bb, n * bb, self._dev)
                          for layer in layers for s, _, n in runs], dtype=np.uint64)
        remote = np.array([(ex.layer_addrs[layer] + d * bb, n * bb, ex.device_id)
                           for layer in layers for _, d, n in runs], dtype=np.uint64)
        a = self._agent
        return a.initialize_xfer("WRITE", a.get_xfer_descs(local, self._mem),
                                 a.get_xfer_descs(remote, ex.mem_type), self._remote)

    def _indexed(self, layers: Sequence[int], src_blocks: Sequence[int],
                 dst_blocks: Sequence[int]) -> Any:
        if self._prepped is None:
            self._prepped = self._prepare_lists()
        local_h, remote_h = self._prepped
        src = np.asarray(src_blocks, dtype=np.int64)
        dst = np.asarray(dst_blocks, dtype=np.int64)
        li = np.concatenate([layer * self.local_blocks + src for layer in layers])
        ri = np.concatenate([layer * self.remote_blocks + dst for layer in layers])
        return self._agent.make_prepped_xfer("WRITE", local_h, li.astype(np.int32), remote_h,
                                             ri.astype(np.int32))

    def _prepare_lists(self) -> tuple[Any, Any]:
        """Per-block descriptors of every layer, both sides, prepared once for this peer."""
        ex, bb = self._export, self.block_bytes

        def table(addrs: Sequence[int], num_blocks: int, dev: int) -> np.ndarray:
            out = np.empty((len(addrs) * num_blocks, 3), dtype=np.uint64)
            offs = np.arange(num_blocks, dtype=np.uint64) * np.uint64(bb)
            for layer, base in enumerate(addrs):
                rows = out[layer * num_blocks:(layer + 1) * num_blocks]
                rows[:, 0] = np.uint64(base) + offs
                rows[:, 1] = bb
                rows[:, 2] = dev
            return out

        t0 = time.monotonic()
        local_h = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", table(self.local_addrs, self.local_blocks, self._dev),
            self._mem)
        remote_h = self._agent.prep_xfer_dlist(
            self._remote, table(ex.layer_addrs, ex.num_blocks, ex.device_id), ex.mem_type)
        logger.info("LayerKV nixl: prepared per-block descriptor lists for %s in %.0f ms",
                    self._remote, (time.monotonic() - t0) * 1e3)
        return local_h, remote_h

    def _post_and_wait(self, handle: Any) -> None:
        self._wait(*self._post(handle))

    def _post(self, handle: Any) -> tuple[Any, str, float]:
        """Post the WRITE; returns (handle, state, deadline) for ``_wait``."""
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - nixl raises its own exception types
            self._release(handle)
            raise DirectWriteFailed(
                f"nixl: cannot post a WRITE to {self._remote}: {e}{self._hint}") from None
        return handle, state, time.monotonic() + self._io_timeout

    def _wait(self, handle: Any, state: str, deadline: float) -> None:
        """Poll a posted WRITE with a growing sleep until it is DONE, then release it."""
        delay = Backoff(POLL_FIRST_S, POLL_MAX_S)
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DirectWriteFailed(
                        f"nixl: WRITE to {self._remote} did not complete within "
                        f"io_timeout_s={self._io_timeout:.0f}")
                time.sleep(delay.next())
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise DirectWriteFailed(
                    f"nixl: WRITE to {self._remote} failed ({state}){self._hint}")
        except DirectWriteFailed:
            raise
        except Exception as e:  # noqa: BLE001 - nixl raises its own exception types
            raise DirectWriteFailed(
                f"nixl: WRITE to {self._remote} failed: {e}{self._hint}") from None
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # noqa: BLE001 - a request still in flight may refuse
            logger.warning("LayerKV nixl: cannot release a transfer handle: %s", e)

    def close(self) -> None:
        if self._prepped is not None:
            for h in self._prepped:
                try:
                    self._agent.release_dlist_handle(h)
                except Exception:  # noqa: BLE001
                    pass
            self._prepped = None
        try:
            self._agent.remove_remote_agent(self._remote)
        except Exception:  # noqa: BLE001 - already gone
            pass


class NixlPlane(AddressedPlane):
    name = "nixl"

    def __init__(self, local: Sequence[torch.Tensor], backends: Sequence[str] = ("UCX",),
                 io_timeout: float = 60.0, num_threads: int = 0, host_bounce: bool = False):
        super().__init__(local, host_bounce)
        self.io_timeout = io_timeout
        """A WRITE that does not complete within it fails."""
        self.num_threads = ucx_threads(backends, num_threads)
        """NIXL's UCX worker threads (0: one UCX worker, no thread pool)."""
        self.agent = _new_agent(f"layerkv-{uuid.uuid4().hex[:12]}", backends, self.num_threads)
        """This worker's NIXL agent, shared by its peers."""
        self._mem, self._dev = _mem(self.local)
        regions = [(addr, size, self._dev, "") for addr, size in memory_regions(self.local)]
        try:
            self._reg = self.agent.register_memory(regions, self._mem)
        except Exception as e:  # noqa: BLE001
            raise DirectUnavailable(f"nixl: cannot register the KV cache: {e}") from None
        self._extra_regs: dict[tuple[int, int], Any] = {}
        """(address, bytes) -> registration: P's staging buffers, D's receive ring."""

    @classmethod
    def check_installed(cls) -> None:
        nixl_api()

    @classmethod
    def from_config(cls, local: Sequence[torch.Tensor], config: LayerKVConfig,
                    host_bounce: bool) -> NixlPlane:
        return cls(local, backends=config.nixl_backends.split(","),
                   io_timeout=config.io_timeout_s,
                   num_threads=nixl_threads(config.nixl_num_threads, host_bounce),
                   host_bounce=host_bounce)

    def prepare(self) -> None:
        device = self.local[0].device
        self._export = NixlExport(
            agent_name=self.agent.name, agent_metadata=self.agent.get_agent_metadata(),
            mem_type=self._mem, device_id=self._dev, **layer_geometry(self.local),
            host_id=host_id(), device_uuid=device_uuid(device) if device.type == "cuda" else "")

    def ring_export(self, ring: RecvRing) -> NixlExport:
        """With the ring, and agent metadata taken after its registration (a NIXL agent's
        metadata names its registered memory; P loads it to reach the ring)."""
        export = super().ring_export(ring)
        return msgspec.structs.replace(export, agent_metadata=self.agent.get_agent_metadata())

    def attach(self, export: DirectExport) -> NixlPeer:
        assert isinstance(export, NixlExport)
        return NixlPeer(self, export)

    def register(self, t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in self._extra_regs:
            mem, dev = _mem([t])  # host_bounce buffers and rings are DRAM next to VRAM KV
            self._extra_regs[key] = self.agent.register_memory([(key[0], key[1], dev, "")],
                                                               mem)

    def shutdown(self) -> None:
        for reg in [self._reg, *self._extra_regs.values()]:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self._extra_regs.clear()
