"""The scheduler half, driven through real vLLM ``Scheduler`` instances (vLLM builds the LayerKV
scheduler connector itself), with real LayerKV worker connectors on CPU KV tensors moving the
bytes, and registration over real loopback sockets. See vllm_objects.py for the harness.

Every scenario ends with both schedulers holding no requests and every block free."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

import pytest
import torch
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm_objects import (
    BLOCK_SIZE,
    LAYER_NAMES,
    NUM_LAYERS,
    Engine,
    assert_connector_empty,
    assert_scheduler_empty,
    create_request,
    kv_value,
    salt,
)

from vllm_layerkv.scheduler.registrar import RegistrationServer
from vllm_layerkv.tasks import Peer, RecvTask, SendTask
from vllm_layerkv.wire.protocol import Cancel, Register, RegisterAck

P_EXTRA = {"min_prompt_tokens": 32, "registration_wait_s": 5.0, "group_size": 3}
CHUNK = 56  # max_num_batched_tokens on P: chunks end inside a block (56 = 3.5 blocks)


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(role: str, extra: dict | None = None, **kw) -> Engine:
        e = Engine.create(role, extra, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


@pytest.fixture
def fake_prefill():
    """A real RegistrationServer that records what a decode scheduler sends to 'P'."""
    servers = []

    def make() -> tuple[RegistrationServer, queue.SimpleQueue]:
        got: queue.SimpleQueue = queue.SimpleQueue()

        def on_register(reg: Register) -> RegisterAck:
            got.put(reg)
            return RegisterAck(transfer_id=reg.transfer_id, tp_size=1)

        server = RegistrationServer("127.0.0.1", 0, on_register, got.put)
        servers.append(server)
        return server, got

    yield make
    for s in servers:
        s.close()


def decode_params(tid: str, endpoint: str) -> dict:
    host, port = endpoint.rsplit(":", 1)
    return {"do_remote_prefill": True, "transfer_id": tid, "remote_host": host,
            "remote_port": int(port)}


def shift_block_ids(engine: Engine, num_tokens: int = 80) -> None:
    """Run a local request first so that this engine's next block ids differ from the
    other side's (otherwise src == dst would hide a mix-up)."""
    req = create_request(num_tokens, None, max_tokens=1)
    engine.scheduler.add_request(req)
    engine.run_until(lambda: req.request_id in engine.finished)
    engine.run_until(engine.idle)
    for t in engine.kv.values():  # forget what that request's forward wrote
        t.fill_(-1)


def wait_registration_arrived(p: Engine, timeout: float = 5.0, count: int = 1) -> None:
    """Until ``count`` of D's Registers are queued in P's scheduler (peeks at private state)."""
    incoming = p.connector._scheduler._prefill._incoming
    deadline = time.monotonic() + timeout
    while incoming.qsize() < count:
        assert time.monotonic() < deadline, "registration did not reach P"
        time.sleep(0.005)


def sends_of(engine: Engine) -> list[SendTask]:
    return [t for rec in engine.history for t in rec.meta.sends]


def reported(engine: Engine, attr: str, req_id: str) -> int:
    return sum(req_id in (getattr(rec.kv_output, attr) or ()) for rec in engine.history)


def assert_kv_arrived(d: Engine, rd, d_blocks: list[int]) -> None:
    """D's rows for every prompt token of ``rd`` hold exactly what P's forward computed for
    that prompt; blocks that are not the request's still hold D's fill value."""
    num_tokens = rd.num_prompt_tokens
    for layer in range(NUM_LAYERS):
        rows = d.token_rows(layer, d_blocks, num_tokens)
        want = torch.tensor([kv_value(t, layer, salt(rd)) for t in range(num_tokens)])
        assert torch.equal(rows[:, 0, 0], want), f"layer {layer}"
        assert torch.equal(rows, want[:, None, None].expand_as(rows)), f"layer {layer}"
        other = [b for b in range(d.kv_cache_config.num_blocks) if b not in d_blocks]
        assert (d.kv[LAYER_NAMES[layer]][other] == -1).all()


def run_both_until_idle(p: Engine, d: Engine, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not (p.idle() and d.idle()):
        assert time.monotonic() < deadline, (list(p.scheduler.requests),
                                             list(d.scheduler.requests))
        p.step()
        d.step()
        time.sleep(0.001)
    # and a few more steps: nothing comes back to life
    for _ in range(3):
        p.step()
        d.step()
    assert_scheduler_empty(p.scheduler)
    assert_scheduler_empty(d.scheduler)
    assert_connector_empty(p)
    assert_connector_empty(d)


def assert_all_empty(*engines: Engine) -> None:
    for e in engines:
        e.step()
        assert_scheduler_empty(e.scheduler)
        assert_connector_empty(e)


# ----------------------------------------------------------------------------- discovery


def test_discovery_returns_the_registration_endpoint(engines) -> None:
    p = engines("kv_producer")
    endpoint = p.endpoint
    host, port = endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    import socket
    socket.create_connection((host, int(port)), timeout=2).close()  # it is listening
    assert_all_empty(p)


def test_a_worker_sets_the_gil_switch_interval_it_is_given(engines) -> None:
    """gil_switch_interval_ms reaches the worker's process (here, this one)."""
    before = sys.getswitchinterval()
    try:
        engines("kv_producer", {"gil_switch_interval_ms": 0.25})
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(before)


# ----------------------------------------------------------------------------- happy path


def test_streamed_prefill_to_decode(engines) -> None:
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    shift_block_ids(d)
    prompt = 150  # 10 blocks: chunks of 56, 56, 38 tokens

    rd = create_request(prompt, decode_params("t1", endpoint), max_tokens=3, seed=5)
    d.scheduler.add_request(rd)
    rec = d.step()
    # D parks the request with blocks for the whole prompt and tells its worker what to expect
    assert rd.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = d.block_ids(rd.request_id)
    assert len(d_blocks) == 10
    assert rec.meta.recvs == [RecvTask(rd.request_id, "t1", d_blocks)]
    assert rec.num_scheduled == {}

    rp = create_request(prompt, {"do_remote_decode": True, "transfer_id": "t1"}, seed=5)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    p_blocks = p.block_ids(rp.request_id)
    assert len(p_blocks) == 10 and p_blocks != d_blocks

    # the Register reached P: one SendTask per chunk, P's blocks -> D's blocks, re-sending the
    # block each chunk ended in
    steps = [r for r in p.history if rp.request_id in r.num_scheduled]
    assert [r.num_scheduled[rp.request_id] for r in steps] == [56, 56, 38]
    assert [len(r.meta.sends) for r in steps] == [1, 1, 1]
    tasks = [r.meta.sends[0] for r in steps]
    for task, (lo, hi) in zip(tasks, [(0, 4), (3, 7), (7, 10)]):
        assert task.req_id == rp.request_id and task.transfer_id == "t1"
        assert task.src_blocks[0] == p_blocks[lo:hi]
        assert task.dst_blocks[0] == d_blocks[lo:hi]
        assert task.streamed is True
        assert task.peer.data_endpoints == [d.worker.get_handshake_metadata().data_endpoint]
    assert [t.final for t in tasks] == [False, False, True]
    assert [t.new_tokens for t in tasks] == [56, 56, 38]

    # P finished: it returns its params and keeps the blocks until the transfer is acked
    out = p.finished[rp.request_id]
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params == {"transfer_id": "t1", "layerkv_endpoint": endpoint}
    assert rp.request_id in p.scheduler.requests
    assert p.num_free_blocks() <= p.kv_cache_config.num_blocks - 1 - 10
    assert reported(p, "finished_sending", rp.request_id) == 0

    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert reported(d, "failed_recving", rd.request_id) == 0
    assert_kv_arrived(d, rd, d_blocks)

    run_both_until_idle(p, d)
    assert reported(p, "finished_sending", rp.request_id) == 1
    assert sum(rp.request_id == r for rec in p.history for r, _ in rec.meta.releases) == 1
    assert reported(d, "finished_recving", rd.request_id) == 1
    out = d.finished[rd.request_id]
    assert out.finish_reason == FinishReason.LENGTH and rd.num_output_tokens == 3
    assert len(sends_of(p)) == 3  # nothing sent after the final chunk


def test_groups_whose_hooks_never_fired_are_sent_by_wait_for_save(engines) -> None:
    """A FULL CUDA-graph replay runs the layers without the per-layer hooks: wait_for_save
    must still send every layer group of the step, so D gets all of the KV."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    p.layer_hooks = False
    d = engines("kv_consumer")
    shift_block_ids(d)
    rd = create_request(150, decode_params("t-graph", p.endpoint), max_tokens=2, seed=9)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    rp = create_request(150, {"do_remote_decode": True, "transfer_id": "t-graph"}, seed=9)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert reported(d, "failed_recving", rd.request_id) == 0
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)


def test_short_prompt_goes_whole_at_the_end_of_the_step(engines) -> None:
    # default min_prompt_tokens=256: a 40-token prompt is not layer-streamed
    p = engines("kv_producer", {"registration_wait_s": 5.0})
    d = engines("kv_consumer")
    endpoint = p.endpoint
    shift_block_ids(d, 48)
    rd = create_request(40, decode_params("short", endpoint), max_tokens=2, seed=9)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "short"}, seed=9)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    (task,) = sends_of(p)
    assert task.streamed is False and task.final is True and task.new_tokens == 40
    assert task.src_blocks[0] == p.block_ids(rp.request_id) and task.dst_blocks[0] == d_blocks
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)


def test_registration_after_prefill_finished_is_flushed(engines) -> None:
    p = engines("kv_producer", {"registration_wait_s": 0}, max_num_batched_tokens=64)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    rp = create_request(100, {"do_remote_decode": True, "transfer_id": "late"}, seed=3)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished)
    assert sends_of(p) == []
    for _ in range(3):  # P holds the blocks while it waits for the registration
        p.step()
    assert rp.request_id in p.scheduler.requests
    assert reported(p, "finished_sending", rp.request_id) == 0

    shift_block_ids(d)
    rd = create_request(100, decode_params("late", endpoint), max_tokens=1, seed=3)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    p.run_until(lambda: any(rec.meta.flushes for rec in p.history), others=(d,))
    flushes = [t for rec in p.history for t in rec.meta.flushes]
    assert len(flushes) == 1
    (flush,) = flushes
    assert flush.final and not flush.streamed
    assert flush.dst_blocks[0] == d_blocks and len(flush.src_blocks[0]) == 7
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)
    assert reported(p, "finished_sending", rp.request_id) == 1


# ----------------------------------------------------------------------------- router contracts


NIXL_STYLE_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False,
                      "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                      "remote_port": None}
"""What vllm-router --kv-connector nixl and vLLM's toy proxy send to P: no transfer id."""


def test_sequential_contract_mints_a_transfer_and_answers_decode_params(engines) -> None:
    """P answers first; the router copies P's kv_transfer_params into D's request verbatim."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    rp = create_request(150, dict(NIXL_STYLE_PREFILL), seed=9)
    p.scheduler.add_request(rp)
    assert rp.request_id in p.step().num_scheduled  # no wait for a registration not yet sent
    p.run_until(lambda: rp.request_id in p.finished)
    params = p.finished[rp.request_id].kv_transfer_params
    host, port = endpoint.rsplit(":", 1)
    assert params["transfer_id"].startswith("lkv-")
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode", "remote_host",
                                   "remote_port")} == {"do_remote_prefill": True,
                                                       "do_remote_decode": False,
                                                       "remote_host": host,
                                                       "remote_port": int(port)}
    assert rp.request_id in p.scheduler.requests  # blocks held for D under the lease
    assert sends_of(p) == []

    shift_block_ids(d)
    rd = create_request(150, dict(params), max_tokens=2, seed=9)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)
    assert reported(p, "finished_sending", rp.request_id) == 1


def test_decode_finds_prefill_through_its_bootstrap_endpoint(engines) -> None:
    """vllm-router --kv-connector mooncake / llm-d's mooncake mode: D gets P's bootstrap URL
    and engine id; P and D at once still stream KV as the prefill runs."""
    import json as _json
    import urllib.request

    from vllm_layerkv.testing.servers import free_port

    bootstrap = free_port()
    p = engines("kv_producer", {**P_EXTRA, "bootstrap_port": bootstrap},
                max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    with urllib.request.urlopen(f"http://127.0.0.1:{bootstrap}/query", timeout=5) as r:
        engine_id = _json.loads(r.read())["0"]["engine_id"]
    assert engine_id == str(p.vllm_config.kv_transfer_config.engine_id)
    shift_block_ids(d)
    rd = create_request(150, {"do_remote_decode": False, "do_remote_prefill": True,
                              "transfer_id": "xfer-b1",
                              "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
                              "remote_engine_id": engine_id}, max_tokens=2, seed=4)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    rp = create_request(150, {"do_remote_decode": True, "do_remote_prefill": False,
                              "transfer_id": "xfer-b1"}, seed=4)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    streamed = [t for t in sends_of(p) if t.transfer_id == "xfer-b1"]
    assert len(streamed) == 3 and all(t.streamed for t in streamed)  # one per chunk
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)


def test_unknown_bootstrap_engine_fails_the_decode_request_with_the_reason(engines) -> None:
    from vllm_layerkv.testing.servers import free_port

    bootstrap = free_port()
    engines("kv_producer", {"bootstrap_port": bootstrap})
    d = engines("kv_consumer")
    rd = create_request(40, {"do_remote_prefill": True, "transfer_id": "xfer-x",
                             "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
                             "remote_engine_id": "not-p"}, max_tokens=2)
    d.scheduler.add_request(rd)
    d.run_until(lambda: rd.request_id in d.finished)
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR  # policy fail
    closes = [c for rec in d.history for c in rec.meta.recv_closes]
    assert len(closes) == 1 and "knows no prefill engine 'not-p'" in closes[0].reason
    assert_all_empty(d)


def test_late_registrations_stop_the_wait_for_them(engines) -> None:
    """A router that sends D only after P's answer (vllm-router in mooncake mode): after a few
    registrations that come once their prefill has finished, P stops deferring prefills."""
    from vllm_layerkv.scheduler.prefill import LATE_REGISTRATION_STREAK

    p = engines("kv_producer", {"registration_wait_s": 0.05})
    d = engines("kv_consumer")
    endpoint = p.endpoint
    for i in range(LATE_REGISTRATION_STREAK):
        rp = create_request(40, {"do_remote_decode": True, "transfer_id": f"s{i}"}, seed=i)
        p.scheduler.add_request(rp)
        p.run_until(lambda: rp.request_id in p.finished)
        rd = create_request(40, decode_params(f"s{i}", endpoint), max_tokens=1, seed=i)
        d.scheduler.add_request(rd)
        d.run_until(lambda: rd.request_id in d.finished, others=(p,))
    run_both_until_idle(p, d)
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "next"})
    p.scheduler.add_request(rp)
    assert rp.request_id in p.step().num_scheduled  # not held back for a registration


@pytest.mark.parametrize("fallback,policy,finish", [
    ("local", "fail", FinishReason.LENGTH),
    ("fail", "fail", FinishReason.ERROR),
    ("fail", "recompute", FinishReason.LENGTH),
])
def test_a_remote_prefill_that_cannot_be_served_is_never_silent(
        engines, fallback: str, policy: str, finish: FinishReason) -> None:
    """NixlConnector's params reach a LayerKV decode instance: counted in the metrics, and
    served as remote_prefill_fallback (and vLLM's kv_load_failure_policy) say."""
    d = engines("kv_consumer", {"remote_prefill_fallback": fallback},
                kv_load_failure_policy=policy)
    nixl_params = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_block_ids": [1, 2, 3], "remote_engine_id": "e",
                   "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 1}
    reqs = [create_request(40, dict(nixl_params), max_tokens=2, seed=i) for i in range(2)]
    for r in reqs:
        d.scheduler.add_request(r)
    d.run_until(lambda: all(r.request_id in d.finished for r in reqs))
    for r in reqs:
        out = d.finished[r.request_id]
        assert out.finish_reason == finish
        if out.kv_transfer_params is not None:  # vLLM answers a failed request without them
            assert "transfer_id" in out.kv_transfer_params["layerkv_error"]
    closes = [c for rec in d.history for c in rec.meta.recv_closes]
    if fallback == "fail":  # the reason travels with the failed transfer (and D's log)
        assert len(closes) == 2 and all("transfer_id" in c.reason for c in closes)
    else:
        assert closes == [] and not any(rec.meta.recvs for rec in d.history)
    # vLLM's scheduler takes the count each step, as it sums it for /metrics
    reported_stats = [s for rec in d.history for s in rec.kv_connector_stats]
    assert sum(s.get("remote_prefill_fallbacks", 0) for s in reported_stats) == 2
    assert d.connector.get_kv_connector_stats() is None  # nothing counted twice
    assert_all_empty(d)


# ----------------------------------------------------------------------------- decode failures


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_timeout_fails_the_request_and_cancels(engines, fake_prefill, policy) -> None:
    server, got = fake_prefill()
    d = engines("kv_consumer", {"kv_wait_timeout_s": 0.3}, kv_load_failure_policy=policy)
    rd = create_request(40, decode_params("slow", server.endpoint), max_tokens=2)
    d.scheduler.add_request(rd)
    d.step()
    assert rd.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    reg = got.get(timeout=5)
    assert isinstance(reg, Register) and reg.transfer_id == "slow"
    assert reg.block_ids[0] == d.block_ids(rd.request_id) and reg.num_tokens == 40
    assert reg.start_token == 0 and reg.tp_size == 1

    time.sleep(0.35)
    rec = d.step()
    assert len(rec.meta.recv_closes) == 1
    close = rec.meta.recv_closes[0]
    assert (close.req_id, close.transfer_id, close.failed) == (rd.request_id, "slow", True)
    assert "kv_wait_timeout_s" in close.reason
    # the worker closed the transfer in bind and reported it in the same step
    assert rd.request_id in rec.kv_output.failed_recving
    assert rd.request_id in rec.kv_output.finished_recving
    cancel = got.get(timeout=5)
    assert isinstance(cancel, Cancel) and cancel.transfer_id == "slow"
    assert "kv_wait_timeout_s" in cancel.reason

    d.run_until(d.idle)
    if policy == "fail":
        assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
        assert rd.num_output_tokens == 0
    else:  # recomputed locally
        assert d.finished[rd.request_id].finish_reason == FinishReason.LENGTH
        assert rd.num_output_tokens == 2
    for _ in range(3):
        d.step()
    assert_all_empty(d)
    assert reported(d, "failed_recving", rd.request_id) == 1


def test_decode_abort_while_waiting_cancels_at_prefill(engines, fake_prefill) -> None:
    server, got = fake_prefill()
    d = engines("kv_consumer")
    rd = create_request(40, decode_params("gone", server.endpoint), max_tokens=2)
    d.scheduler.add_request(rd)
    d.step()
    assert isinstance(got.get(timeout=5), Register)
    d.scheduler.finish_requests(rd.request_id, RequestStatus.FINISHED_ABORTED)
    cancel = got.get(timeout=5)
    assert cancel == Cancel(transfer_id="gone", reason="decode request aborted")
    # vLLM keeps D's blocks until the worker confirms no write into them can happen any more
    assert rd.request_id in d.scheduler.requests
    rec = d.step()
    assert [(c.req_id, c.failed) for c in rec.meta.recv_closes] == [(rd.request_id, False)]
    assert rec.kv_output.finished_recving == {rd.request_id}
    assert not rec.kv_output.failed_recving
    assert_all_empty(d)


def test_decode_abort_mid_stream_stops_the_prefill_sends(engines) -> None:
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    rd = create_request(150, decode_params("cut", endpoint), max_tokens=2, seed=4)
    d.scheduler.add_request(rd)
    d.step()
    rp = create_request(150, {"do_remote_decode": True, "transfer_id": "cut"}, seed=4)
    p.scheduler.add_request(rp)
    p.run_until(lambda: len(sends_of(p)) == 1, others=(d,))
    d.scheduler.finish_requests(rd.request_id, RequestStatus.FINISHED_ABORTED)
    p.run_until(lambda: any(rec.meta.aborts for rec in p.history), others=(d,))
    aborts = [a for rec in p.history for a in rec.meta.aborts]
    assert len(aborts) == 1
    tid, reason, peer = aborts[0]
    assert tid == "cut" and "cancelled by decode" in reason
    assert isinstance(peer, Peer) and peer.data_endpoints == [
        d.worker.get_handshake_metadata().data_endpoint]
    n_sends = len(sends_of(p))
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    assert len(sends_of(p)) == n_sends  # P plans nothing more for the cancelled transfer
    assert p.finished[rp.request_id].finish_reason == FinishReason.LENGTH
    run_both_until_idle(p, d)
    assert rd.request_id not in d.finished or \
        d.finished[rd.request_id].finish_reason == FinishReason.ABORT


def test_prefill_abort_while_streaming_fails_decode(engines) -> None:
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    rd = create_request(150, decode_params("pa", endpoint), max_tokens=2, seed=6)
    d.scheduler.add_request(rd)
    d.step()
    rp = create_request(150, {"do_remote_decode": True, "transfer_id": "pa"}, seed=6)
    p.scheduler.add_request(rp)
    p.run_until(lambda: len(sends_of(p)) == 1, others=(d,))
    p.scheduler.finish_requests(rp.request_id, RequestStatus.FINISHED_ABORTED)
    # P keeps the blocks (a send may still read them) and tells its worker to abort
    assert rp.request_id in p.scheduler.requests
    rec = p.step()
    assert len(rec.meta.aborts) == 1
    tid, reason, peer = rec.meta.aborts[0]
    assert tid == "pa" and "aborted" in reason
    assert peer.data_endpoints == [d.worker.get_handshake_metadata().data_endpoint]
    assert rec.meta.releases == [(rp.request_id, "pa")]
    d.run_until(lambda: rd.request_id in d.finished, others=(p,))
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
    assert reported(d, "failed_recving", rd.request_id) == 1
    run_both_until_idle(p, d)
    assert reported(p, "finished_sending", rp.request_id) == 1
    assert len(sends_of(p)) == 1


def test_registration_refused_on_mismatch(engines) -> None:
    p = engines("kv_producer")
    d = engines("kv_consumer", dtype=torch.float16)  # KV cache dtype differs from P's
    endpoint = p.endpoint
    rd = create_request(40, decode_params("mm", endpoint), max_tokens=2)
    d.scheduler.add_request(rd)
    d.run_until(lambda: rd.request_id in d.finished, others=(p,))
    closes = [c for rec in d.history for c in rec.meta.recv_closes]
    assert len(closes) == 1 and closes[0].failed
    # P's refusal names every differing field, never its values (those are in P's log)
    assert "dtype, block_bytes" in closes[0].reason
    assert "float" not in closes[0].reason and "16384" not in closes[0].reason
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
    run_both_until_idle(p, d)


def test_unreachable_prefill_fails_the_request(engines) -> None:
    import socket
    with socket.socket() as s:  # bound but not listening: connection refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        d = engines("kv_consumer")
        rd = create_request(40, decode_params("nowhere", endpoint), max_tokens=2)
        d.scheduler.add_request(rd)
        d.run_until(lambda: rd.request_id in d.finished)
    (close,) = [c for rec in d.history for c in rec.meta.recv_closes]
    assert close.failed and f"cannot reach the prefill instance at {endpoint}" in close.reason
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
    assert_all_empty(d)


# ----------------------------------------------------------------------------- bad params


@pytest.mark.parametrize("role,params,field", [
    ("kv_producer", {"do_remote_decode": True, "transfer_id": ""}, "transfer_id"),
    ("kv_producer", {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "x"},
     "do_remote_prefill"),
    ("kv_producer", {"do_remote_prefill": True, "transfer_id": "x", "remote_host": "h",
                     "remote_port": 1}, "kv_producer"),
    ("kv_consumer", {"do_remote_prefill": True, "transfer_id": "x", "remote_host": "h",
                     "remote_port": "http"}, "remote_port"),
    ("kv_consumer", {"do_remote_prefill": True, "transfer_id": "x", "remote_port": 80},
     "remote_host"),
    ("kv_consumer", {"do_remote_decode": True, "transfer_id": "x"}, "kv_consumer"),
])
def test_malformed_params_are_served_locally(engines, role, params, field) -> None:
    e = engines(role)
    req = create_request(40, params, max_tokens=2)
    e.scheduler.add_request(req)
    e.step()
    assert req.status == RequestStatus.RUNNING  # not parked, not deferred
    e.run_until(lambda: req.request_id in e.finished)
    out = e.finished[req.request_id]
    assert out.finish_reason == FinishReason.LENGTH and req.num_output_tokens == 2
    assert set(out.kv_transfer_params) == {"layerkv_error"}
    assert field in out.kv_transfer_params["layerkv_error"]
    assert not any(rec.meta.sends or rec.meta.recvs for rec in e.history)
    assert_all_empty(e)


def test_plain_request_has_no_params(engines) -> None:
    e = engines("kv_producer")
    req = create_request(20, None, max_tokens=1)
    e.scheduler.add_request(req)
    e.run_until(e.idle)
    assert e.finished[req.request_id].kv_transfer_params is None
    assert_all_empty(e)


def test_block_size_in_compat_is_the_schedulers(engines) -> None:
    p = engines("kv_producer")
    assert p.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size == BLOCK_SIZE


def test_decode_prefix_cache_hit_receives_only_the_tail(engines) -> None:
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    endpoint = p.endpoint
    shift_block_ids(d)
    for tid in ("first", "second"):  # the same 150-token prompt twice
        rd = create_request(150, decode_params(tid, endpoint), max_tokens=1, seed=8)
        d.scheduler.add_request(rd)
        d.step()
        d_blocks = d.block_ids(rd.request_id)
        rp = create_request(150, {"do_remote_decode": True, "transfer_id": tid}, seed=8)
        p.scheduler.add_request(rp)
        d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
        assert_kv_arrived(d, rd, d_blocks)
        run_both_until_idle(p, d)
    first, second = [[t for t in sends_of(p) if t.transfer_id == tid]
                     for tid in ("first", "second")]
    assert [len(t.src_blocks[0]) for t in first] == [4, 4, 3]
    # D had 9 full blocks (144 tokens) cached: P sends only block 9, never D's cached blocks
    (tail,) = second
    assert tail.new_tokens == 6 and tail.final
    assert len(tail.src_blocks[0]) == 1 and tail.dst_blocks[0] == d_blocks[9:10]


def test_prefill_prefix_cache_hit_still_sends_the_whole_prompt(engines) -> None:
    """P computed this prompt before (for another D): it now computes only the last 6 tokens,
    and the 9 blocks it had cached still go to the new D, which has none of them."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    for tid in ("warm-p", "cold-d"):  # the same 150-token prompt twice, to two decode instances
        d = engines("kv_consumer")
        shift_block_ids(d)
        rd = create_request(150, decode_params(tid, p.endpoint), max_tokens=1, seed=12)
        d.scheduler.add_request(rd)
        d.step()
        d_blocks = d.block_ids(rd.request_id)
        rp = create_request(150, {"do_remote_decode": True, "transfer_id": tid}, seed=12)
        p.scheduler.add_request(rp)
        d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
        assert reported(d, "failed_recving", rd.request_id) == 0
        assert_kv_arrived(d, rd, d_blocks)
        run_both_until_idle(p, d)
    steps = [r for r in p.history if rp.request_id in r.num_scheduled]
    assert [r.num_scheduled[rp.request_id] for r in steps] == [6]  # P's cache held 144 tokens
    (task,) = [t for t in sends_of(p) if t.transfer_id == "cold-d"]
    assert task.new_tokens == 150 and task.final  # what D lacks, not what P computed
    assert task.dst_blocks[0] == d_blocks and len(task.src_blocks[0]) == 10


def test_one_prefill_feeds_two_decode_instances_at_once(engines) -> None:
    """1P2D: two requests in P's same steps, each streamed to its own decode instance."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=2 * CHUNK)
    ds = [engines("kv_consumer"), engines("kv_consumer")]
    shift_block_ids(ds[1], 160)  # the two D's block ids differ from each other and from P's
    endpoint = p.endpoint  # a discovery request: P steps, so only before the registrations
    rds, d_blocks = [], []
    for i, d in enumerate(ds):
        rd = create_request(150, decode_params(f"t-{i}", endpoint), max_tokens=2, seed=20 + i)
        d.scheduler.add_request(rd)
        d.step()
        rds.append(rd)
        d_blocks.append(d.block_ids(rd.request_id))
    # both registrations first: one that came late would hold its prompt back until the other
    # prompt had finished (as on a loaded machine), and the two would never share a step
    wait_registration_arrived(p, count=2)
    rps = [create_request(150, {"do_remote_decode": True, "transfer_id": f"t-{i}"},
                          seed=20 + i) for i in range(2)]
    for rp in rps:
        p.scheduler.add_request(rp)
    p.run_until(lambda: all(rp.request_id in p.finished for rp in rps), others=tuple(ds))
    both = [r for r in p.history if all(rp.request_id in r.num_scheduled for rp in rps)]
    assert both, "the two prompts never shared a step"
    for d, rd, blocks in zip(ds, rds, d_blocks):
        d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
        assert reported(d, "failed_recving", rd.request_id) == 0
        assert_kv_arrived(d, rd, blocks)
    for i, task in enumerate(t for t in sends_of(p) if t.final):
        assert task.transfer_id == f"t-{i}"
        assert task.peer.data_endpoints == [ds[i].worker.get_handshake_metadata().data_endpoint]
    deadline = time.monotonic() + 15
    while not all(e.idle() for e in (p, *ds)):
        assert time.monotonic() < deadline
        for e in (p, *ds):
            e.step()
    assert_all_empty(p, *ds)


def test_duplicate_transfer_id_is_served_locally(engines) -> None:
    p = engines("kv_producer", {"registration_wait_s": 0, "registration_timeout_s": 0.3},
                max_num_batched_tokens=256)
    r1 = create_request(40, {"do_remote_decode": True, "transfer_id": "dup"}, seed=1)
    r2 = create_request(40, {"do_remote_decode": True, "transfer_id": "dup"}, seed=2)
    p.scheduler.add_request(r1)
    p.scheduler.add_request(r2)
    p.run_until(lambda: r1.request_id in p.finished and r2.request_id in p.finished)
    assert set(p.finished[r1.request_id].kv_transfer_params) == {"transfer_id",
                                                                 "layerkv_endpoint"}
    err = p.finished[r2.request_id].kv_transfer_params["layerkv_error"]
    assert "transfer_id 'dup' is already in use" in err
    # r1 holds its blocks for a decode registration; r2 was freed at once
    assert r1.request_id in p.scheduler.requests and r2.request_id not in p.scheduler.requests
    p.run_until(p.idle)  # registration_timeout_s: P gives up on r1
    assert_all_empty(p)


def test_registration_racing_the_hold_expiry_is_not_lost(engines) -> None:
    p = engines("kv_producer", {"registration_wait_s": 0, "registration_timeout_s": 0.2})
    d = engines("kv_consumer", {"kv_wait_timeout_s": 60})
    endpoint = p.endpoint
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "race"}, seed=2)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished)
    time.sleep(0.25)
    so = p.scheduler.schedule()  # P gives up: the release goes to its worker this step
    assert so.kv_connector_metadata.releases == [(rp.request_id, "race")]
    # ... and while that step's forward runs, D's registration arrives and is acknowledged
    rd = create_request(40, decode_params("race", endpoint), max_tokens=2, seed=2)
    d.scheduler.add_request(rd)
    d.step()
    wait_registration_arrived(p)
    p.execute(so)  # finished_sending: P frees the blocks and forgets the transfer
    assert p.idle()
    # D must learn that no KV will come (refusal or abort), not wait kv_wait_timeout_s
    d.run_until(lambda: rd.request_id in d.finished, others=(p,), timeout=5)
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR


@pytest.mark.parametrize("runner", [
    "v1",
    "v2",  # MRv2 lists a resumed request among the new ones
])
def test_prefill_preempted_mid_stream_resends_from_its_new_blocks(engines, runner) -> None:
    # 11 usable blocks on P: the prompt needs 10, a local request growing alongside it
    # forces vLLM to preempt the prefill (the later request) and resume it afterwards
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK, num_blocks=12)
    # The MRv2 scheduler output shape; vLLM cannot build an MRv2 config without Triton
    p.scheduler.use_v2_model_runner = runner == "v2"
    d = engines("kv_consumer")
    endpoint = p.endpoint
    rd = create_request(150, decode_params("pre", endpoint), max_tokens=2, seed=5)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    wait_registration_arrived(p)  # so P's block schedule (and the preemption) is deterministic
    local = create_request(16, None, max_tokens=60, seed=11)
    rp = create_request(150, {"do_remote_decode": True, "transfer_id": "pre"}, seed=5)
    assert salt(local) != salt(rp)
    p.scheduler.add_request(local)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,), timeout=30)
    assert rp.num_preemptions == 1  # the scenario really happened
    final = sends_of(p)[-1]
    lo = 10 - len(final.src_blocks[0])
    assert final.final and final.src_blocks[0] == p.block_ids(rp.request_id)[lo:]
    assert final.dst_blocks[0] == d_blocks[lo:]
    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)


def test_prefill_aborted_while_deferred_fails_decode_at_once(engines) -> None:
    p = engines("kv_producer", {"registration_wait_s": 30})
    d = engines("kv_consumer", {"kv_wait_timeout_s": 60})
    endpoint = p.endpoint
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "def"}, seed=3)
    p.scheduler.add_request(rp)
    for _ in range(3):
        assert p.step().num_scheduled == {}  # deferred: waiting for D's registration
    rd = create_request(40, decode_params("def", endpoint), max_tokens=2, seed=3)
    d.scheduler.add_request(rd)
    d.step()
    wait_registration_arrived(p)
    p.scheduler.finish_requests(rp.request_id, RequestStatus.FINISHED_ABORTED)
    t0 = time.monotonic()
    d.run_until(lambda: rd.request_id in d.finished, others=(p,), timeout=10)
    assert time.monotonic() - t0 < 5  # told through its data endpoint, not kv_wait_timeout_s
    assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
    run_both_until_idle(p, d)
    assert sends_of(p) == []


# ----------------------------------------------------------------------------- hybrid models


def _rows(engine: Engine, layer: int, blocks: list[int], tokens: range) -> torch.Tensor:
    t = engine.kv[LAYER_NAMES[layer]]
    return torch.stack([t[blocks[i // BLOCK_SIZE], :, i % BLOCK_SIZE, :] for i in tokens])


@pytest.mark.parametrize("state_views", [False, True], ids=["state-tensor", "state-views"])
def test_mamba_hybrid_sends_state_once_after_the_last_chunk(engines, state_views) -> None:
    """Even layers Mamba (one state slot per request), odd layers full attention. P computes
    the prompt minus its last token; the state slot goes once, with the last chunk, and holds
    h(N-1) on D; D computes token N-1 itself. The first layer is a Mamba layer, registered as
    one tensor (vLLM 0.32+) or as vLLM 0.26's list of state views."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK, hybrid="mamba",
                mamba_state_views=state_views)
    d = engines("kv_consumer", hybrid="mamba", mamba_state_views=state_views)
    endpoint = p.endpoint
    shift_block_ids(d)
    prompt = 150

    rd = create_request(prompt, decode_params("h1", endpoint), max_tokens=3, seed=9)
    d.scheduler.add_request(rd)
    rec = d.step()
    assert rd.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert rd.num_computed_tokens == prompt - 1  # D loads N-1 tokens
    d_state, d_attn = d.block_ids(rd.request_id, 0), d.block_ids(rd.request_id, 1)
    assert len(d_attn) == 10 and d_state[-1] != 0
    assert sorted(rec.meta.recvs[0].block_ids) == sorted(set(d_state + d_attn) - {0})

    rp = create_request(prompt, {"do_remote_decode": True, "transfer_id": "h1"}, seed=9)
    p.scheduler.add_request(rp)
    assert rp.num_prompt_tokens == prompt - 1 and rp.max_tokens == 1  # the backoff
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    p_state = p.block_ids(rp.request_id, 0)[-1:]
    steps = [r for r in p.history if rp.request_id in r.num_scheduled]
    assert [r.num_scheduled[rp.request_id] for r in steps] == [56, 56, 37]
    tasks = [r.meta.sends[0] for r in steps]
    assert [t.src_blocks[0] for t in tasks] == [[], [], p_state]  # state: once, at the end
    assert [t.dst_blocks[0] for t in tasks] == [[], [], d_state[-1:]]
    assert [len(t.src_blocks[1]) for t in tasks] == [4, 4, 3]  # attention streams

    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert reported(d, "failed_recving", rd.request_id) == 0
    s = salt(rd)
    for layer in range(NUM_LAYERS):
        if layer % 2 == 0:  # state after tokens [0, N-1): what P computed last
            state = d.kv[LAYER_NAMES[layer]][d_state[-1]]
            assert (state == kv_value(prompt - 2, layer, s)).all(), f"layer {layer}"
        else:
            want = torch.tensor([kv_value(t, layer, s) for t in range(prompt - 1)])
            rows = _rows(d, layer, d_attn, range(prompt - 1))
            assert torch.equal(rows, want[:, None, None].expand_as(rows)), f"layer {layer}"
    run_both_until_idle(p, d)
    d_steps = [r.num_scheduled[rd.request_id] for r in d.history
               if rd.request_id in r.num_scheduled]
    assert d_steps[0] == 1  # D computed the last prompt token itself
    assert d.finished[rd.request_id].finish_reason == FinishReason.LENGTH
    assert len(sends_of(p)) == 3


def test_sliding_window_sends_only_the_tail_after_the_last_chunk(engines) -> None:
    """Even layers sliding window (32 tokens), odd layers full attention. P frees blocks that
    left the window while it prefills; the window's blocks go once, with the last chunk."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK, hybrid="sliding")
    d = engines("kv_consumer", hybrid="sliding")
    endpoint = p.endpoint
    shift_block_ids(d)
    prompt = 150

    rd = create_request(prompt, decode_params("w1", endpoint), max_tokens=3, seed=11)
    d.scheduler.add_request(rd)
    d.step()
    d_swa, d_full = d.block_ids(rd.request_id, 0), d.block_ids(rd.request_id, 1)
    rp = create_request(prompt, {"do_remote_decode": True, "transfer_id": "w1"}, seed=11)
    p.scheduler.add_request(rp)
    assert rp.num_prompt_tokens == prompt  # no backoff without state
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    p_swa = p.block_ids(rp.request_id, 0)
    assert p_swa[:5] == [0] * 5  # vLLM freed the blocks that left the window
    steps = [r for r in p.history if rp.request_id in r.num_scheduled]
    tasks = [r.meta.sends[0] for r in steps]
    # tokens [150 - 32, 150) = blocks 7..9
    assert [t.src_blocks[0] for t in tasks] == [[], [], p_swa[7:10]]
    assert [t.dst_blocks[0] for t in tasks] == [[], [], d_swa[7:10]]
    assert [len(t.src_blocks[1]) for t in tasks] == [4, 4, 3]

    d.run_until(lambda: reported(d, "finished_recving", rd.request_id) == 1, others=(p,))
    assert reported(d, "failed_recving", rd.request_id) == 0
    s = salt(rd)
    for layer in range(NUM_LAYERS):
        blocks, tokens = (d_swa, range(prompt - 32, prompt)) if layer % 2 == 0 else \
            (d_full, range(prompt))
        want = torch.tensor([kv_value(t, layer, s) for t in tokens])
        rows = _rows(d, layer, blocks, tokens)
        assert torch.equal(rows, want[:, None, None].expand_as(rows)), f"layer {layer}"
    run_both_until_idle(p, d)
    assert d.finished[rd.request_id].finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------------ idle back-off


def _empty_step_seconds(p: Engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.monotonic()
        assert p.step().num_scheduled == {}
        out.append(time.monotonic() - t0)
    return out


@pytest.mark.parametrize("setting", ["on", "auto"])  # these engines run on CPU: auto is on
def test_idle_backoff_slows_empty_steps_while_p_waits_and_a_registration_ends_it(
        engines, setting) -> None:
    """A prefill deferred for its registration: P's empty steps wait longer and longer (they
    would starve whatever shares the cores), and the registration wakes the wait at once."""
    from vllm_layerkv.scheduler.prefill import IDLE_WAIT_MIN_S

    p = engines("kv_producer", {"registration_wait_s": 30, "idle_backoff": setting})
    d = engines("kv_consumer")
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "bo"}, seed=5)
    p.scheduler.add_request(rp)
    waits = _empty_step_seconds(p, 5)
    assert waits[0] >= IDLE_WAIT_MIN_S * 0.9
    assert waits[-1] >= 8 * IDLE_WAIT_MIN_S * 0.9  # 10, 20, 40, 80, 160 ms
    rd = create_request(40, decode_params("bo", p.endpoint), max_tokens=2, seed=5)
    d.scheduler.add_request(rd)
    d.step()
    t0 = time.monotonic()
    while not p.step().num_scheduled:  # woken by the registration, then scheduled
        assert time.monotonic() - t0 < 2.0
    assert time.monotonic() - t0 < 0.5
    run_both_until_idle(p, d)


def test_idle_backoff_off_leaves_empty_steps_alone(engines) -> None:
    """GPU default (auto resolves to off there): P's empty steps never back off; each waits
    at most DEFERRAL_WAIT_S for the registration."""
    from vllm_layerkv.scheduler.prefill import DEFERRAL_WAIT_S

    p = engines("kv_producer", {"registration_wait_s": 30, "idle_backoff": "off"})
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "nb"}, seed=6)
    p.scheduler.add_request(rp)
    waits = _empty_step_seconds(p, 5)
    assert min(waits) >= DEFERRAL_WAIT_S * 0.9 and max(waits) < 0.05
    p.scheduler.finish_requests(rp.request_id, RequestStatus.FINISHED_ABORTED)
    p.run_until(p.idle)


HELD_RELAY = """
import socket, sys, threading
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
d_side, _ = listener.accept()
p_side = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
gate = threading.Event()
gate.set()
def pump(src, dst, gated):
    while data := src.recv(65536):
        if gated:
            gate.wait()
        dst.sendall(data)
threading.Thread(target=pump, args=(p_side, d_side, False), daemon=True).start()
threading.Thread(target=pump, args=(d_side, p_side, True), daemon=True).start()
for line in sys.stdin:
    gate.clear() if line.strip() == "hold" else gate.set()
    print(line.strip(), flush=True)
"""
"""A TCP relay from D to P in a process of its own: ``hold`` stops D's bytes (they wait in the
relay), ``go`` lets them through; it answers each command once it is in force."""


def test_deferred_prefill_starts_soon_after_its_registration_while_steps_spin(engines) -> None:
    """Without idle_backoff vLLM runs P's empty steps back to back, holding the GIL; P's
    registration server threads must still get it as soon as D's registration is on the
    socket, not after the interpreter's switch interval (set to 0.2 s here to make that stand
    out; CPython's default is 5 ms). The registration comes from another process, as D's
    does (a relay holds it until P's steps spin), over a connection a first request made."""
    import subprocess
    import sys

    p = engines("kv_producer", {"registration_wait_s": 30, "idle_backoff": "off"})
    d = engines("kv_consumer")
    relay = subprocess.Popen([sys.executable, "-c", HELD_RELAY, p.endpoint.rsplit(":", 1)[1]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def tell(command: str) -> None:
        relay.stdin.write(command + "\n")
        relay.stdin.flush()
        assert relay.stdout.readline().strip() == command

    def request(tid: str, seed: int):
        rp = create_request(40, {"do_remote_decode": True, "transfer_id": tid}, seed=seed)
        rd = create_request(40, decode_params(tid, relay_endpoint), max_tokens=2, seed=seed)
        return rp, rd

    try:
        relay_endpoint = f"127.0.0.1:{relay.stdout.readline().strip()}"
        rp, rd = request("warm", 6)  # D connects to P through the relay
        p.scheduler.add_request(rp)
        d.scheduler.add_request(rd)
        run_both_until_idle(p, d)
        tell("hold")
        rp, rd = request("gil", 7)
        p.scheduler.add_request(rp)
        assert p.step().num_scheduled == {}  # deferred: waiting for D's registration
        d.scheduler.add_request(rd)
        d.step()  # D sends its registration, into the relay
        before = sys.getswitchinterval()
        sys.setswitchinterval(0.2)
        try:
            tell("go")
            t0 = time.monotonic()
            while not p.step().num_scheduled:  # back to back, as vLLM's engine loop runs them
                assert time.monotonic() - t0 < 10.0
            took = time.monotonic() - t0
        finally:
            sys.setswitchinterval(before)
        assert took < 0.1, f"P started the prefill {took * 1e3:.0f} ms after D registered"
        run_both_until_idle(p, d)
    finally:
        relay.kill()
        relay.wait()


def test_idle_prefill_is_admitted_in_the_pass_its_registration_arrives(engines, monkeypatch
                                                                        ) -> None:
    """P idle: the pass that finds a prefill without its registration waits for it and admits
    the request at once, instead of after an empty step and another pass. The budget is large
    here so that a slow CI host cannot miss it; the wait ends when the registration comes."""
    from vllm_layerkv.scheduler import prefill

    monkeypatch.setattr(prefill, "ADMISSION_WAIT_S", 5.0)
    p = engines("kv_producer", {"registration_wait_s": 30, "idle_backoff": "off"})
    d = engines("kv_consumer")
    rp = create_request(40, {"do_remote_decode": True, "transfer_id": "inpass"}, seed=8)
    rd = create_request(40, decode_params("inpass", p.endpoint), max_tokens=2, seed=8)
    p.scheduler.add_request(rp)

    def decode_registers() -> None:
        time.sleep(0.2)  # P is in its pass by now
        d.scheduler.add_request(rd)
        d.step()

    t = threading.Thread(target=decode_registers)
    t.start()
    t0 = time.monotonic()
    rec = p.step()
    took = time.monotonic() - t0
    t.join()
    assert rec.num_scheduled == {rp.request_id: 40}, f"P did not admit it in the same pass ({took})"
    assert 0.15 < took < 4.0, f"the pass took {took:.2f} s"
    run_both_until_idle(p, d)


def test_a_busy_prefill_instance_does_not_wait_in_its_pass(engines, monkeypatch) -> None:
    """While P runs a prefill, a new request without its registration is deferred at once: a
    wait in the pass would hold the running prefill's next chunk up. The pass here has token
    budget left after the running prefill's last chunk, so vLLM asks about the new requests.
    Once P is idle, one budget serves every deferred request of a pass."""
    from vllm_layerkv.scheduler import prefill

    monkeypatch.setattr(prefill, "ADMISSION_WAIT_S", 1.0)
    p = engines("kv_producer", {**P_EXTRA, "registration_wait_s": 30, "idle_backoff": "off"},
                max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    long_p = create_request(150, {"do_remote_decode": True, "transfer_id": "busy"}, seed=9)
    long_d = create_request(150, decode_params("busy", p.endpoint), max_tokens=2, seed=9)
    d.scheduler.add_request(long_d)
    d.step()
    wait_registration_arrived(p)
    p.scheduler.add_request(long_p)
    for _ in range(2):  # chunks of 56 and 56 tokens; 38 are left
        assert p.step().num_scheduled == {long_p.request_id: CHUNK}
    late = [create_request(8, {"do_remote_decode": True, "transfer_id": f"late{i}"}, seed=i)
            for i in range(2)]
    for r in late:
        p.scheduler.add_request(r)
    asked = []
    original = p.connector._scheduler._prefill.should_defer
    monkeypatch.setattr(p.connector._scheduler._prefill, "should_defer",
                        lambda req_id, params, intake=None: asked.append(req_id)
                        or original(req_id, params, intake))
    t0 = time.monotonic()
    rec = p.step()
    assert rec.num_scheduled == {long_p.request_id: 150 - 2 * CHUNK}  # the late ones deferred
    assert asked == [r.request_id for r in late]
    assert time.monotonic() - t0 < 0.8, "a busy P waited in its pass"
    assert long_p.request_id in p.finished
    t0 = time.monotonic()
    assert p.step().num_scheduled == {}  # idle now: one budget for both deferred requests
    assert 0.95 < time.monotonic() - t0 < 1.8
    for r in late:
        p.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    run_both_until_idle(p, d)


# ------------------------------------------------------------------------- early release


def recv_table(d: Engine):
    """D's RecvTable (private): where the transport's TransferNearlyDone lands."""
    return d.worker._worker._decode._table


def park_nearly_done(d: Engine, server, got, tid: str):
    """A decode request for ``tid`` registered with the fake prefill ``server`` and parked for
    its KV, for which P's TransferNearlyDone (due now) has arrived and nothing else."""
    rd = create_request(40, decode_params(tid, server.endpoint), max_tokens=2)
    d.scheduler.add_request(rd)
    d.step()
    assert isinstance(got.get(timeout=5), Register)
    recv_table(d).on_nearly_done(tid, 0, 0.0)
    return rd


def test_early_release_reports_first_and_the_first_step_waits_for_the_kv(engines) -> None:
    """P said the transfer is nearly done: D's empty step reports it to vLLM before the KV is
    complete, and the step that runs the request waits in bind (before the forward) until it
    is; the request is reported once and decodes on P's KV."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer", {"early_release_lead_ms": 0})
    endpoint = p.endpoint
    shift_block_ids(d)
    rd = create_request(150, decode_params("t-early", endpoint), max_tokens=3, seed=5)
    d.scheduler.add_request(rd)
    d.step()
    d_blocks = d.block_ids(rd.request_id)
    recv_table(d).on_nearly_done("t-early", 0, 0.0)  # as P's sender would, before it starts
    rec = d.step()
    assert rec.num_scheduled == {}
    assert rd.request_id in rec.kv_output.finished_recving  # reported with no KV yet

    rp = create_request(150, {"do_remote_decode": True, "transfer_id": "t-early"}, seed=5)
    delay = 0.3

    def run_prefill() -> None:
        time.sleep(delay)
        p.scheduler.add_request(rp)
        p.run_until(lambda: rp.request_id in p.finished)

    prefill = threading.Thread(target=run_prefill)
    prefill.start()
    try:
        t0 = time.monotonic()
        rec = d.step()  # vLLM schedules the request's first token; bind waits for P
        elapsed = time.monotonic() - t0
    finally:
        prefill.join(30)
    assert rec.meta.first_steps == [rd.request_id]
    assert rec.num_scheduled == {rd.request_id: 1}
    assert elapsed >= delay, "the first step ran before P had sent the KV"
    assert not rec.kv_output.invalid_block_ids
    assert_kv_arrived(d, rd, d_blocks)
    run_both_until_idle(p, d)
    assert reported(d, "finished_recving", rd.request_id) == 1
    assert d.finished[rd.request_id].finish_reason == FinishReason.LENGTH
    assert rd.num_output_tokens == 3


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_early_released_request_whose_kv_never_comes_follows_the_failure_policy(
        engines, fake_prefill, policy) -> None:
    """Reported early, then nothing more from P: the first step fails the transfer after
    io_timeout_s and reports its blocks as load errors in that step; vLLM then fails the
    request or recomputes it on D (kv_load_failure_policy)."""
    server, got = fake_prefill()
    d = engines("kv_consumer", {"early_release_lead_ms": 0, "io_timeout_s": 0.3},
                kv_load_failure_policy=policy)
    rd = park_nearly_done(d, server, got, "t-gone")
    d_blocks = d.block_ids(rd.request_id)
    assert rd.request_id in d.step().kv_output.finished_recving
    rec = d.step()
    assert rec.meta.first_steps == [rd.request_id]
    assert rec.kv_output.invalid_block_ids == set(d_blocks)
    assert not rec.kv_output.failed_recving  # it runs already: blocks, not a request report

    d.run_until(d.idle)
    if policy == "fail":
        assert d.finished[rd.request_id].finish_reason == FinishReason.ERROR
        assert rd.num_output_tokens == 0
    else:
        assert d.finished[rd.request_id].finish_reason == FinishReason.LENGTH
        assert rd.num_output_tokens == 2
    assert_all_empty(d)
    assert reported(d, "finished_recving", rd.request_id) == 1


def test_no_early_release_while_decode_runs_other_requests(engines, fake_prefill) -> None:
    """A nearly done transfer is not reported while D's steps run other requests (the first
    step would hold them up while it waits for the last group)."""
    server, got = fake_prefill()
    d = engines("kv_consumer", {"early_release_lead_ms": 0})
    busy = create_request(20, None, max_tokens=50)
    d.scheduler.add_request(busy)
    d.step()
    rd = park_nearly_done(d, server, got, "t-busy")
    for _ in range(5):
        rec = d.step()
        assert busy.request_id in rec.num_scheduled
        assert not rec.kv_output.finished_recving
    d.scheduler.finish_requests([busy.request_id, rd.request_id], RequestStatus.FINISHED_ABORTED)
    d.run_until(d.idle)
    assert_all_empty(d)


def test_early_release_off_waits_for_the_whole_transfer(engines, fake_prefill) -> None:
    server, got = fake_prefill()
    d = engines("kv_consumer", {"early_release": False})
    rd = park_nearly_done(d, server, got, "t-off")
    for _ in range(3):
        assert not d.step().kv_output.finished_recving
    d.scheduler.finish_requests([rd.request_id], RequestStatus.FINISHED_ABORTED)
    d.run_until(d.idle)
    assert_all_empty(d)


def transfer_one(p, d, tid: str, seed: int) -> None:
    """One 150-token request through P and D, D's first (it registers), until both are idle."""
    rd = create_request(150, decode_params(tid, p.endpoint), max_tokens=2, seed=seed)
    d.scheduler.add_request(rd)
    d.step()
    rp = create_request(150, {"do_remote_decode": True, "transfer_id": tid}, seed=seed)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))
    run_both_until_idle(p, d)


def test_prefill_announces_the_end_after_the_penultimate_group_of_the_last_chunk(
        engines, tmp_path) -> None:
    """P's sender sends TransferNearlyDone once per transfer: in the last chunk's step, right
    after the penultimate layer group (groups of 3 of 8 layers: after group 1)."""
    trace = tmp_path / "trace"
    p = engines("kv_producer", {**P_EXTRA, "trace_path": str(trace)},
                max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    transfer_one(p, d, "t-nearly", seed=3)

    events = [json.loads(line) for line in (tmp_path / "trace.p.0").read_text().splitlines()]
    final_step = next(e["step"] for e in events
                      if e["ev"] == "step_plan" and e["final"] == ["t-nearly"])
    order = [(e["ev"], e.get("step"), e.get("group")) for e in events
             if e["ev"] in ("group_send_end", "group_send_start", "nearly_done_sent")]
    nearly = [i for i, (ev, _, _) in enumerate(order) if ev == "nearly_done_sent"]
    assert len(nearly) == 1
    assert order[nearly[0] - 1] == ("group_send_end", final_step, 1)
    assert order[nearly[0] + 1] == ("group_send_start", final_step, 2)
    eta = next(e["eta"] for e in events if e["ev"] == "nearly_done_sent")
    assert 0 <= eta < 5


def test_both_schedulers_trace_when_a_request_entered_vllm(engines, tmp_path) -> None:
    """The TTFT profile splits each side's intake: P's ``p_seen`` and D's ``d_seen`` carry
    vLLM's arrival time (on the monotonic clock) and the engine core's QUEUED event, in that
    order before the event itself."""
    p = engines("kv_producer", {**P_EXTRA, "trace_path": str(tmp_path / "p")})
    d = engines("kv_consumer", {"trace_path": str(tmp_path / "d")})
    transfer_one(p, d, "t-intake", seed=4)
    for path, ev in ((tmp_path / "p.psched.0", "p_seen"), (tmp_path / "d.dsched.0", "d_seen")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        [seen] = [e for e in events if e["ev"] == ev]
        assert seen["transfer_id"] == "t-intake"
        assert seen["arrival"] <= seen["queued"] <= seen["t"], seen
        assert seen["t"] - seen["arrival"] < 60  # the same clock, not wall against monotonic


# ----------------------------------------------------------------------------- first token


def test_decode_continues_from_the_first_token_prefill_sampled(engines) -> None:
    """first_token_from_prefill: P sends the token it sampled after the prompt, D reports the
    request only once it has both KV and token, and vLLM schedules the request with that token
    appended to its prompt: D computes exactly that one token and samples the next."""
    p = engines("kv_producer", P_EXTRA, max_num_batched_tokens=CHUNK)
    d = engines("kv_consumer")
    p.sampled_token = 4321  # what P's request samples after the prompt
    endpoint = p.endpoint
    shift_block_ids(d)
    prompt = 150
    rd = create_request(prompt, {**decode_params("ft", endpoint),
                                 "first_token_from_prefill": True}, max_tokens=3, seed=6)
    prompt_ids = list(rd.prompt_token_ids)
    d.scheduler.add_request(rd)
    rec = d.step()
    assert rec.meta.recvs == [RecvTask(rd.request_id, "ft", d.block_ids(rd.request_id), True)]
    d_blocks = d.block_ids(rd.request_id)
    rp = create_request(prompt, {"do_remote_decode": True, "transfer_id": "ft"}, seed=6)
    p.scheduler.add_request(rp)
    p.run_until(lambda: rp.request_id in p.finished, others=(d,))

    # D's first scheduled step: the prompt plus P's token, everything but that token computed
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "decode never scheduled the request"
        so = d.scheduler.schedule()
        new = [r for r in so.scheduled_new_reqs if r.req_id == rd.request_id]
        if new:
            break
        d.execute(so)
        p.step()
        time.sleep(0.001)
    assert new[0].prompt_token_ids == prompt_ids + [4321]
    assert new[0].num_computed_tokens == prompt
    assert so.num_scheduled_tokens[rd.request_id] == 1
    assert sum(1 for r in d.history for t in r.meta.first_tokens if t == "ft") == 1
    d.execute(so)
    for layer in range(NUM_LAYERS):  # the prompt's KV is P's
        rows = d.token_rows(layer, d_blocks, prompt)[:, 0, 0]
        assert torch.equal(rows, torch.tensor([kv_value(t, layer, salt(rp))
                                               for t in range(prompt)])), layer
    run_both_until_idle(p, d)
    assert rd.num_output_tokens == 3 and rd.num_prompt_tokens == prompt + 1
