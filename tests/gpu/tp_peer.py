"""One rank of the multi-process different-TP test (test_tp_gpu.py starts them all).

    python tp_peer.py d RANK SPEC_JSON              # prints {"endpoint": ...}, then the verdict
    python tp_peer.py p RANK SPEC_JSON ENDPOINTS    # ENDPOINTS: D's data endpoints, comma-joined
                                                    # ("-": read from stdin, once ready)

Every process builds the model's KV the same way (seeded, all ``heads`` KV heads) and keeps its
own rank's share of the heads, as vLLM splits them; D ranks start poisoned. P ranks stream
``src`` blocks in layer groups through the real Sender (gather into staging buffers on the GPU,
then CUDA IPC into D's receive ring, or bytes over TCP); each D rank checks every byte of every
``dst`` block against the model's KV for its heads and that nothing else was touched.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv import tp
from vllm_layerkv.kv.blockio import block_io_for
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.tasks import Peer, RecvTask, SendTask
from vllm_layerkv.transport import create_transport
from vllm_layerkv.wire.protocol import CompatInfo, Hello
from vllm_layerkv.worker.receiver import RecvTable
from vllm_layerkv.worker.sender import (
    FinishTransfer,
    GroupSend,
    Sender,
    SenderParts,
    SenderTuning,
)

SENTINEL = 0x5A
DEVICE = os.environ.get("LAYERKV_TP_PEER_DEVICE", "cuda")  # "cpu": check this harness on CPU
HEAD_BYTES = 16 * 128 * 2 * 2  # one KV head of a 16-token block: 128 dims x (K, V) x bf16


def local_heads(spec: dict, tp_size: int) -> int:
    return tp.rank_heads(0, tp_size, spec["heads"])[1]


def compat(spec: dict, tp_size: int) -> CompatInfo:
    heads = local_heads(spec, tp_size)
    return CompatInfo(vllm_version="test", model="tp", dtype="bfloat16", kv_layout="HND",
                      block_size=16, num_kv_heads=heads, head_size=128,
                      num_layers=spec["layers"], block_bytes=heads * HEAD_BYTES,
                      total_kv_heads=spec["heads"])


def rank_kv(spec: dict, rank: int, tp_size: int, poisoned: bool) -> KVLayout:
    """This rank's share of the model's KV, ``[blocks, local_heads * HEAD_BYTES]`` per layer."""
    first, count = tp.rank_heads(rank, tp_size, spec["heads"])
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    caches = {}
    for i in range(spec["layers"]):
        model = torch.randint(0, 256, (spec["blocks"], spec["heads"], HEAD_BYTES),
                              generator=gen, device=DEVICE, dtype=torch.uint8)
        mine = model[:, first:first + count].reshape(spec["blocks"], count * HEAD_BYTES)
        caches[f"model.layers.{i}.self_attn.attn"] = (
            torch.full_like(mine, SENTINEL) if poisoned else mine.clone())
    return KVLayout.from_kv_caches(caches, spec["blocks"])


def config(spec: dict) -> LayerKVConfig:
    return LayerKVConfig(io_timeout_s=30.0, staging_buffer_mb=spec.get("staging_mb", 64))


def run_d(rank: int, spec: dict) -> None:
    layout = rank_kv(spec, rank, spec["d_tp"], poisoned=True)
    blocks = block_io_for(layout, local_heads(spec, spec["d_tp"]))
    table = RecvTable(compat(spec, spec["d_tp"]), tp_rank=rank, tp_size=spec["d_tp"],
                      unknown_wait_s=5.0, stats=WorkerStats())
    transport = create_transport(spec["transport"], blocks, config(spec))
    endpoint = transport.start_receiver("127.0.0.1", 0, table, blocks, 30.0)
    table.expect(RecvTask("req-0", "tid-0", spec["dst"]))
    print(json.dumps({"endpoint": endpoint}), flush=True)
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 120
    while not finished | failed and time.monotonic() < deadline:
        table.results_ready.wait(0.1)
        f, x = table.drain()
        finished |= f
        failed |= x
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    expected = rank_kv(spec, rank, spec["d_tp"], poisoned=False)
    dst = torch.tensor(spec["dst"], device=DEVICE)
    src = torch.tensor(spec["src"], device=DEVICE)
    untouched = torch.ones(spec["blocks"], dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    mismatched = sum(int((layout.tensors[i][dst] != expected.tensors[i][src]).any(1).sum())
                     for i in range(spec["layers"]))
    untouched_ok = all(bool((layout.tensors[i][untouched] == SENTINEL).all())
                       for i in range(spec["layers"]))
    print(json.dumps({"rank": rank, "finished": sorted(finished), "failed": sorted(failed),
                      "mismatched_blocks": mismatched, "untouched_ok": untouched_ok}),
          flush=True)
    transport.shutdown()


def run_p(rank: int, spec: dict, endpoints: list[str] | None) -> None:
    """``endpoints`` None: read them from stdin (one comma-joined line) once this rank has
    built its KV, transport and sender, so that all that overlaps D's start-up."""
    layout = rank_kv(spec, rank, spec["p_tp"], poisoned=False)
    blocks = block_io_for(layout, local_heads(spec, spec["p_tp"]))
    stats = WorkerStats()
    hello = Hello(compat=compat(spec, spec["p_tp"]), engine_id="p", tp_rank=rank,
                  tp_size=spec["p_tp"])
    cfg = config(spec)
    transport = create_transport(spec["transport"], blocks, cfg)
    sender = Sender(SenderParts(transport, blocks, hello, stats=stats,
                                tracer=Tracer("", "p", rank)),
                    SenderTuning(connect_timeout_s=10.0, io_timeout_s=30.0,
                                 tp_staging=spec.get("tp_staging", True),
                                 staging_bytes=cfg.staging_buffer_mb << 20, staging_buffers=2))
    if endpoints is None:
        endpoints = sys.stdin.readline().strip().split(",")
    peer = Peer(engine_id="d", tp_size=spec["d_tp"], data_endpoints=endpoints)
    task = SendTask(req_id="req-0", transfer_id="tid-0", peer=peer, src_blocks=[spec["src"]],
                    dst_blocks=[spec["dst"]], final=True, new_tokens=16 * len(spec["src"]))
    layers = list(range(spec["layers"]))
    groups = [layers[i:i + spec["group"]] for i in range(0, len(layers), spec["group"])]
    sender.outgoing(task)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.monotonic()
    for g, group in enumerate(groups):
        event = None
        if DEVICE == "cuda":
            event = torch.cuda.Event()
            event.record()
        sender.put(GroupSend(step=1, group=g, layers=group, tasks=[task], event=event))
    sender.put(FinishTransfer(task, t_compute_end=time.monotonic()))
    deadline = time.monotonic() + 120
    state = ""
    while not state and time.monotonic() < deadline:
        sender.state.changed.wait(0.05)
        sender.state.changed.clear()
        with sender.state.lock:
            out = sender.state.transfers["tid-0"]
            if out.terminal:
                state = f"{out.state} {out.reason}".strip()
    seconds = time.monotonic() - t0
    channels = list(sender._channels.values())
    print(json.dumps({"rank": rank, "state": state or "timeout", "seconds": seconds,
                      "ops": out.frames, "nbytes": out.nbytes,
                      "transport": transport.name,
                      "direct": bool(channels) and all(c.direct for c in channels),
                      "ring": bool(channels) and all(
                          getattr(c._writer, "ring_slots", 0) > 0 for c in channels)}),
          flush=True)
    sender.shutdown()
    transport.shutdown()


if __name__ == "__main__":
    role, rank, spec_json = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    if role == "d":
        run_d(rank, spec_json)
    else:
        run_p(rank, spec_json, None if sys.argv[4] == "-" else sys.argv[4].split(","))
    sys.stdout.flush()
    os._exit(0)  # NIXL 1.5.1 crashes the interpreter's teardown once an agent existed
