"""Each connection end's hook (transport/hooks.py): nothing by default; with the fault
environment variable set in a process, the faults of vllm_layerkv.testing.faults, installed by
the transports that process builds. Checked in a child process, as a ``vllm serve`` worker of
the e2e fault tests gets it: a ``fault-write-`` transfer's write fails, a ``fault-noack-``
transfer's acknowledgement is dropped, other transfers go through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_layerkv.testing import faults
from vllm_layerkv.transport.hooks import ConnectionHook
from vllm_layerkv.transport.tcp import TcpTransport

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, threading, time

import torch

from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.transport import TransportError, create_transport
from vllm_layerkv.wire.protocol import CompatInfo, Hello, TransferAck


class Sink:
    tp_rank, tp_size = 0, 1

    def check_hello(self, hello):
        return None

    def begin_write(self, transfer_id, dst_blocks, source):
        return True

    def end_write(self, transfer_id, nbytes):
        pass

    def on_done(self, transfer_id, src_rank, src_tp, frames, nbytes, source=None):
        return TransferAck(transfer_id=transfer_id, ok=True)

    def on_nearly_done(self, transfer_id, src_rank, eta_s, source=None):
        pass

    def on_abort(self, transfer_id, reason, source=None):
        pass

    def on_source_lost(self, source, reason):
        pass


def blocks():
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 2, 16, 8, dtype=torch.uint8)
              for i in range(2)}
    return HostBlockIO(KVLayout.from_kv_caches(caches, 8))


compat = CompatInfo(vllm_version="0", model="m", dtype="uint8", kv_layout="HND", block_size=16,
                    num_kv_heads=2, head_size=8, num_layers=2, block_bytes=256)
d = create_transport("tcp", blocks())
endpoint = d.start_receiver("127.0.0.1", 0, Sink(), blocks(), 5.0)
acked, lost = [], []
channel = create_transport("tcp", blocks()).open_channel(
    endpoint, Hello(compat=compat, engine_id="p", tp_rank=0, tp_size=1), blocks(),
    on_ack=lambda ack: acked.append(ack.transfer_id), on_lost=lost.append, timeout=5.0,
    io_timeout=5.0)
out = {"hook": type(channel._hook).__name__}
for tid in ("fault-write-1", "plain-1"):
    try:
        out[tid] = channel.write_blocks(tid, [0, 1], [1, 2], [3, 4])
    except TransportError as e:
        out[tid] = str(e)
t0 = time.monotonic()
out["fault-slow-1"] = channel.write_blocks("fault-slow-1", [0, 1], [1, 2], [3, 4])
out["slow_write_s"] = time.monotonic() - t0
for tid in ("fault-noack-1", "plain-1"):
    channel.send_done(tid, 0, 1, 0)
deadline = time.monotonic() + 5.0
while "plain-1" not in acked and time.monotonic() < deadline:
    time.sleep(0.01)
out["acked"] = acked
out["lost"] = lost
channel.close()
d.shutdown()
print(json.dumps(out))
'''


def run_child(faults_on: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if faults_on:
        env[faults.ENV] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_environment_installs_the_fault_hook_in_a_child_process() -> None:
    out = run_child(faults_on=True)
    assert out["hook"] == "FaultHook"
    assert "injected write fault for fault-write-1" in out["fault-write-1"]
    assert out["plain-1"] == 2 * 2 * 256
    # a slow link: the write waits, then goes through whole
    assert out["fault-slow-1"] == 2 * 2 * 256
    assert out["slow_write_s"] >= faults.SLOW_WRITE_DELAY_S
    assert out["acked"] == ["plain-1"]  # fault-noack-1's ack was dropped by D
    assert out["lost"] == []


def test_without_the_variable_every_connection_gets_the_default_hook() -> None:
    out = run_child(faults_on=False)
    assert out["hook"] == "ConnectionHook"
    assert out["fault-write-1"] == out["plain-1"] == out["fault-slow-1"] == 2 * 2 * 256
    assert out["acked"] == ["fault-noack-1", "plain-1"]


def test_the_hook_is_chosen_when_the_transport_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    plain = TcpTransport()
    monkeypatch.setenv(faults.ENV, "1")
    faulty = TcpTransport()
    monkeypatch.delenv(faults.ENV)
    assert type(plain._new_hook()) is ConnectionHook
    assert type(faulty._new_hook()) is faults.FaultHook


def test_the_default_hook_lets_everything_through() -> None:
    from vllm_layerkv.wire.protocol import TransferAck, TransferNearlyDone

    hook = ConnectionHook()
    hook.before_write("fault-write-1")
    assert hook.sends(TransferAck(transfer_id="fault-noack-1", ok=True))
    assert hook.sends(TransferNearlyDone(transfer_id="fault-late-1", tp_rank=0, eta_s=0.1))
