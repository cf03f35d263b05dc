"""The proxy tried as an attacker would, over real HTTP: the proxy served in-process by
``start_proxy`` (as ``vllm-layerkv proxy`` serves it) in front of the fake P and D of
test_proxy.py.

Each attack asserts its outcome, that this process's resident memory (VmRSS from
/proc/self/status: the proxy, its fakes and the attacking client all run here) grows by less
than a stated bound while the attack lasts, and that an honest request sent beside the attack is
answered as usual, and promptly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any, AsyncIterator, Awaitable, TypeVar

import aiohttp
import pytest
from aiohttp import web
from test_proxy import ADMIN, ADMIN_KEY, MODEL, WAIT_S, Harness, completion, free_port, run

from vllm_layerkv.cli import build_parser
from vllm_layerkv.proxy import ProxyConfig, config_from_args
from vllm_layerkv.proxy.server import LINGERING_S

T = TypeVar("T")
MIB = 1024 * 1024
HONEST_WITHIN_S = 3.0
"""An honest request beside an attack is answered within this (alone: a few milliseconds)."""

EVIL_PARAMS = {"transfer_id": "chosen-by-the-client", "layerkv_discover": True,
               "do_remote_prefill": True, "remote_host": "203.0.113.9", "remote_port": 6666}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class RssWatch:
    """The peak growth of VmRSS over its value on entry, sampled every few milliseconds."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RssWatch:
        self.base = self.peak = rss_bytes()
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            await asyncio.sleep(0.005)

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.base


async def post(session: aiohttp.ClientSession, url: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """(status, JSON or text, response headers)."""
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json",
                                                     **(headers or {})}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


async def beside(h: Harness, attack: Awaitable[T], rss_bound_mib: float,
                 headers: dict[str, str] | None = None) -> T:
    """Run ``attack`` with an honest completion sent while it runs; check the honest answer and
    the memory bound; the attack's result."""
    async def honest() -> tuple[int, Any, float]:
        await asyncio.sleep(0.05)  # the attack is under way
        start = time.monotonic()
        status, out, _ = await post(h.client, h.url + "/v1/completions", completion(),
                                    headers)
        return status, out, time.monotonic() - start

    async with RssWatch() as rss:
        result, (status, out, took) = await asyncio.gather(attack, honest())
    assert status == 200, out
    assert "decoded by " in out["choices"][0]["text"], out  # after P's token, if first
    assert took < HONEST_WITHIN_S, f"the honest request took {took:.2f} s"
    assert rss.growth < rss_bound_mib * MIB, \
        f"RSS grew by {rss.growth / MIB:.1f} MiB during the attack (bound {rss_bound_mib} MiB)"
    return result


def attack_session() -> aiohttp.ClientSession:
    """A client without a connection limit (aiohttp's default queues beyond 100)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=WAIT_S * 2))


async def read_response(reader: asyncio.StreamReader, timeout: float
                        ) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    return status, headers, body


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float:
    """Seconds until the proxy closes the connection (whatever it sends first is dropped)."""
    start = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def no_address(text: str, h: Harness, *extra: str) -> None:
    """``text`` names no backend URL, host:port or LayerKV endpoint."""
    for b in h.prefill + h.decode:
        assert b.url not in text and b.url.split("//")[1] not in text, text
    for endpoint in [*h.kv_endpoints, *extra]:
        assert endpoint is None or endpoint not in text, text
    assert "http://" not in text and "127.0.0.1" not in text, text


# --- credentials -----------------------------------------------------------------------------


def test_backend_key_is_for_the_proxys_own_requests_only() -> None:
    """``VLLM_API_KEY`` goes on discovery and health checks, never on a client's request; a
    client's own Authorization goes through unchanged."""
    async def main() -> None:
        async with Harness(backend_api_key="backend-secret") as h:
            await h.proxy.wait_ready()
            own = [what for what, hdr in h.prefill[0].own_requests
                   if hdr.get("Authorization") == "Bearer backend-secret"]
            assert {"health", "models", "probe"} <= set(own), h.prefill[0].own_requests
            assert all(hdr.get("Authorization") == "Bearer backend-secret"
                       for _, hdr in h.decode[0].own_requests)
            seen_d_models = len(h.decode[0].own_requests)

            async def anonymous_clients() -> None:
                async with attack_session() as s:
                    requests = [completion(), completion(stream=True),
                                completion(prompt_logprobs=1),
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                 "stream": True}] * 20
                    paths = ["/v1/completions"] * 3 + ["/v1/chat/completions"] * 2
                    results = await asyncio.gather(*(
                        post(s, h.url + paths[i % 5], r) for i, r in enumerate(requests)))
                    assert all(status == 200 for status, _, _ in results), results
                    async with s.get(h.url + "/v1/models") as r:
                        assert r.status == 200

            await beside(h, anonymous_clients(), rss_bound_mib=48)
            client_requests = [hdr for b in h.prefill + h.decode for _, _, hdr in b.requests]
            assert len(client_requests) == 20 * (2 * 4 + 1) + 2  # P and D each; logprobs: P
            assert all("Authorization" not in hdr for hdr in client_requests)
            assert all("Authorization" not in hdr
                       for _, hdr in h.decode[0].own_requests[seen_d_models:]
                       if _ == "models"), "a client's /v1/models carried the backends' key"

            status, _, _ = await post(h.client, h.url + "/v1/completions", completion(),
                                      {"Authorization": "Bearer clients-own"})
            assert status == 200
            assert h.prefill[0].requests[-1][2]["Authorization"] == "Bearer clients-own"
            assert h.decode[0].requests[-1][2]["Authorization"] == "Bearer clients-own"

    run(main(), timeout=30)


def test_api_key_refuses_anonymous_and_wrong_keys() -> None:
    async def main() -> None:
        key = {"Authorization": "Bearer client-key"}
        async with Harness(api_keys=("other-key", "client-key")) as h:
            await h.proxy.wait_ready()
            for headers in ({}, {"Authorization": "Bearer client-ke"},
                            {"Authorization": "Bearer client-key2"},
                            {"Authorization": "Basic client-key"}, {"Authorization": "client-key"},
                            {"Authorization": f"Bearer {ADMIN_KEY}"}):
                status, out, hdrs = await post(h.client, h.url + "/v1/completions",
                                               completion(), headers)
                assert status == 401, (headers, out)
                assert out["error"]["type"] == "authentication_error", out
                assert out["error"]["code"] == 401 and "Bearer" in out["error"]["message"]
                assert "client-key" not in out["error"]["message"]
                assert hdrs["WWW-Authenticate"] == "Bearer"
            for path in ("/v1/models", "/v1/embeddings", "/metrics"):
                async with h.client.get(h.url + path) as r:
                    assert r.status == 401, path
            async with h.client.get(h.url + "/health") as r:
                assert r.status == 200  # probes need no key
            assert h.prefill[0].requests == [] and h.decode[0].requests == []

            async def anonymous_flood() -> list[int]:
                async with attack_session() as s:
                    body = json.dumps(completion(prompt="x" * 65536))
                    results = await asyncio.gather(*(
                        post(s, h.url + "/v1/completions", body) for _ in range(300)))
                return [status for status, _, _ in results]

            statuses = await beside(h, anonymous_flood(), rss_bound_mib=48, headers=key)
            assert statuses == [401] * 300
            assert len(h.decode[0].requests) == 1  # the honest request alone got through
            assert h.decode[0].requests[0][2]["Authorization"] == "Bearer client-key"
            assert h.proxy.admission.active == 0

    run(main(), timeout=30)


def test_keys_from_options_and_environment() -> None:
    parser = build_parser()
    args = parser.parse_args(["proxy", "--prefill", "http://127.0.0.1:8100", "--decode",
                              "http://127.0.0.1:8200", "--port", "8000"])
    env = {"VLLM_API_KEY": "backend", "LAYERKV_PROXY_API_KEY": "client",
           "LAYERKV_PROXY_ADMIN_KEY": "admin"}
    config = config_from_args(args, env)
    assert config.backend_api_key == "backend"
    assert config.api_keys == ("client",) and config.admin_key == "admin"
    # the backend key never serves clients
    assert config_from_args(args, {"VLLM_API_KEY": "backend"}).api_keys == ()
    args = parser.parse_args(["proxy", "--prefill", "http://127.0.0.1:8100", "--decode",
                              "http://127.0.0.1:8200", "--port", "8000", "--api-key", "a", "b",
                              "--admin-key", "c", "--max-body-bytes", "1000",
                              "--max-concurrent-requests", "7", "--header-timeout", "2",
                              "--body-timeout", "3", "--max-json-depth", "9"])
    config = config_from_args(args, env)
    assert config.api_keys == ("a", "b") and config.admin_key == "c"
    assert (config.max_body_bytes, config.max_concurrent_requests, config.header_timeout,
            config.body_timeout, config.max_json_depth) == (1000, 7, 2.0, 3.0, 9)
    for bad, option in ((dict(max_body_bytes=0), "--max-body-bytes"),
                        (dict(max_concurrent_requests=-1), "--max-concurrent-requests"),
                        (dict(header_timeout=0), "--header-timeout"),
                        (dict(body_timeout=float("nan")), "--body-timeout"),
                        (dict(max_json_depth=100000), "--max-json-depth"),
                        (dict(api_keys=("",)), "--api-key")):
        with pytest.raises(ValueError, match=re.escape(option)):
            ProxyConfig(**bad)  # type: ignore[arg-type]


# --- kv_transfer_params --------------------------------------------------------------------


def proxys_own(kv: Any, role: str) -> str:
    """The transfer_id of kv_transfer_params the proxy wrote (fails on a client's)."""
    assert isinstance(kv, dict), kv
    tid = kv["transfer_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", tid), kv
    assert "layerkv_discover" not in kv and "203.0.113.9" not in json.dumps(kv), kv
    if role == "prefill":
        assert kv == {"do_remote_decode": True, "transfer_id": tid}, kv
    else:
        assert kv["do_remote_prefill"] is True and kv["remote_host"] == "10.0.0.1", kv
    return tid


@pytest.mark.parametrize("first_token_from_prefill", [False, True])
def test_client_kv_transfer_params_never_reach_a_backend(first_token_from_prefill: bool) -> None:
    chat = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, dict[str, Any], str]] = [  # (path, body, served by)
        ("/v1/completions", completion(kv_transfer_params=EVIL_PARAMS), "pd"),
        ("/v1/completions", completion(stream=True, kv_transfer_params=EVIL_PARAMS), "pd"),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat,
                                  "kv_transfer_params": EVIL_PARAMS}, "pd"),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "stream": True,
                                  "kv_transfer_params": EVIL_PARAMS}, "pd"),
        ("/v1/completions", completion(vllm_xargs={"kv_transfer_params": "x", "keep": 1}),
         "pd"),
        ("/v1/completions", completion(prompt_logprobs=1, kv_transfer_params=EVIL_PARAMS), "p"),
        ("/v1/completions", completion(echo=True, logprobs=1, kv_transfer_params=None), "p"),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "prompt_logprobs": 0,
                                  "kv_transfer_params": EVIL_PARAMS}, "p"),
        ("/v1/completions", completion(prompt_logprobs=1, stream=True,
                                       vllm_xargs={"kv_transfer_params": "x", "keep": 1}), "p"),
    ]

    async def main() -> None:
        async with Harness(first_token_from_prefill=first_token_from_prefill) as h:
            await h.proxy.wait_ready()

            def received(b: Any, mark: str) -> list[dict[str, Any]]:
                return [sent for _, sent, _ in b.requests if sent.get("user") == mark]

            async def each_path() -> None:
                for i, (path, body, served_by) in enumerate(cases):
                    mark = f"case {i}"  # finds this request among the honest ones beside it
                    status, out, _ = await post(h.client, h.url + path, {**body, "user": mark})
                    assert status == 200, (path, body, out)
                    [p_body] = received(h.prefill[0], mark)
                    if served_by == "p":  # prompt logprobs: P alone, without any params
                        assert received(h.decode[0], mark) == []
                        assert "kv_transfer_params" not in p_body, p_body
                        assert "kv_transfer_params" not in p_body.get("vllm_xargs", {})
                        continue
                    [d_body] = received(h.decode[0], mark)
                    tid = proxys_own(p_body["kv_transfer_params"], "prefill")
                    assert proxys_own(d_body["kv_transfer_params"], "decode") == tid
                    for sent in (p_body, d_body):
                        assert "kv_transfer_params" not in sent.get("vllm_xargs", {}), sent
                    if "vllm_xargs" in body:
                        assert d_body["vllm_xargs"] == {"keep": 1}

            async def discovery_requests() -> list[int]:
                async with attack_session() as s:
                    results = await asyncio.gather(*(post(s, h.url + "/v1/completions",
                                                          completion(kv_transfer_params={
                                                              "layerkv_discover": True}))
                                                     for _ in range(100)))
                return [status for status, _, _ in results]

            await beside(h, each_path(), rss_bound_mib=48)
            statuses = await beside(h, discovery_requests(), rss_bound_mib=48)
            assert statuses == [200] * 100
            assert h.prefill[0].probes == 1  # the proxy's own discovery at start-up only
            for b in h.prefill + h.decode:
                for _, sent, _ in b.requests:
                    assert "layerkv_discover" not in json.dumps(sent), sent

    run(main(), timeout=30)


# --- bodies ----------------------------------------------------------------------------------


async def endless_chunks(total: int, chunk: bytes) -> AsyncIterator[bytes]:
    """A body streamed without Content-Length (chunked), never held in memory at once."""
    sent = 0
    while sent < total:
        yield chunk
        sent += len(chunk)


def test_body_limit_answers_413_without_buffering() -> None:
    limit = MIB

    async def main() -> None:
        async with Harness(max_body_bytes=limit) as h:
            await h.proxy.wait_ready()
            # just at the limit: accepted
            body = json.dumps(completion(prompt="")).encode()
            exact = json.dumps(completion(prompt="x" * (limit - len(body)))).encode()
            assert len(exact) == limit
            status, out, _ = await post(h.client, h.url + "/v1/completions", exact)
            assert status == 200, out
            status, out, _ = await post(h.client, h.url + "/v1/completions", exact + b" ")
            assert status == 413 and "--max-body-bytes" in out["error"]["message"], out

            async def declared_too_large() -> tuple[int, bytes, float]:
                """A head declaring 64 MiB: refused before any of it is sent."""
                reader, writer = await asyncio.open_connection("127.0.0.1", h.server.port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n" % (64 * MIB))
                status, _, answer = await read_response(reader, WAIT_S)
                took = await closed_within(reader, WAIT_S)
                writer.close()
                return status, answer, took

            async def streamed_too_large(s: aiohttp.ClientSession) -> int:
                """64 MiB sent chunked, without Content-Length."""
                try:
                    async with s.post(h.url + "/v1/completions", headers={
                            "Content-Type": "application/json"},
                            data=endless_chunks(64 * MIB, b"[" * 65536)) as r:
                        return r.status
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                    return -1  # the proxy closed while the client was still sending

            async def attack() -> tuple[list[tuple[int, bytes, float]], list[int]]:
                async with attack_session() as s:
                    return await asyncio.gather(
                        asyncio.gather(*(declared_too_large() for _ in range(10))),
                        asyncio.gather(*(streamed_too_large(s) for _ in range(10))))

            declared, streamed = await beside(h, attack(), rss_bound_mib=48)
            for status, answer, took in declared:
                assert status == 413 and b"--max-body-bytes" in answer
                assert took < LINGERING_S + 1.0  # then the connection is closed
            assert streamed.count(413) >= 8 and set(streamed) <= {413, -1}, streamed

    run(main(), timeout=40)


def test_slow_heads_and_bodies_are_cut_off() -> None:
    timeout = 0.5

    async def main() -> None:
        async with Harness(header_timeout=timeout, body_timeout=timeout) as h:
            await h.proxy.wait_ready()
            port = h.server.port

            async def half_sent_head(head: bytes) -> float:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head)
                took = await closed_within(reader, WAIT_S)
                writer.close()
                return took

            async def half_sent_body(trickle: bool) -> tuple[int, float]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
                start = time.monotonic()

                async def keep_trickling() -> None:
                    while trickle:
                        await asyncio.sleep(0.05)
                        writer.write(b" ")

                sender = asyncio.create_task(keep_trickling())
                status, _, _ = await read_response(reader, WAIT_S)
                await closed_within(reader, WAIT_S)
                sender.cancel()
                writer.close()
                return status, time.monotonic() - start

            async def attack() -> tuple[list[float], list[tuple[int, float]]]:
                heads = [b"", b"POST /v1/completions HTTP/1.1\r\n",
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"] * 70
                return await asyncio.gather(
                    asyncio.gather(*(half_sent_head(head) for head in heads)),
                    asyncio.gather(*(half_sent_body(i % 2 == 0) for i in range(40))))

            heads, bodies = await beside(h, attack(), rss_bound_mib=48)
            assert max(heads) < timeout + 1.0, max(heads)  # sweeps every timeout / 4
            for status, took in bodies:
                assert status == 408, bodies
                assert took < timeout + LINGERING_S + 1.0, took
            assert h.proxy.heads.watched == 0 and h.proxy.admission.active == 0

            # The deadline is for a connection's first head: a kept-alive client connection
            # serves request after request for longer than that.
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector) as s:
                for _ in range(4):
                    status, out, _ = await post(s, h.url + "/v1/completions", completion())
                    assert status == 200, out
                    await asyncio.sleep(timeout / 2)
            assert len(h.decode[0].requests) == 1 + 4  # beside()'s honest one, then these

    run(main(), timeout=30)


@pytest.mark.parametrize("raw,needle", [
    (b"[" * 100_000 + b"]" * 100_000, "more than 128 levels deep"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "more than 128 levels deep"),
    (json.dumps(completion(x=json.loads("[" * 128 + "]" * 128))).encode(),
     "more than 128 levels deep"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not UTF-8"),
    (b'{"model": "m", "prompt": "x"', "not valid JSON"),
    (b'{"model": "m", "prompt": [' + b"9" * 5000 + b"]}", "not valid JSON"),
])
def test_malformed_and_deep_json_get_400(raw: bytes, needle: str) -> None:
    async def main() -> None:
        async with Harness() as h:
            await h.proxy.wait_ready()

            async def attack() -> list[tuple[int, Any, Any]]:
                async with attack_session() as s:
                    return await asyncio.gather(*(
                        post(s, h.url + path, raw)
                        for path in ("/v1/completions", "/v1/chat/completions") * 20))

            for status, out, _ in await beside(h, attack(), rss_bound_mib=48):
                assert status == 400, out
                assert out["error"]["type"] == "invalid_request_error", out
                assert needle in out["error"]["message"], out
            assert len(h.prefill[0].requests) == 1  # beside()'s honest request alone

    run(main(), timeout=30)


def test_json_depth_at_the_limit_is_served() -> None:
    async def main() -> None:
        async with Harness(max_json_depth=16) as h:
            nested = json.loads("[" * 15 + "]" * 15)  # 15 levels inside the body's object
            status, out, _ = await post(h.client, h.url + "/v1/completions",
                                        completion(x=nested))
            assert status == 200, out
            assert h.decode[0].requests[0][1]["x"] == nested
            status, out, _ = await post(h.client, h.url + "/v1/completions",
                                        completion(x=[nested]))
            assert status == 400 and "--max-json-depth" in out["error"]["message"], out

    run(main())


# --- concurrency -----------------------------------------------------------------------------


def test_requests_beyond_the_concurrency_limit_get_503_at_once() -> None:
    limit = 4

    async def main() -> None:
        async with Harness(max_concurrent_requests=limit) as h:
            await h.proxy.wait_ready()
            gate = asyncio.Event()

            async def held_stream(request: web.Request, body: dict) -> web.StreamResponse:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"tok": 0}\n\n')
                await gate.wait()
                await resp.write(b'data: {"tok": 1}\n\ndata: [DONE]\n\n')
                return resp

            h.decode[0].on_generate = held_stream
            held = [await h.client.post(h.url + "/v1/completions", json=completion(stream=True))
                    for _ in range(limit)]
            for r in held:  # each admitted and streaming
                assert r.status == 200 and (await r.content.readany()).startswith(b"data: ")
            assert h.proxy.admission.active == limit

            async def flood() -> list[tuple[int, Any, Any]]:
                async with attack_session() as s:
                    results = await asyncio.gather(*(
                        post(s, h.url + "/v1/completions", completion()) for _ in range(200)))
                    async with s.get(h.url + "/health") as r:
                        assert r.status == 200  # not counted, still answered
                return results

            start = time.monotonic()
            async with RssWatch() as rss:
                results = await flood()
            assert time.monotonic() - start < HONEST_WITHIN_S  # refused at once, not queued
            assert rss.growth < 48 * MIB, rss.growth / MIB
            for status, out, hdrs in results:
                assert status == 503, out
                assert hdrs["Retry-After"] == "1"
                assert out["error"]["type"] == "service_unavailable"
                assert "--max-concurrent-requests" in out["error"]["message"]
            assert len(h.decode[0].requests) == limit  # none of the flood reached D
            # the requests being served are unaffected
            gate.set()
            for r in held:
                assert (await r.read()).endswith(b'data: {"tok": 1}\n\ndata: [DONE]\n\n')
                r.close()
            assert h.proxy.admission.active == 0
            h.decode[0].on_generate = None
            status, out, _ = await post(h.client, h.url + "/v1/completions", completion())
            assert status == 200, out

    run(main(), timeout=30)


# --- what answers reveal ---------------------------------------------------------------------


def test_open_health_names_no_internal_address() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with Harness(1, 1, dead_decode_urls=[dead], kv_endpoints=[None],
                           startup_timeout=0.2) as h:
            await h.proxy.wait_ready()
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with h.client.get(h.url + "/health", headers=headers) as r:
                    text = await r.text()
                    assert r.status == 503, text
                no_address(text, h, dead)
                out = json.loads(text)
                assert out["status"] == "unhealthy"
                assert {name: e["healthy"] for name, e in out["decode"].items()} == {
                    "decode instance 0": False, "decode instance 1": True}
                p0 = out["prefill"]["prefill instance 0"]
                assert p0["healthy"] is False and p0["in_flight"] == 0
                assert "does not run the LayerKV connector" in p0["discovery_error"]
                assert any(f.startswith("decode instance 0 (unreachable") for f in out["failing"])
            async with h.client.get(h.url + "/health", headers=ADMIN) as r:
                detailed = await r.json()
            assert dead in detailed["message"] and h.prefill[0].url in detailed["prefill"]

    run(main())


def test_health_polling_shares_one_round_of_backend_checks() -> None:
    async def main() -> None:
        async with Harness() as h:
            await h.proxy.wait_ready()
            checks_before = sum(w == "health" for w, _ in h.prefill[0].own_requests)

            async def poll() -> list[int]:
                async with attack_session() as s:
                    async def one() -> int:
                        async with s.get(h.url + "/health") as r:
                            text = await r.text()
                            no_address(text, h)
                            return r.status
                    return await asyncio.gather(*(one() for _ in range(300)))

            assert await beside(h, poll(), rss_bound_mib=48) == [200] * 300
            checks = sum(w == "health" for w, _ in h.prefill[0].own_requests) - checks_before
            assert 1 <= checks <= 30, checks  # one per round, not one per /health

    run(main(), timeout=30)


def test_502_bodies_name_the_role_not_the_url(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with Harness(prefill_urls=[dead], startup_timeout=0.2,
                           kv_endpoints=["10.0.0.1:7000"]) as h:
            await h.proxy.wait_ready()
            status, out, _ = await post(h.client, h.url + "/v1/completions", completion())
            assert status == 502 and out["error"]["type"] == "bad_gateway", out
            assert out["error"]["message"].startswith("LayerKV discovery: prefill instance 0")
            no_address(json.dumps(out), h, dead)
        async with Harness(prefill_suffix="#kv=10.9.8.7:4321") as h:
            d = h.decode[0]

            async def breaks_off(request: web.Request, body: dict) -> web.StreamResponse:
                if not body.get("stream"):  # the honest request
                    return await d._default_decode(request, body)
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"tok": 0}\n\n')
                assert request.transport is not None
                request.transport.close()  # D dies mid-stream
                return resp

            async def broken_streams() -> list[tuple[int, bytes]]:
                async with attack_session() as s:
                    async def one() -> tuple[int, bytes]:
                        async with s.post(h.url + "/v1/completions",
                                          json=completion(stream=True)) as r:
                            return r.status, await r.read()
                    return await asyncio.gather(*(one() for _ in range(50)))

            d.on_generate = breaks_off
            for status, raw in await beside(h, broken_streams(), rss_bound_mib=48):
                no_address(raw.decode(), h, "10.9.8.7:4321")
                if status == 502:  # D broke off before its first bytes were relayed
                    error = json.loads(raw)["error"]
                else:  # after: the stream ends with an error event
                    assert status == 200, raw
                    events = [e for e in raw.split(b"\n\n") if e]
                    assert events[0] == b'data: {"tok": 0}' and events[-1] == b"data: [DONE]"
                    error = json.loads(events[-2][len(b"data: "):])["error"]
                assert error["code"] == 502, raw
                assert error["message"].startswith("decode instance 0 broke off its response")
        logged = caplog.text
        assert dead in logged  # the URL is in the proxy's log

    caplog.set_level(logging.WARNING, logger="vllm.layerkv.proxy")
    run(main(), timeout=30)
