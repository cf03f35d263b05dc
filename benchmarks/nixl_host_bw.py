"""NIXL WRITE throughput between two processes on one host, host or GPU memory, for the
``host_bounce`` decision: how fast UCX (with the UCX_TLS of the environment) moves pinned host
memory, pageable host memory and GPU memory. Prints one JSON line per case.

    UCX_TLS=tcp,cuda_copy,self python3 benchmarks/nixl_host_bw.py --mb 256 --pieces 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_layerkv.transport.nixl import _mem, _new_agent  # noqa: E402


def _buffer(kind: str, nbytes: int, fill: int) -> torch.Tensor:
    if kind == "vram":
        return torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
    t.fill_(fill)
    return t


def _target(kind: str, nbytes: int, conn) -> None:
    agent = _new_agent("target", ["UCX"])
    buf = _buffer(kind, nbytes, 0)
    mem, dev = _mem([buf])
    agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), mem, dev))
    conn.recv()  # the initiator is done
    conn.send(bool((buf == 7).all().item()))


def run(kind: str, nbytes: int, pieces: int, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(kind, nbytes, theirs))
    proc.start()
    meta, remote_addr, rmem, rdev = mine.recv()
    agent = _new_agent("initiator", ["UCX"])
    buf = _buffer(kind, nbytes, 7)
    mem, dev = _mem([buf])
    agent.register_memory([(buf.data_ptr(), nbytes, dev, "")], mem)
    name = agent.add_remote_agent(meta)
    piece = nbytes // pieces
    rates = []
    for _ in range(iters):
        local = np.array([(buf.data_ptr() + i * piece, piece, dev) for i in range(pieces)],
                         dtype=np.uint64)
        remote = np.array([(remote_addr + i * piece, piece, rdev) for i in range(pieces)],
                          dtype=np.uint64)
        t = time.monotonic()
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, mem),
                                  agent.get_xfer_descs(remote, rmem), name)
        state = agent.transfer(h)
        while state == "PROC":
            time.sleep(1e-4)
            state = agent.check_xfer_state(h)
        rates.append(nbytes / (time.monotonic() - t) / 1e9)
        agent.release_xfer_handle(h)
    mine.send("done")
    exact = mine.recv()
    proc.join()
    return {"mem": kind, "UCX_TLS": os.environ.get("UCX_TLS", ""), "mb": nbytes >> 20,
            "pieces": pieces, "gbps": [round(r, 3) for r in rates], "state": state,
            "exact": exact}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="MiB per WRITE (default 256)")
    ap.add_argument("--pieces", type=int, default=4,
                    help="descriptors the WRITE is split into (default 4)")
    ap.add_argument("--iters", type=int, default=3, help="WRITEs timed per case (default 3)")
    ap.add_argument("--mem", nargs="+", default=["pinned", "pageable", "vram"],
                    help="memory kinds to measure (default: pinned pageable vram)")
    args = ap.parse_args()
    for kind in args.mem:
        print(json.dumps(run(kind, args.mb << 20, args.pieces, args.iters)), flush=True)
