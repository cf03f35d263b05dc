"""End to end on CPU with real `vllm serve` processes and the real SmolLM2-135M-Instruct model:
prefill + decode + proxy against a single-instance reference, float32 greedy."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prompts import PROMPTS, make_prompt

from vllm_layerkv.testing import faults
from vllm_layerkv.testing.cluster import (
    MODEL_NAME,
    PDCluster,
    metric,
    prompt_tokens_by_source,
    wait_idle,
)
from vllm_layerkv.testing.servers import get_text, post_json, stream_text
from vllm_layerkv.wire import framing
from vllm_layerkv.wire.auth import AuthError, ChannelAuth, connect_handshake

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24


def complete(url: str, prompt: str, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body.update(kw)
    status, data = post_json(url + "/v1/completions", body, timeout=300)
    assert status == 200, f"HTTP {status}: {data}"
    return data


def token_ids(resp: dict[str, Any]) -> list[int]:
    return resp["choices"][0]["token_ids"]


# ------------------------------------------------------------------------- correctness


def test_outputs_token_identical_to_single_instance(cluster: PDCluster, no_leaks: None) -> None:
    """24 prompts from 3 to ~1,400 tokens (P prefills in 256-token chunks, so the long ones
    stream several chunks), 3 at a time through the proxy, each compared token by token with
    the reference instance."""
    assert cluster.reference is not None
    ref_url, proxy_url = cluster.reference.url, cluster.proxy.url  # type: ignore[union-attr]
    with ThreadPoolExecutor(3) as pool:
        refs = list(pool.map(lambda p: complete(ref_url, p, return_token_ids=True), PROMPTS))
        outs = list(pool.map(lambda p: complete(proxy_url, p, return_token_ids=True), PROMPTS))
    lengths = [r["usage"]["prompt_tokens"] for r in refs]
    assert max(lengths) > 4 * 256, f"longest prompt {max(lengths)} tokens is not multi-chunk"
    mismatches = [(i, lengths[i], token_ids(r), token_ids(o))
                  for i, (r, o) in enumerate(zip(refs, outs)) if token_ids(r) != token_ids(o)]
    assert not mismatches, f"{len(mismatches)} of {len(PROMPTS)} differ: {mismatches[:3]}"
    # a prompt may legitimately hit EOS early (identically on both); most must run to the cap
    assert sum(len(token_ids(o)) == MAX_TOKENS for o in outs) > len(outs) // 2


def test_streaming_and_chat_through_proxy(cluster: PDCluster, no_leaks: None) -> None:
    assert cluster.reference is not None
    ref_url, proxy_url = cluster.reference.url, cluster.proxy.url  # type: ignore[union-attr]
    prompt = make_prompt(700, seed=99)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    assert stream_text(proxy_url, "/v1/completions", body) == \
        complete(ref_url, prompt)["choices"][0]["text"]

    chat = {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": make_prompt(300, seed=7) +
                          "\nSummarise the text above in one sentence."}]}
    status, ref = post_json(ref_url + "/v1/chat/completions", chat, timeout=300)
    assert status == 200
    status, out = post_json(proxy_url + "/v1/chat/completions", chat, timeout=300)
    assert status == 200, out
    expected = ref["choices"][0]["message"]["content"]
    assert out["choices"][0]["message"]["content"] == expected
    assert stream_text(proxy_url, "/v1/chat/completions", chat) == expected


def test_prompt_logprobs_are_served_by_prefill_alone(cluster: PDCluster, no_leaks: None) -> None:
    """echo + logprobs needs the prompt's logits, which D never computes: the proxy routes
    such requests to a prefill instance, unchanged."""
    assert cluster.reference is not None
    prompt = make_prompt(40, seed=3)
    kw = {"echo": True, "logprobs": 1, "max_tokens": 1}
    ref = complete(cluster.reference.url, prompt, **kw)
    out = complete(cluster.proxy.url, prompt, **kw)  # type: ignore[union-attr]
    assert out["choices"][0]["logprobs"]["tokens"] == ref["choices"][0]["logprobs"]["tokens"]
    assert out["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        ref["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-4)


# ------------------------------------------------------------------------- it streams


def stream_one_prompt(cluster: PDCluster, seed: int) -> None:
    """One long prompt of its own through the proxy (P computes it in several chunks): what a
    test reads from P's trace, metrics or log does not depend on the tests before it."""
    assert cluster.proxy is not None
    complete(cluster.proxy.url, make_prompt(600, seed=seed), max_tokens=2)


def test_kv_streams_by_layer_group_during_prefill(cluster: PDCluster) -> None:
    """From the connector's own trace: in a prefill step of a long prompt, more than one layer
    group was sent, and the first group's send started before the step's last layer ran
    (the last group is enqueued by the last layer's hook)."""
    stream_one_prompt(cluster, seed=7901)
    events = cluster.trace_events()
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if "step" in e:
            by_step.setdefault(e["step"], []).append(e)
    streamed_steps = []
    for step, evs in by_step.items():
        enq = [e for e in evs if e["ev"] == "group_enqueued"]
        starts = [e for e in evs if e["ev"] == "group_send_start"]
        if len(enq) < 2 or not starts:
            continue
        last_layer_t = max(e["t"] for e in enq)
        first_send_t = min(e["t"] for e in starts)
        if first_send_t < last_layer_t:
            streamed_steps.append((step, len(enq), last_layer_t - first_send_t))
    assert streamed_steps, f"no streamed step in {len(by_step)} traced steps"
    assert max(n for _, n, _ in streamed_steps) > 1


def test_transfer_metrics_exported(cluster: PDCluster) -> None:
    stream_one_prompt(cluster, seed=7902)
    _, p_text = get_text(cluster.prefill.url + "/metrics")
    _, d_text = get_text(cluster.decode.url + "/metrics")
    sent = metric(p_text, "vllm:layerkv_bytes_sent_total")
    received = metric(d_text, "vllm:layerkv_bytes_received_total")
    assert sent > 0 and received > 0
    assert metric(p_text, "vllm:layerkv_groups_sent_total") > metric(
        p_text, "vllm:layerkv_transfers_sent_total")
    assert metric(p_text, "vllm:layerkv_exposed_transfer_seconds_count") > 0
    # vLLM logs the connector's stats every 10 s, for the interval that ended
    deadline = time.monotonic() + 25
    while "avg exposed transfer (ms)" not in (log := cluster.prefill.log_path.read_text()):
        assert time.monotonic() < deadline, "P never logged its KV transfer metrics"
        time.sleep(0.5)
    assert "KV Transfer metrics" in log


# ------------------------------------------------------------------------- authentication


def test_peers_with_the_wrong_secret_are_refused(cluster: PDCluster, no_leaks: None) -> None:
    """The harness gives P and D a shared secret. While an honest request runs through the
    proxy, a peer with another secret keeps connecting to D's data port and to P's
    registration port: both refuse it, each logs why, and the honest request completes
    token-identical to the reference with its KV sent by P and received by D."""
    assert cluster.reference is not None and cluster.spec.auth_secret is not None
    wrong = ChannelAuth(b"not-the-cluster-secret-" + uuid.uuid4().hex.encode())
    p_host, p_port = cluster.prefill_endpoint()
    targets = [cluster.decode_data_endpoints()[0], f"{p_host}:{p_port}"]
    prompt = make_prompt(600, seed=41)
    ref = complete(cluster.reference.url, prompt, return_token_ids=True)
    counters = ("vllm:layerkv_transfers_sent_total", "vllm:layerkv_transfers_received_total")

    def readings() -> tuple[float, float, float]:
        d_text = cluster.decode.metrics()
        return (metric(cluster.prefill.metrics(), counters[0]), metric(d_text, counters[1]),
                prompt_tokens_by_source(d_text, "external_kv_transfer"))

    before = readings()
    refusals: list[str] = []
    done = threading.Event()

    def attack() -> None:
        while not done.is_set() or len(refusals) < 2 * len(targets):
            for endpoint in targets:
                sock = framing.connect(endpoint, 5.0)
                try:
                    connect_handshake(sock, wrong, 5.0)
                    refusals.append("admitted")
                except AuthError as e:
                    refusals.append(str(e))
                finally:
                    sock.close()

    attacker = threading.Thread(target=attack)
    attacker.start()
    out = complete(cluster.proxy.url, prompt, return_token_ids=True)  # type: ignore[union-attr]
    done.set()
    attacker.join(60)
    assert token_ids(out) == token_ids(ref)
    assert refusals and all("the two secrets differ" in r for r in refusals), refusals[:3]
    deadline = time.monotonic() + 15  # /metrics follows the engine's step outputs
    while (rise := [a - b for a, b in zip(readings(), before)])[:2] != [1, 1] and \
            time.monotonic() < deadline:
        time.sleep(0.3)
    assert rise[:2] == [1, 1] and rise[2] > 0, rise  # sent by P, received by D
    for server, listener in ((cluster.decode, "data listener"),
                             (cluster.prefill, "registration server")):
        assert f"LayerKV {listener} refused a connection" in server.log_path.read_text()
    assert cluster.spec.auth_secret not in cluster.decode.log_path.read_text()


# ------------------------------------------------------------------------- failures


def test_decode_fails_fast_when_prefill_unreachable(cluster: PDCluster, no_leaks: None) -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    t = time.monotonic()
    status, data = post_json(cluster.decode.url + "/v1/completions", {
        "model": MODEL_NAME, "prompt": make_prompt(50, 1), "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": cluster.decode_params(uuid.uuid4().hex, dead_port)}, timeout=60)
    assert status >= 500, data
    assert time.monotonic() - t < 10
    assert "cannot reach the prefill instance" in cluster.decode.log_path.read_text()


def test_decode_abort_while_waiting_frees_both_sides(cluster: PDCluster, no_leaks: None) -> None:
    """A client gives up on D while D waits for KV that never comes: D frees its blocks and
    tells P, well before kv_wait_timeout_s."""
    tid = uuid.uuid4().hex
    body = json.dumps({"model": MODEL_NAME, "prompt": make_prompt(200, 8), "max_tokens": 8,
                       "temperature": 0, "stream": True,
                       "kv_transfer_params": cluster.decode_params(tid)}).encode()
    sock = socket.create_connection(("127.0.0.1", cluster.decode.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(2.0)
    sock.close()  # client disconnect -> vLLM aborts the request
    t = time.monotonic()
    readings = wait_idle(cluster.decode, timeout=8)
    assert not any(readings.values()), readings
    assert time.monotonic() - t < 8


ABORT_ATTEMPTS = 3
"""Tries of the prefill-abort test: one counts only if the disconnect reached P mid-prompt."""


def _disconnect_p_mid_stream(cluster: PDCluster, prompt: str) -> dict[str, Any]:
    """Send D's request, then P's over a raw socket that is closed once P has streamed the
    transfer's first chunk. Returns D's answer and what P's trace shows of the transfer."""
    tid = uuid.uuid4().hex
    result: dict[str, Any] = {}

    def decode() -> None:
        t = time.monotonic()
        result["status"], result["data"] = post_json(cluster.decode.url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": cluster.decode_params(tid)}, timeout=120)
        result["elapsed"] = time.monotonic() - t

    th = threading.Thread(target=decode)
    th.start()
    # send P's request only once P holds D's registration: on a loaded machine it can come
    # later than registration_wait_s, P then computes chunks without streaming them, and the
    # disconnect can come after P's request has already finished
    cluster.wait_for_registration(tid, th, result)
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "kv_transfer_params": {"do_remote_decode": True,
                                              "transfer_id": tid}}).encode()
    sock = socket.create_connection(("127.0.0.1", cluster.prefill.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # disconnect once P has streamed its first chunk (its trace lists the transfer), not
    # after a fixed sleep: how fast P gets through the prompt depends on the machine
    deadline = time.monotonic() + 60
    plans: list[int] = []
    while time.monotonic() < deadline and not plans:
        plans = [e["step"] for e in cluster.trace_events()
                 if e["ev"] == "step_plan" and tid in e.get("transfer_ids", [])]
        time.sleep(0.05)
    closed_at = time.monotonic()
    sock.close()
    th.join(60)

    def done_sent(events: list[dict[str, Any]]) -> bool:
        return any(e["ev"] == "transfer_done_sent" and e.get("transfer_id") == tid
                   for e in events)

    events = cluster.trace_events()  # its times are this machine's monotonic clock
    # P's sender traces the completion after sending it: if D already answered, give the
    # trace a moment to catch up before judging the try
    wait_until = time.monotonic() + 5
    while result.get("status") == 200 and not done_sent(events) and time.monotonic() < wait_until:
        time.sleep(0.1)
        events = cluster.trace_events()
    return {**result, "plans_before_close": plans,
            "steps_after_close": sum(e["ev"] == "step_plan" and tid in e["transfer_ids"]
                                     and e["t"] > closed_at for e in events),
            "done_sent": done_sent(events)}


def test_prefill_abort_mid_stream_fails_decode_cleanly(cluster: PDCluster,
                                                       no_leaks: None) -> None:
    """P's client disconnects while a long prefill streams: P aborts the transfer and D fails
    its request at once (well before the 45 s timeout).

    Whether the disconnect reaches P's engine before it has computed the prompt is up to the
    machine (vLLM's API server notices it, then the engine aborts the request between steps;
    on a loaded 2-core machine that has taken longer than the whole prompt). A try in which P
    finished the prompt and sent the transfer complete proves nothing about the abort, so it
    is tried again, up to ABORT_ATTEMPTS times; the first try in which P stopped mid-stream is
    the one checked."""
    tries: list[dict[str, Any]] = []
    for attempt in range(ABORT_ATTEMPTS):
        # a new prompt each time: P's and D's prefix caches hold the last one
        prompt = make_prompt(2800, 11 + attempt)  # ~3,100 tokens: 13 chunks of 256 on P
        tries.append(_disconnect_p_mid_stream(cluster, prompt))
        assert tries[-1]["plans_before_close"], "P's trace never showed the transfer streaming"
        if not tries[-1]["done_sent"]:
            break
    result = tries[-1]
    assert not result["done_sent"], (
        f"in {ABORT_ATTEMPTS} tries P computed the whole prompt before the client's disconnect "
        "reached it (its trace shows the transfer completed); D's status, seconds, and P's "
        "steps after the disconnect: " + str([(t.get("status"), round(t.get("elapsed", -1), 1),
                                               t["steps_after_close"]) for t in tries]))
    assert result.get("status", 0) >= 500, result
    assert result["elapsed"] < 30, result


def test_transfer_error_fails_decode_at_once(cluster: PDCluster, no_leaks: None) -> None:
    """A write that fails on P (test-only fault hook: every write of this transfer) with the
    connection up: P aborts the transfer on D, which fails the request at once
    (kv_load_failure_policy=fail) instead of after kv_wait_timeout_s (45 s here)."""
    tid = faults.WRITE_FAULT_PREFIX + uuid.uuid4().hex
    d, (p_status, _) = cluster.prefill_and_decode(tid, make_prompt(400, 21))
    assert p_status == 200  # P's own request is fine
    assert d.get("status", 0) >= 500, d
    assert d["elapsed"] < 15, d
    assert "Traceback" not in json.dumps(d["data"])  # an error message, not a stack
    assert "injected write fault" in cluster.decode.log_path.read_text()


def test_malformed_kv_transfer_params_get_a_clear_answer(cluster: PDCluster,
                                                         no_leaks: None) -> None:
    """Malformed params: the request is served locally, and the response says what to fix."""
    assert cluster.reference is not None
    prompt = make_prompt(30, 4)
    ref = complete(cluster.reference.url, prompt)["choices"][0]["text"]
    out = complete(cluster.decode.url, prompt,
                   kv_transfer_params={"do_remote_prefill": True, "remote_host": "x"})
    assert "transfer_id" in out["kv_transfer_params"]["layerkv_error"]
    assert out["choices"][0]["text"] == ref
    out = complete(cluster.prefill.url, prompt, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"})
    assert "both" in out["kv_transfer_params"]["layerkv_error"]
    status, data = post_json(cluster.proxy.url + "/v1/completions",  # type: ignore[union-attr]
                             {"prompt": prompt}, timeout=30)
    assert status == 400 and "model" in json.dumps(data)


# ------------------------------------------------------------------------- timeouts
# The tests that wait out P's timeouts run while D waits out its own on another request: the
# waits overlap instead of adding up (45 s + ~30 s on CPU).


class PendingRequest:
    """A request sent in a thread of its own; :meth:`outcome` waits for its answer."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self._result: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._send, args=(url, body), daemon=True)
        self._thread.start()

    def _send(self, url: str, body: dict[str, Any]) -> None:
        t = time.monotonic()
        try:
            self._result["status"], self._result["data"] = post_json(url, body, timeout=120)
        except OSError as e:
            self._result["status"], self._result["data"] = 0, repr(e)
        self._result["elapsed"] = time.monotonic() - t

    def outcome(self) -> tuple[int, Any, float]:
        """(HTTP status, body, seconds to the answer); status 0: no answer."""
        self._thread.join(150)
        assert not self._thread.is_alive(), "no answer within 150 s"
        return self._result["status"], self._result["data"], self._result["elapsed"]


@pytest.fixture(scope="module")
def kv_never_arrives(cluster: PDCluster) -> Iterator[PendingRequest]:
    """A request to D with a live P's endpoint that P never gets the prefill request for, sent
    when the first test asks for it: D parks it until kv_wait_timeout_s (45 s here)."""
    pending = PendingRequest(cluster.decode.url + "/v1/completions", {
        "model": MODEL_NAME, "prompt": make_prompt(80, 2), "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": cluster.decode_params(uuid.uuid4().hex)})
    yield pending
    pending.outcome()  # leaves D idle for the next module even when the test did not run


def test_prefill_frees_blocks_when_decode_never_registers(
        cluster: PDCluster, kv_never_arrives: PendingRequest, prefill_no_leaks: None) -> None:
    """P serves its request, holds the KV for registration_timeout_s (6 s here), then frees it."""
    tid = uuid.uuid4().hex
    t = time.monotonic()
    out = complete(cluster.prefill.url, make_prompt(300, 5), max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    assert out["kv_transfer_params"]["transfer_id"] == tid
    assert time.monotonic() - t < 30
    readings = wait_idle(cluster.prefill, timeout=30)
    assert not any(readings.values()), readings
    assert "no decode registered within registration_timeout_s" in \
        cluster.prefill.log_path.read_text()


def test_missing_ack_frees_prefill_blocks_after_ack_timeout(
        cluster: PDCluster, kv_never_arrives: PendingRequest, prefill_no_leaks: None) -> None:
    """D completes but its acknowledgement never reaches P (fault hook): P frees the request's
    blocks after ack_timeout_s (20 s here) and says so."""
    assert cluster.reference is not None
    prompt = make_prompt(300, 22)
    tid = faults.NO_ACK_PREFIX + uuid.uuid4().hex
    d, (p_status, _) = cluster.prefill_and_decode(tid, prompt, max_tokens=MAX_TOKENS)
    assert p_status == 200 and d.get("status") == 200, d
    assert d["data"]["choices"][0]["text"] == \
        complete(cluster.reference.url, prompt)["choices"][0]["text"]
    t = time.monotonic()
    readings = wait_idle(cluster.prefill, timeout=45)
    assert not any(readings.values()), readings
    assert time.monotonic() - t < 45
    assert "no acknowledgement from decode" in cluster.prefill.log_path.read_text()


def test_decode_times_out_when_kv_never_arrives(cluster: PDCluster,
                                                kv_never_arrives: PendingRequest,
                                                no_leaks: None) -> None:
    """D registers with a live P that never gets the prefill request: D must fail the
    request after kv_wait_timeout_s (45 s here) instead of waiting forever."""
    status, data, elapsed = kv_never_arrives.outcome()
    assert status >= 500, data
    assert 40 <= elapsed < 90, elapsed
    assert "kv_wait_timeout_s" in cluster.decode.log_path.read_text()
