"""One side of the two-process CUDA IPC test (test_cuda_ipc.py runs both).

    python ipc_peer.py d SPEC_JSON      # prints {"endpoint": ...}, then the verdict
    python ipc_peer.py p SPEC_JSON ENDPOINT

Both sides build KV the same way (seeded), so D can check every byte P copied without P
shipping anything else. The real Sender / RecvTable / TcpTransport run on each side; only the
vLLM engine around them is absent.

Optional spec keys for P: ``send``, the indices of the transfers this P sends (default all:
several P processes may serve one D); ``die_after_groups``: send that many layer groups of
them, then kill this process (SIGKILL, as a crash would) once the sender has sent them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from vllm_layerkv.common.trace import Tracer
from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.counters import WorkerStats
from vllm_layerkv.kv.blockio import StagedBlockIO
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


def compat(spec: dict) -> CompatInfo:
    return CompatInfo(vllm_version="test", model="ipc", dtype="bfloat16", kv_layout="HND",
                      block_size=16, num_kv_heads=8, head_size=128,
                      num_layers=spec["layers"], block_bytes=spec["block_bytes"])


def make_layout(spec: dict, seed: int | None) -> KVLayout:
    """[num_blocks, block_bytes] uint8 caches on cuda:0; seeded random bytes or the sentinel."""
    gen = torch.Generator(device="cuda").manual_seed(seed or 0)
    caches = {}
    for i in range(spec["layers"]):
        t = torch.empty(spec["blocks"], spec["block_bytes"], dtype=torch.uint8, device="cuda")
        if seed is None:
            t.fill_(SENTINEL)
        else:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device="cuda",
                                  dtype=torch.uint8))
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return KVLayout.from_kv_caches(caches, spec["blocks"])


def run_d(spec: dict) -> None:
    layout = make_layout(spec, seed=None)
    blocks = StagedBlockIO(layout)
    stats = WorkerStats()
    table = RecvTable(compat(spec), tp_rank=0, tp_size=1, unknown_wait_s=5.0, stats=stats)
    transport = create_transport(spec["transport"], blocks, LayerKVConfig(**spec.get("config", {})))
    endpoint = transport.start_receiver("127.0.0.1", 0, table, blocks, 30.0)
    for i, t in enumerate(spec["transfers"]):
        table.expect(RecvTask(f"req-{i}", f"tid-{i}", t["dst"]))
    print(json.dumps({"endpoint": endpoint}), flush=True)
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 120
    while len(finished | failed) < len(spec["transfers"]) and time.monotonic() < deadline:
        table.results_ready.wait(0.1)
        f, x = table.drain()
        finished |= f
        failed |= x
    expected = make_layout(spec, seed=1)  # P's KV, regenerated here
    mismatches = 0
    written = torch.zeros(spec["layers"], spec["blocks"], dtype=torch.bool)
    for i, t in enumerate(spec["transfers"]):
        if f"req-{i}" in failed:  # whatever arrived of it is not checked, nor its blocks
            written[:, t["dst"]] = True
            continue
        for layer in range(spec["layers"]):
            for s, d in zip(t["src"], t["dst"]):
                written[layer, d] = True
                if not torch.equal(layout.tensors[layer][d], expected.tensors[layer][s]):
                    mismatches += 1
    untouched_ok = all(
        bool((layout.tensors[layer][~written[layer].cuda()] == SENTINEL).all())
        for layer in range(spec["layers"]))
    print(json.dumps({"finished": sorted(finished), "failed": sorted(failed),
                      "mismatched_blocks": mismatches, "untouched_ok": untouched_ok,
                      "cuda_ok": cuda_still_works(),
                      "device": torch.cuda.get_device_name()}), flush=True)
    transport.shutdown()


def cuda_still_works() -> bool:
    """Whether this process's CUDA context still runs work (a fault in a copy, such as reading
    a dead peer's memory, would leave it broken for good)."""
    try:
        x = torch.ones(1 << 20, device="cuda")
        ok = int(x.sum().item()) == 1 << 20
        torch.cuda.synchronize()
        return ok
    except RuntimeError:
        return False


def run_p(spec: dict, endpoint: str) -> None:
    layout = make_layout(spec, seed=1)
    blocks = StagedBlockIO(layout)
    stats = WorkerStats()
    hello = Hello(compat=compat(spec), engine_id="p", tp_rank=0, tp_size=1)
    config = LayerKVConfig(**spec.get("config", {}))
    transport = create_transport(spec["transport"], blocks, config)
    tracer = Tracer(os.environ.get("LAYERKV_GPU_TRACE", ""), "p", 0)
    sender = Sender(SenderParts(transport, blocks, hello, stats=stats, tracer=tracer),
                    SenderTuning(connect_timeout_s=10.0, io_timeout_s=30.0,
                                 staging_bytes=config.staging_buffer_mb << 20,
                                 staging_buffers=config.staging_buffers,
                                 writes_in_flight=config.writes_in_flight))
    peer = Peer(engine_id="d", tp_size=1, data_endpoints=[endpoint])
    tasks = [SendTask(req_id=f"req-{i}", transfer_id=f"tid-{i}", peer=peer, src_blocks=[t["src"]],
                      dst_blocks=[t["dst"]], final=True, new_tokens=16 * len(t["src"]))
             for i, t in enumerate(spec["transfers"])]
    tasks = [tasks[i] for i in spec.get("send", range(len(tasks)))]
    layers = list(range(spec["layers"]))
    groups = [layers[i:i + spec["group"]] for i in range(0, len(layers), spec["group"])]
    for task in tasks:
        sender.outgoing(task)
    torch.cuda.synchronize()
    if spec.get("die_after_groups") is not None:
        die_mid_transfer(sender, stats, tasks, groups[:spec["die_after_groups"]])
    states: dict[str, str] = {}
    # spec["warmup"]: the first transfer opens the connection (handshake, engine endpoints,
    # host buffers) and is left out of the rate, which then is the steady state's
    warm = tasks[:1] if spec.get("warmup") else []
    t_setup = send_all(sender, warm, groups, states) if warm else None
    t0 = time.monotonic()
    send_all(sender, tasks[len(warm):], groups, states)
    seconds = time.monotonic() - t0
    sent = [spec["transfers"][i] for i in spec.get("send", range(len(spec["transfers"])))]
    timed = sent[len(warm):]
    nbytes = sum(len(t["src"]) for t in timed) * spec["layers"] * spec["block_bytes"]
    channel = next(iter(sender._channels.values()), None)
    print(json.dumps({"states": states, "seconds": seconds, "nbytes": nbytes,
                      "gbps": nbytes / seconds / 1e9, "transport": transport.name,
                      "warmup_seconds": t_setup,
                      "direct": bool(getattr(channel, "direct", False)),
                      "bounces": bool(getattr(channel, "bounces", False)),
                      "reads": bool(getattr(channel, "reads", False))}), flush=True)
    sender.shutdown()
    transport.shutdown()


def die_mid_transfer(sender: Sender, stats: WorkerStats, tasks: list[SendTask],
                     groups: list[list[int]]) -> None:
    """Queue ``groups`` of ``tasks`` without their ends, and kill this process as soon as the
    sender has sent them (D may then still be copying the last one)."""
    for g, group in enumerate(groups):
        event = torch.cuda.Event()
        event.record()
        sender.put(GroupSend(step=1, group=g, layers=group, tasks=tasks, event=event))
    sent, deadline = 0, time.monotonic() + 60
    while sent < len(groups) * len(tasks) and time.monotonic() < deadline:
        counts = stats.take()
        sent += counts.data["groups_sent"] if counts is not None else 0
        time.sleep(0.0002)
    print(json.dumps({"groups_sent": sent}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def send_all(sender: Sender, tasks: list[SendTask], groups: list[list[int]],
             states: dict[str, str]) -> float:
    """Queue every group of ``tasks`` (as the layer hooks would), then their ends; wait until
    each is terminal (state into ``states``). Returns the seconds it took."""
    t0 = time.monotonic()
    for g, group in enumerate(groups):
        event = torch.cuda.Event()
        event.record()
        sender.put(GroupSend(step=1, group=g, layers=group, tasks=tasks, event=event))
    for task in tasks:
        sender.put(FinishTransfer(task, t_compute_end=time.monotonic()))
    wanted = {t.transfer_id for t in tasks}
    deadline = time.monotonic() + 120
    while not wanted <= states.keys() and time.monotonic() < deadline:
        sender.state.changed.wait(0.05)
        sender.state.changed.clear()
        with sender.state.lock:
            for tid, out in sender.state.transfers.items():
                if out.terminal and tid in wanted:
                    states[tid] = f"{out.state} {out.reason}".strip()
    return time.monotonic() - t0


if __name__ == "__main__":
    role, spec_json = sys.argv[1], json.loads(sys.argv[2])
    if role == "d":
        run_d(spec_json)
    else:
        run_p(spec_json, sys.argv[3])
    # NIXL 1.5.1 crashes the interpreter's teardown once an agent existed (tests/conftest.py)
    sys.stdout.flush()
    os._exit(0)
