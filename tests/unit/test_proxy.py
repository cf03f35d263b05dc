"""The P/D proxy against fake prefill/decode servers (in-process aiohttp apps on 127.0.0.1).

The fake P, by default, holds its reply until the fake D has received the request with the same
transfer_id (or fails the request after a few seconds), so every P/D test also checks that the
proxy sends D's request without waiting for P's response.

Each test is a plain function running its own event loop (no pytest-asyncio needed).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import defaultdict
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from vllm_layerkv.proxy import (
    PROXY_KEY,
    build_app,
    needs_prompt_logprobs,
    prefill_body,
    start_proxy,
)

MODEL = "fake-model"
ADMIN_KEY = "admin-key-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the detailed /health
WAIT_S = 5.0  # upper bound for anything a test waits on: failures fail, they do not hang

Handler = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


def run(coro: Awaitable[Any], timeout: float = 15.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """State shared by the fakes: which transfer_ids D has seen."""

    def __init__(self) -> None:
        self.d_seen: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.log: list[tuple[str, int, str]] = []  # (role, index, transfer_id) in arrival order


class FakeBackend:
    """A fake vLLM server that records what it receives."""

    def __init__(self, cluster: Cluster, role: str, index: int,
                 kv_endpoint: str | None = None) -> None:
        self.cluster = cluster
        self.role = role
        self.index = index
        self.kv_endpoint = kv_endpoint  # what the discovery probe answers (None: no field)
        self.requests: list[tuple[str, dict, Any]] = []  # (path, body, headers) non-probe POSTs
        self.own_requests: list[tuple[str, Any]] = []  # (what, headers): health, models, probes
        self.models_gets = 0
        self.probes = 0
        self.received = asyncio.Event()  # a (non-probe) generation request arrived
        self.cancelled = asyncio.Event()  # a generation request was cut off by the proxy
        self.on_generate: Handler | None = None  # override the default behaviour
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "FakeBackend":
        app = web.Application(client_max_size=64 * 1024 * 1024)  # vLLM has no 1 MiB limit
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        # handler_cancellation: a closed connection cancels the handler, as in vLLM (abort).
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        self.own_requests.append(("health", request.headers.copy()))
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        self.own_requests.append(("models", request.headers.copy()))
        self.models_gets += 1
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        if kv.get("layerkv_discover"):
            self.own_requests.append(("probe", request.headers.copy()))
            self.probes += 1
            out: dict[str, Any] = {"id": "cmpl-probe", "object": "text_completion",
                                   "model": body["model"],
                                   "choices": [{"index": 0, "text": "x"}]}
            if self.kv_endpoint is not None:
                out["kv_transfer_params"] = {"layerkv_endpoint": self.kv_endpoint}
            return web.json_response(out)
        self.requests.append((request.path, body, request.headers.copy()))
        self.cluster.log.append((self.role, self.index, kv.get("transfer_id", "")))
        self.received.set()
        if self.role == "decode" and "transfer_id" in kv:
            self.cluster.d_seen[kv["transfer_id"]].set()
        try:
            handler = self.on_generate or (self._default_prefill if self.role == "prefill"
                                           else self._default_decode)
            return await handler(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _default_prefill(self, request: web.Request, body: dict) -> web.StreamResponse:
        tid = (body.get("kv_transfer_params") or {}).get("transfer_id")
        if tid is not None:
            # Reply only once D has the request: proves the proxy did not wait for P first.
            try:
                await asyncio.wait_for(self.cluster.d_seen[tid].wait(), WAIT_S)
            except asyncio.TimeoutError:
                return web.json_response({"error": {"message": "D never received the request "
                                                    "before P's reply", "code": 500}}, status=500)
        return web.json_response({"id": "cmpl-p", "object": "text_completion", "model": MODEL,
                                  "choices": [{"index": 0, "text": "P"}],
                                  "kv_transfer_params": {"transfer_id": tid}})

    async def _default_decode(self, request: web.Request, body: dict) -> web.StreamResponse:
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: " + json.dumps({"i": i}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"id": "cmpl-d", "object": "text_completion", "model": MODEL,
                                  "choices": [{"index": 0, "text": "decoded by " + self.url}]})


class Harness:
    """n fake P + m fake D + the proxy + a client session."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, *,
                 prefill_urls: list[str] | None = None, decode_urls: list[str] | None = None,
                 kv_endpoints: list[str | None] | None = None, startup_timeout: float = 5.0,
                 prefill_suffix: str = "", first_token_from_prefill: bool = False,
                 routing: str = "least-loaded", dead_decode_urls: list[str] | None = None,
                 **settings: Any) -> None:
        self.settings = {"admin_key": ADMIN_KEY, **settings}  # more ProxyConfig fields
        self.first_token_from_prefill = first_token_from_prefill
        self.dead_decode_urls = dead_decode_urls or []  # given to the proxy before the fakes
        self.routing = routing
        self.cluster = Cluster()
        self.kv_endpoints = kv_endpoints or [f"10.0.0.{i + 1}:{7000 + i}"
                                             for i in range(n_prefill)]
        self.n_prefill, self.n_decode = n_prefill, n_decode
        self.extra_prefill_urls = prefill_urls
        self.extra_decode_urls = decode_urls
        self.startup_timeout = startup_timeout
        self.prefill_suffix = prefill_suffix  # appended to each P URL given to the proxy
        self.prefill: list[FakeBackend] = []
        self.decode: list[FakeBackend] = []

    async def __aenter__(self) -> "Harness":
        self.prefill = [await FakeBackend(self.cluster, "prefill", i, ep).start()
                        for i, ep in enumerate(self.kv_endpoints)]
        self.decode = [await FakeBackend(self.cluster, "decode", i).start()
                       for i in range(self.n_decode)]
        p_urls = self.extra_prefill_urls or [b.url + self.prefill_suffix for b in self.prefill]
        d_urls = self.extra_decode_urls or [*self.dead_decode_urls,
                                            *(b.url for b in self.decode)]
        self.app = build_app(p_urls, d_urls, startup_timeout=self.startup_timeout,
                             first_token_from_prefill=self.first_token_from_prefill,
                             routing=self.routing, **self.settings)
        self.proxy = self.app[PROXY_KEY]
        self.server = await start_proxy(self.app)  # as `vllm-layerkv proxy` serves it
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S * 2))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.close()
        await self.server.close()
        for b in self.prefill + self.decode:
            await b.stop()

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.client.post(self.url + path, data=data,
                                    headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 16, **extra}


async def one_token_then_stall(request: web.Request, body: dict) -> web.StreamResponse:
    """A decode instance that streams one event, then nothing until long after any wait."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"tok": 0}\n\n')
    await asyncio.sleep(WAIT_S * 3)
    return resp


# ---------------------------------------------------------------------------------------------


def test_pd_bodies_and_concurrency() -> None:
    async def main() -> None:
        async with Harness() as h:
            status, out = await h.post("/v1/completions", completion(
                stream=False, min_tokens=4, n=2, stream_options={"include_usage": True},
                kv_transfer_params={"client": "junk"}))
            assert status == 200, out
            # D's body went back to the client.
            assert out["choices"][0]["text"] == "decoded by " + h.decode[0].url
            assert len(h.prefill[0].requests) == 1 and len(h.decode[0].requests) == 1
            p_path, p_body, p_hdr = h.prefill[0].requests[0]
            d_path, d_body, d_hdr = h.decode[0].requests[0]
            assert p_path == d_path == "/v1/completions"
            tid = p_body["kv_transfer_params"]["transfer_id"]
            assert isinstance(tid, str) and len(tid) == 32 and int(tid, 16) >= 0
            assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["n"] == 1
            assert "stream_options" not in p_body and "min_tokens" not in p_body
            assert p_body["prompt"] == "Hello there" and p_body["model"] == MODEL
            # D: the client's body, untouched except kv_transfer_params.
            assert d_body["kv_transfer_params"] == {
                "do_remote_prefill": True, "transfer_id": tid,
                "remote_host": "10.0.0.1", "remote_port": 7000}
            assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == completion(
                stream=False, min_tokens=4, n=2, stream_options={"include_usage": True})
            assert p_hdr["X-Request-Id"] == d_hdr["X-Request-Id"] == tid
            # Discovery ran once, at start-up.
            assert h.prefill[0].models_gets == 1 and h.prefill[0].probes == 1

    run(main())


def test_chat_prefill_body_caps_max_completion_tokens() -> None:
    async def main() -> None:
        async with Harness() as h:
            status, out = await h.post("/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 50})
            assert status == 200, out
            _, p_body, _ = h.prefill[0].requests[0]
            _, d_body, _ = h.decode[0].requests[0]
            assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
            assert d_body["max_completion_tokens"] == 50 and "max_tokens" not in d_body
            assert h.decode[0].requests[0][0] == "/v1/chat/completions"

    run(main())


def test_streaming_passthrough_unbuffered_and_ordered() -> None:
    async def main() -> None:
        async with Harness() as h:
            events = [b"data: " + json.dumps({"tok": i}).encode() + b"\n\n" for i in range(8)]
            events.append(b"data: [DONE]\n\n")
            client_has = [asyncio.Event() for _ in events]

            async def lockstep_d(request: web.Request, body: dict) -> web.StreamResponse:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i, e in enumerate(events):
                    await resp.write(e)
                    # The next event only once the client has this one: a proxy that buffers
                    # anything stalls here, and the stream ends short.
                    await asyncio.wait_for(client_has[i].wait(), WAIT_S / 2)
                return resp

            h.decode[0].on_generate = lockstep_d
            received = b""
            async with h.client.post(h.url + "/v1/completions",
                                     json=completion(stream=True)) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for chunk in r.content.iter_any():
                    received += chunk
                    for i in range(len(events)):
                        if received.startswith(b"".join(events[:i + 1])):
                            client_has[i].set()
            assert received == b"".join(events)
            _, p_body, _ = h.prefill[0].requests[0]
            assert p_body["stream"] is False
            assert h.decode[0].requests[0][1]["stream"] is True

    run(main())


@pytest.mark.parametrize("n_p,n_d", [(2, 2), (2, 3)])
def test_round_robin_independent(n_p: int, n_d: int) -> None:
    async def main() -> None:
        async with Harness(n_p, n_d) as h:
            n_req = 6
            for _ in range(n_req):
                status, out = await h.post("/v1/completions", completion())
                assert status == 200, out
            # Requests are sequential, so the arrival log orders them.
            p_seq = [i for role, i, _ in h.cluster.log if role == "prefill"]
            d_seq = [i for role, i, _ in h.cluster.log if role == "decode"]
            assert p_seq == [k % n_p for k in range(n_req)]
            assert d_seq == [k % n_d for k in range(n_req)]  # its own cursor, not P's
            p_of = {t: i for role, i, t in h.cluster.log if role == "prefill"}
            for b in h.decode:
                for _, body, _ in b.requests:
                    kv = body["kv_transfer_params"]
                    # D is told the LayerKV endpoint of the P that got the same transfer_id.
                    host, port = h.kv_endpoints[p_of[kv["transfer_id"]]].split(":")
                    assert (kv["remote_host"], kv["remote_port"]) == (host, int(port))
            assert len(p_of) == n_req

    run(main())


def test_prompt_logprobs_go_to_prefill_alone_unchanged() -> None:
    async def main() -> None:
        async with Harness(2, 1) as h:
            req = completion(echo=True, logprobs=1, max_tokens=0)
            raw = json.dumps(req, separators=(", ", ": "))  # exact bytes must arrive at P
            seen_raw: list[bytes] = []

            async def p_alone(request: web.Request, body: dict) -> web.StreamResponse:
                seen_raw.append(await request.read())
                return web.json_response({"id": "cmpl-echo", "choices": [
                    {"index": 0, "text": "Hello there", "logprobs": {"token_logprobs": [None]}}]})

            for b in h.prefill:
                b.on_generate = p_alone
            status, out = await h.post("/v1/completions", raw)
            assert status == 200, out
            assert out["id"] == "cmpl-echo"
            assert seen_raw == [raw.encode()]
            assert h.prefill[0].requests[0][1] == req  # no kv_transfer_params added
            assert h.decode[0].requests == []
            # prompt_logprobs on chat goes to P alone too, round-robin over the P list.
            status, out = await h.post("/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "prompt_logprobs": 0})
            assert status == 200, out
            assert len(h.prefill[1].requests) == 1 and h.decode[0].requests == []
            assert "kv_transfer_params" not in h.prefill[1].requests[0][1]
            # echo without logprobs is a normal P/D request.
            status, _ = await h.post("/v1/completions", completion(echo=True, logprobs=None))
            assert status == 200 and len(h.decode[0].requests) == 1

    run(main())


def test_routing_rule_helpers() -> None:
    assert needs_prompt_logprobs({"echo": True, "logprobs": 0}, chat=False)
    assert not needs_prompt_logprobs({"echo": True, "logprobs": None}, chat=False)
    assert not needs_prompt_logprobs({"echo": False, "logprobs": 5}, chat=False)
    assert not needs_prompt_logprobs({"echo": True, "logprobs": True}, chat=True)
    assert needs_prompt_logprobs({"prompt_logprobs": 1}, chat=True)
    body = {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9, "best_of": 3}
    p = prefill_body(body, "t", chat=False)
    assert "max_completion_tokens" not in p and "best_of" not in p
    assert body == {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9, "best_of": 3}


def test_prefill_error_cancels_decode() -> None:
    async def main() -> None:
        async with Harness() as h:
            async def failing_p(request: web.Request, body: dict) -> web.StreamResponse:
                tid = body["kv_transfer_params"]["transfer_id"]
                await asyncio.wait_for(h.cluster.d_seen[tid].wait(), WAIT_S)
                return web.json_response({"error": {"message": "prompt too long for P",
                                                    "type": "BadRequestError", "code": 400}},
                                         status=400)

            async def waiting_d(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.sleep(WAIT_S * 3)  # "waiting for KV"; the proxy must cut it off
                return web.json_response({"error": "not cancelled"}, status=500)

            h.prefill[0].on_generate = failing_p
            h.decode[0].on_generate = waiting_d
            for stream in (False, True):
                h.decode[0].cancelled.clear()
                status, out = await h.post("/v1/completions", completion(stream=stream))
                assert status == 400, out
                assert out["error"]["message"] == "prompt too long for P"
                await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)

    run(main())


def test_prefill_error_after_stream_started_ends_stream_with_error_event() -> None:
    async def main() -> None:
        async with Harness() as h:
            first_seen = asyncio.Event()

            async def failing_p(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.wait_for(first_seen.wait(), WAIT_S)
                return web.json_response({"error": {"message": "P crashed", "type": "X",
                                                    "code": 500}}, status=500)

            h.prefill[0].on_generate = failing_p
            h.decode[0].on_generate = one_token_then_stall
            received = b""
            async with h.client.post(h.url + "/v1/completions",
                                     json=completion(stream=True)) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    received += chunk
                    first_seen.set()
            assert received.startswith(b'data: {"tok": 0}\n\n')
            events = [e for e in received.split(b"\n\n") if e]
            err = json.loads(events[1][len(b"data: "):])
            assert err["error"]["code"] == 500 and "P crashed" in err["error"]["message"]
            assert events[-1] == b"data: [DONE]"
            await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)

    run(main())


def test_decode_error_cancels_prefill() -> None:
    async def main() -> None:
        async with Harness() as h:
            async def holding_p(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.sleep(WAIT_S * 3)
                return web.json_response({})

            async def bad_d(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.wait_for(h.prefill[0].received.wait(), WAIT_S)  # P has it too
                return web.json_response({"error": {"message": "max_tokens too large",
                                                    "code": 400}}, status=400)

            h.prefill[0].on_generate = holding_p
            h.decode[0].on_generate = bad_d
            status, out = await h.post("/v1/completions", completion())
            assert status == 400 and out["error"]["message"] == "max_tokens too large"
            await asyncio.wait_for(h.prefill[0].cancelled.wait(), WAIT_S)

    run(main())


def test_client_disconnect_cancels_both() -> None:
    async def main() -> None:
        async with Harness() as h:
            async def holding_p(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.sleep(WAIT_S * 3)
                return web.json_response({})

            h.prefill[0].on_generate = holding_p
            h.decode[0].on_generate = one_token_then_stall
            r = await h.client.post(h.url + "/v1/completions", json=completion(stream=True))
            assert r.status == 200
            assert (await r.content.readany()).startswith(b"data: ")
            await asyncio.wait_for(h.prefill[0].received.wait(), WAIT_S)
            r.close()  # the client goes away mid-stream
            await asyncio.wait_for(h.prefill[0].cancelled.wait(), WAIT_S)
            await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)
            await asyncio.sleep(0.05)
            assert not h.proxy.background.tasks  # nothing left running

    run(main())


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "body is empty"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"prompt": "x"}).encode(), "missing 'model'"),
    (json.dumps({"model": MODEL}).encode(), "missing 'prompt'"),
])
def test_bad_requests_get_400(raw: bytes, needle: str) -> None:
    async def main() -> None:
        async with Harness() as h:
            status, out = await h.post("/v1/completions", raw)
            assert status == 400, out
            assert out["error"]["type"] == "invalid_request_error"
            assert out["error"]["code"] == 400
            assert needle in out["error"]["message"], out
            status, out = await h.post("/v1/chat/completions", {"model": MODEL, "prompt": "x"})
            assert status == 400 and "missing 'messages'" in out["error"]["message"]
            assert h.prefill[0].requests == [] and h.decode[0].requests == []

    run(main())


def test_unknown_route_is_json_404() -> None:
    async def main() -> None:
        async with Harness() as h:
            status, out = await h.post("/v1/embeddings", {"model": MODEL})
            assert status == 404 and "/v1/completions" in out["error"]["message"]

    run(main())


def test_health_and_models() -> None:
    async def main() -> None:
        async with Harness() as h:
            await h.proxy.wait_ready()  # start-up discovery has run
            async with h.client.get(h.url + "/health", headers=ADMIN) as r:
                out = await r.json()
                assert r.status == 200, out
            assert out["status"] == "ok"
            assert out["prefill"][h.prefill[0].url]["layerkv_endpoint"] == "10.0.0.1:7000"
            assert out["decode"][h.decode[0].url]["healthy"] is True
            async with h.client.get(h.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL
            assert h.decode[0].models_gets == 1

    run(main())


def test_health_503_names_dead_backend_and_unreachable_decode_is_502() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with Harness(decode_urls=[dead], startup_timeout=0.3) as h:
            async with h.client.get(h.url + "/health", headers=ADMIN) as r:
                out = await r.json()
                assert r.status == 503, out
            assert out["status"] == "unhealthy"
            assert dead in out["message"] and len(out["failing"]) == 1
            assert out["decode"][dead]["healthy"] is False
            assert out["prefill"][h.prefill[0].url]["healthy"] is True
            status, out = await h.post("/v1/completions", completion())
            assert status == 502, out
            # names the role, not the URL (that goes to the proxy's log)
            assert "decode instance 0" in out["error"]["message"], out
            assert dead not in out["error"]["message"] and "unreachable" in out["error"]["message"]
            # P's half was cancelled: it never arrived, or its handler was cut off.
            await asyncio.sleep(0.3)
            assert not h.prefill[0].requests or h.prefill[0].cancelled.is_set()

    run(main())


def test_kv_fragment_override_skips_discovery() -> None:
    async def main() -> None:
        # The fake P would answer discovery with 10.0.0.1:7000; the fragment must win.
        async with Harness(prefill_suffix="#kv=10.9.8.7:4321") as h:
            status, out = await h.post("/v1/completions", completion())
            assert status == 200, out
            kv = h.decode[0].requests[0][1]["kv_transfer_params"]
            assert (kv["remote_host"], kv["remote_port"]) == ("10.9.8.7", 4321)
            assert (h.prefill[0].models_gets, h.prefill[0].probes) == (0, 0)
            assert h.proxy.prefill.items[0].url == h.prefill[0].url  # fragment stripped

    run(main())


def test_discovery_without_layerkv_is_a_clear_502() -> None:
    async def main() -> None:
        async with Harness(kv_endpoints=[None]) as h:
            status, out = await h.post("/v1/completions", completion())
            assert status == 502, out
            msg = out["error"]["message"]
            assert "does not run the LayerKV connector as kv_producer" in msg
            assert "prefill instance 0" in msg and h.prefill[0].url not in msg
            assert h.prefill[0].requests == [] and h.decode[0].requests == []
            assert h.prefill[0].probes == 2  # start-up, then once more lazily for the request
            # /health says so too: P is up, but P/D requests through it cannot work
            async with h.client.get(h.url + "/health", headers=ADMIN) as r:
                health = await r.json()
                assert r.status == 503, health
            assert health["status"] == "unhealthy" and h.prefill[0].url in health["message"]
            assert "does not run the LayerKV connector" in health["message"]
            entry = health["prefill"][h.prefill[0].url]
            assert entry["layerkv_endpoint"] is None and "LayerKV" in entry["discovery_error"]

    run(main())


def test_health_polling_alone_retries_a_failed_discovery() -> None:
    async def main() -> None:
        async with Harness(kv_endpoints=[None]) as h:
            await h.proxy.wait_ready()  # start-up discovery failed
            h.prefill[0].kv_endpoint = "10.0.0.1:7000"  # P now answers as LayerKV
            statuses = []
            for _ in range(50):  # a start-up script polling /health, sending no request
                async with h.client.get(h.url + "/health") as r:
                    statuses.append(r.status)
                if r.status == 200:
                    break
                await asyncio.sleep(0.02)
            assert statuses[0] == 503 and statuses[-1] == 200, statuses
            assert h.prefill[0].requests == []  # only discovery probes reached P

    run(main())


def test_health_recovers_once_discovery_succeeds() -> None:
    async def main() -> None:
        async with Harness(kv_endpoints=[None]) as h:
            await h.proxy.wait_ready()  # start-up discovery failed
            async with h.client.get(h.url + "/health") as r:
                assert r.status == 503
            h.prefill[0].kv_endpoint = "10.0.0.1:7000"  # P now runs LayerKV (restarted)
            status, out = await h.post("/v1/completions", completion())
            assert status == 200, out
            async with h.client.get(h.url + "/health", headers=ADMIN) as r:
                health = await r.json()
                assert r.status == 200, health
            entry = health["prefill"][h.prefill[0].url]
            assert entry["layerkv_endpoint"] == "10.0.0.1:7000" and "discovery_error" not in entry

    run(main())


def test_discovered_unspecified_host_uses_url_host() -> None:
    async def main() -> None:
        async with Harness(kv_endpoints=["0.0.0.0:7123"]) as h:
            status, out = await h.post("/v1/completions", completion())
            assert status == 200, out
            kv = h.decode[0].requests[0][1]["kv_transfer_params"]
            assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", 7123)

    run(main())
