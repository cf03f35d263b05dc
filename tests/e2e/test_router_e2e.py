"""LayerKV behind the P/D router people deploy: ``vllm-router`` 0.1.17 (the test extra), real
``vllm serve`` instances on CPU, SmolLM2 float32 greedy, compared with the shared cluster's
reference instance.

* ``--kv-connector mooncake``: the router finds P's engine through P's bootstrap endpoint
  (``GET /query``) and sends D ``remote_bootstrap_addr`` + ``remote_engine_id``.
* ``--kv-connector nixl``: P mints the transfer and its answer's ``kv_transfer_params`` tell D
  everything; the router copies them into D's request.
* The concurrent Mooncake contract (P and D at once, what llm-d's routing sidecar sends), driven
  by the test: the case where LayerKV streams KV during P's prefill.
* Two prefill and two decode instances behind one router; D or P killed mid-request; a client
  that disconnects.

vllm-router asks D only once P has answered, so through it KV moves after P's last layer; every
success case checks on P's and D's transfer counters that the KV came from P. The shared
cluster (conftest.py) is the first P/D pair; a second pair without a reference (``spare``) is
started for the 2P2D test and killed, one instance each, by the failure tests, whose
survivors are the shared cluster's instances (checked by ``no_leaks``)."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prompts import make_prompt

from vllm_layerkv.testing.cluster import (
    MODEL_NAME,
    ClusterSpec,
    PDCluster,
    log_since,
    metric,
    prompt_tokens_by_source,
    wait_idle,
)
from vllm_layerkv.testing.models import model_path
from vllm_layerkv.testing.router import VllmRouter
from vllm_layerkv.testing.servers import VllmServer, post_json, stream_text

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
SENT = "vllm:layerkv_transfers_sent_total"
RECEIVED = "vllm:layerkv_transfers_received_total"
FALLBACKS = "vllm:layerkv_remote_prefill_fallbacks_total"
CHUNK = 256  # P's max_num_batched_tokens in the shared cluster


# ------------------------------------------------------------------------- helpers


def counter(server: VllmServer, name: str) -> float:
    """A counter on ``server``'s /metrics (LayerKV exposes its counters from the start)."""
    return metric(server.metrics(), name)


class Counters:
    """Transfer counters of P(s) and D(s) before a test's requests; :meth:`wait_rise` waits
    until they rose by the requests' number (vLLM updates /metrics from the engine's step
    outputs, a little after the answer)."""

    def __init__(self, prefills: list[VllmServer], decodes: list[VllmServer]) -> None:
        self.prefills, self.decodes = prefills, decodes
        self.before = self.read()

    def read(self) -> dict[str, float]:
        out = {f"sent {s.port}": counter(s, SENT) for s in self.prefills}
        out |= {f"received {s.port}": counter(s, RECEIVED) for s in self.decodes}
        out |= {f"fallbacks {s.port}": counter(s, FALLBACKS) for s in self.decodes}
        out |= {f"external tokens {s.port}": prompt_tokens_by_source(
            s.metrics(), "external_kv_transfer") for s in self.decodes}
        return out

    def rise(self) -> dict[str, float]:
        now = self.read()
        return {k: now[k] - self.before[k] for k in now}

    def wait_rise(self, requests: int, timeout: float = 15.0) -> dict[str, float]:
        """The rises once every P counted ``requests`` transfers sent and every D as many
        received (summed over the instances), or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            rise = self.rise()
            sent = sum(v for k, v in rise.items() if k.startswith("sent"))
            received = sum(v for k, v in rise.items() if k.startswith("received"))
            if (sent >= requests and received >= requests) or time.monotonic() > deadline:
                return rise
            time.sleep(0.3)

    def assert_kv_from_prefill(self, requests: int) -> dict[str, float]:
        """Every request's KV was sent by a P and received by a D, none computed by D instead
        (no remote-prefill fallback), and D took prompt tokens from the transfer."""
        rise = self.wait_rise(requests)
        sent = sum(v for k, v in rise.items() if k.startswith("sent"))
        received = sum(v for k, v in rise.items() if k.startswith("received"))
        assert (sent, received) == (requests, requests), rise
        assert not any(v for k, v in rise.items() if k.startswith("fallbacks")), rise
        assert sum(v for k, v in rise.items() if k.startswith("external")) > 0, rise
        return rise


def completion_body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, **kw}


def chat_body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": text +
                          "\nSummarise the text above in one sentence."}], **kw}


def post_ok(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, data = post_json(url + path, body, timeout=300)
    assert status == 200, f"{url}{path}: HTTP {status}: {data}"
    return data




def answer_text(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


class Case:
    """One request of a token-identity comparison: a completion or a chat, streamed or not."""

    def __init__(self, kind: str, text: str, stream: bool) -> None:
        self.kind, self.text, self.stream = kind, text, stream
        self.path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        self.body = (completion_body(text, return_token_ids=True) if kind == "completion"
                     else chat_body(text))

    def expected(self, reference_url: str) -> tuple[str, list[int] | None]:
        data = post_ok(reference_url, self.path, self.body)
        return answer_text(data), data["choices"][0].get("token_ids")

    def served(self, url: str) -> tuple[str, list[int] | None]:
        if self.stream:
            return stream_text(url, self.path, self.body), None
        data = post_ok(url, self.path, self.body)
        return answer_text(data), data["choices"][0].get("token_ids")

    def __repr__(self) -> str:
        return f"{self.kind}{' stream' if self.stream else ''} ({len(self.text.split())} words)"


def compare_with_reference(cluster: PDCluster, url: str, cases: list[Case]) -> None:
    """Each case served at ``url`` (3 at a time) matches the reference: token ids where the
    answer carries them, else the text."""
    assert cluster.reference is not None
    with ThreadPoolExecutor(3) as pool:
        refs = list(pool.map(lambda c: c.expected(cluster.reference.url), cases))
        outs = list(pool.map(lambda c: c.served(url), cases))
    mismatches = [(case, ref, out) for case, ref, out in zip(cases, refs, outs)
                  if (out[1] is not None and out[1] != ref[1]) or out[0] != ref[0]]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ: {mismatches[:3]}"


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``fn()`` in a thread; the dict gets its "result" (or "error") and "elapsed"."""
    out: dict[str, Any] = {}

    def run() -> None:
        t = time.monotonic()
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = repr(e)
        out["elapsed"] = time.monotonic() - t

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)


def running(server: VllmServer) -> bool:
    try:
        return metric(server.metrics(), "vllm:num_requests_running") >= 1
    except (OSError, RuntimeError):
        return False


def open_stream(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A streamed request sent on a raw socket, so the test can drop the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def assert_idle(server: VllmServer, timeout: float) -> float:
    """Waits until ``server`` holds no request and no block; returns the seconds it took."""
    t = time.monotonic()
    readings = wait_idle(server, timeout=timeout)
    assert not any(readings.values()), f"{server.log_path.stem} leaked: {readings}"
    return time.monotonic() - t


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def routers(cluster: PDCluster) -> Iterator[dict[str, VllmRouter]]:
    """vllm-router in both modes in front of the shared cluster's P and D."""
    started: dict[str, VllmRouter] = {}
    try:
        for mode in ("mooncake", "nixl"):
            started[mode] = cluster.start_router(mode)
        yield started
    finally:
        for router in started.values():
            router.stop()


@pytest.fixture(scope="module")
def spare(cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """A second P and D (no reference; the shared cluster's settings), on the same cores."""
    spec = ClusterSpec(model=model_path("smollm2"), workdir=tmp_path_factory.mktemp("spare"),
                       prefill_extra=cluster.spec.prefill_extra,
                       decode_extra=cluster.spec.decode_extra,
                       connector_env=cluster.spec.connector_env, with_reference=False,
                       with_proxy=False)
    pair = PDCluster(spec)
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()


# ------------------------------------------------------------------------- vllm-router


def test_mooncake_router_outputs_token_identical(cluster: PDCluster,
                                                 routers: dict[str, VllmRouter],
                                                 no_leaks: None) -> None:
    """16 requests through ``vllm-router --kv-connector mooncake``, 3 at a time: completions
    and chats, streamed and not, prompts from 3 to ~700 tokens (five prefill in two or three
    256-token chunks on P). Each matches the reference, and P sent (D received) the KV of
    every one."""
    words = [3, 12, 30, 40, 90, 130, 170, 210, 260, 380, 520, 300, 60, 200, 350, 100]
    kinds = ["completion"] * 12 + ["chat"] * 4
    streams = [False] * 8 + [True] * 4 + [False, True] * 2
    cases = [Case(kind, make_prompt(n, seed=7100 + i), stream)
             for i, (n, kind, stream) in enumerate(zip(words, kinds, streams))]
    counters = Counters([cluster.prefill], [cluster.decode])
    compare_with_reference(cluster, routers["mooncake"].url, cases)
    counters.assert_kv_from_prefill(len(cases))
    lengths = [post_ok(cluster.reference.url, "/tokenize",  # type: ignore[union-attr]
                       {"model": MODEL_NAME, "prompt": c.text})["count"] for c in cases[:12]]
    assert sum(n > CHUNK for n in lengths) >= 4, lengths


def test_nixl_router_outputs_token_identical(cluster: PDCluster,
                                             routers: dict[str, VllmRouter],
                                             no_leaks: None) -> None:
    """``vllm-router --kv-connector nixl``: P mints the transfer, its answer's
    kv_transfer_params reach D verbatim. Completions (streamed and not) and chats, two of the
    prompts multi-chunk; outputs match the reference and the KV came from P."""
    cases = [Case("completion", make_prompt(20, seed=7301), False),
             Case("completion", make_prompt(700, seed=7302), False),
             Case("completion", make_prompt(400, seed=7303), True),
             Case("chat", make_prompt(60, seed=7304), False),
             Case("chat", make_prompt(300, seed=7305), True),
             Case("completion", make_prompt(150, seed=7306), False)]
    counters = Counters([cluster.prefill], [cluster.decode])
    compare_with_reference(cluster, routers["nixl"].url, cases)
    counters.assert_kv_from_prefill(len(cases))


def test_two_prefills_two_decodes_behind_one_router(cluster: PDCluster, spare: PDCluster,
                                                    no_leaks: None) -> None:
    """``vllm-router --kv-connector mooncake`` with two P and two D (round robin): every
    instance serves, each D finds its request's P through the bootstrap address the router
    gives it, outputs match the reference."""
    prefills, decodes = [cluster.prefill, spare.prefill], [cluster.decode, spare.decode]
    router = cluster.start_router(
        "mooncake", prefills=[cluster.router_prefill(), spare.router_prefill()],
        decodes=[d.url for d in decodes])
    try:
        cases = [Case("completion", make_prompt(n, seed=7400 + i), False)
                 for i, n in enumerate((300, 40, 120, 220))]
        counters = Counters(prefills, decodes)
        compare_with_reference(cluster, router.url, cases)
        rise = counters.assert_kv_from_prefill(len(cases))
        assert all(rise[f"sent {p.port}"] >= 1 for p in prefills), rise
        assert all(rise[f"received {d.port}"] >= 1 for d in decodes), rise
    finally:
        router.stop()
    assert_idle(spare.prefill, 30)
    assert_idle(spare.decode, 30)


# ---------------------------------------------------------------- concurrent contract


def test_concurrent_mooncake_contract_streams_during_prefill(cluster: PDCluster,
                                                             no_leaks: None) -> None:
    """What llm-d's sidecar sends in mooncake mode: P (in the background) and D at once, with a
    ``xfer-<uuid4>`` transfer id and D told P's bootstrap address and engine id. D's answer
    matches the reference, and P's trace shows, in a prefill step of this transfer, more than
    one layer group enqueued and a group's send started before the step's last layer ran.
    The same P served vllm-router's sequential requests just before (and stopped holding
    prefills back for registrations): it streams again as soon as one arrives in time. P's
    request goes out once P holds D's registration, which on a loaded machine can come later
    than registration_wait_s (P would then compute chunks before streaming them)."""
    assert cluster.reference is not None
    prompt = make_prompt(1200, seed=7201)  # ~1,550 tokens: 7 chunks of 256 on P
    tid = f"xfer-{uuid.uuid4()}"
    counters = Counters([cluster.prefill], [cluster.decode])
    d, (p_status, p_data) = cluster.prefill_and_decode(
        tid, prompt, max_tokens=MAX_TOKENS, decode_kv=cluster.mooncake_params(tid),
        prefill_kv={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
        await_registration=True)
    assert p_status == 200, p_data
    assert d["status"] == 200, d
    ref = post_ok(cluster.reference.url, "/v1/completions",
                  completion_body(prompt, return_token_ids=True))
    assert d["data"]["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    counters.assert_kv_from_prefill(1)

    events = cluster.trace_events()
    steps = {e["step"] for e in events
             if e["ev"] == "step_plan" and tid in e.get("transfer_ids", [])}
    assert len(steps) >= 4, f"transfer {tid} planned in {len(steps)} steps"
    streamed = []
    for step in steps:
        enq = [e["t"] for e in events if e.get("step") == step and e["ev"] == "group_enqueued"]
        starts = [e["t"] for e in events
                  if e.get("step") == step and e["ev"] == "group_send_start"]
        if len(enq) >= 2 and starts and min(starts) < max(enq):
            streamed.append(step)
    assert streamed, f"no step of {tid} sent a group before its last layer ran: {sorted(steps)}"


# ------------------------------------------------------------------------- failures


def test_stale_engine_id_fails_fast_and_frees_both_sides(cluster: PDCluster,
                                                         no_leaks: None) -> None:
    """vllm-router reads P's engine id once, at start-up: after P restarts with a new one it
    keeps sending D the old one. The router's two requests with a stale ``remote_engine_id``:
    D cannot find P's engine on the bootstrap endpoint and fails the request at once, saying
    how to avoid it (pin the engine id); no KV arrives; P frees the KV no D registered for
    after registration_timeout_s (6 s here), D its blocks at once (``no_leaks``)."""
    prompt = make_prompt(200, seed=7801)
    tid = f"xfer-{uuid.uuid4()}"
    post_ok(cluster.prefill.url, "/v1/completions", completion_body(
        prompt, max_tokens=1, min_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}))
    counters = Counters([cluster.prefill], [cluster.decode])
    d_log = cluster.decode.log_path.stat().st_size
    stale = {**cluster.mooncake_params(tid), "remote_engine_id": str(uuid.uuid4())}
    t = time.monotonic()
    status, data = post_json(cluster.decode.url + "/v1/completions", completion_body(
        prompt, kv_transfer_params=stale), timeout=60)
    assert status >= 500, data
    assert time.monotonic() - t < 15
    assert "Traceback" not in json.dumps(data)
    log = log_since(cluster.decode.log_path, d_log)
    assert stale["remote_engine_id"] in log and "kv_transfer_config.engine_id" in log, log
    assert counters.rise()[f"received {cluster.decode.port}"] == 0


def test_client_disconnect_behind_router_frees_both_sides(cluster: PDCluster,
                                                          routers: dict[str, VllmRouter],
                                                          no_leaks: None) -> None:
    """A client drops its streamed request through vllm-router (mooncake) twice: while P
    prefills (P's request finishes or is aborted; a transfer no D registers for is freed
    after registration_timeout_s, 6 s here), and while D streams a long answer (D stops
    generating). Both come back to idle in bounded time."""
    url = routers["mooncake"].url
    sock = open_stream(url, "/v1/completions", completion_body(make_prompt(2300, seed=7501)))
    wait_for(lambda: running(cluster.prefill), 60, "P runs the request")
    sock.close()
    assert assert_idle(cluster.prefill, 30) < 30
    assert_idle(cluster.decode, 10)

    body = completion_body(make_prompt(60, seed=7502), max_tokens=2000, ignore_eos=True)
    sock = open_stream(url, "/v1/completions", body)
    received = b""
    deadline = time.monotonic() + 120
    while received.count(b"data: ") < 3 and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    assert received.count(b"data: ") >= 3, received[:2000]
    sock.close()
    # 2,000 tokens would keep D busy for a minute or more on a CPU core
    took = assert_idle(cluster.decode, 20)
    assert took < 20, took
    assert_idle(cluster.prefill, 10)


def test_decode_killed_mid_request_behind_router(cluster: PDCluster, spare: PDCluster,
                                                 no_leaks: None) -> None:
    """vllm-router (mooncake) in front of the shared P and the spare D; the spare D is killed
    while P prefills a long prompt. The client gets an error in bounded time, and P, which
    holds the prompt's KV for a D that never registers, frees it after
    registration_timeout_s (6 s here)."""
    router = cluster.start_router("mooncake", decodes=[spare.decode.url])
    log_offset = cluster.prefill.log_path.stat().st_size
    try:
        # ~3,000 tokens (12 chunks of 256, several seconds on P's core): P is still prefilling
        # when D is killed, even if a loaded machine delivers the kill seconds late, and then
        # waits out the rest of the prompt and registration_timeout_s
        body = completion_body(make_prompt(2300, seed=7601))
        th, out = run_in_thread(lambda: post_json(router.url + "/v1/completions", body,
                                                  timeout=120))
        wait_for(lambda: running(cluster.prefill), 60, "P runs the request")
        spare.decode.kill()
        th.join(120)
        assert not th.is_alive()
        assert "error" in out or out["result"][0] != 200, out
        assert out["elapsed"] < 90, out
    finally:
        router.stop()
    assert assert_idle(cluster.prefill, 30) < 30
    p_log = log_since(cluster.prefill.log_path, log_offset)
    # if not, the kill came after P had answered and the router had asked D
    assert "no decode registered within registration_timeout_s" in p_log, p_log[-3000:]


def test_prefill_killed_mid_request_behind_router(cluster: PDCluster, spare: PDCluster,
                                                  no_leaks: None) -> None:
    """vllm-router (mooncake) in front of the spare P and the shared D; the spare P is killed
    while it prefills a long prompt. The client gets an error in bounded time; D, which the
    router never reached, stays idle and serves on."""
    router = cluster.start_router("mooncake", prefills=[spare.router_prefill()])
    try:
        body = completion_body(make_prompt(2300, seed=7701))
        th, out = run_in_thread(lambda: post_json(router.url + "/v1/completions", body,
                                                  timeout=120))
        wait_for(lambda: running(spare.prefill), 60, "the spare P runs the request")
        t = time.monotonic()
        spare.prefill.kill()
        th.join(120)
        assert not th.is_alive()
        assert "error" in out or out["result"][0] != 200, out
        assert time.monotonic() - t < 30, out
    finally:
        router.stop()
    assert_idle(cluster.decode, 10)
    assert cluster.decode.poll_ready()
