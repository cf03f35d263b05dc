"""The proxy's ``--first-token-from-prefill`` (proxy/first_token.py) against fake P and D:
the client's first token is P's, sent as soon as P answers; D is asked for one token fewer and
told to continue from P's; usage counts P's token; requests that could tell the difference
take the usual path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from test_proxy import MODEL, WAIT_S, Harness, completion, run

from vllm_layerkv.proxy.first_token import UsagePlusOne, ineligible

P_TEXT, P_TOKEN = " P1", 11


def p_answer(finish_reason: str = "length") -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": P_TEXT, "finish_reason": finish_reason,
                         "stop_reason": None, "token_ids": [P_TOKEN]}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            "kv_transfer_params": {"transfer_id": "t", "layerkv_endpoint": "10.0.0.1:7000"}}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


D_EVENTS = [event({"choices": [{"index": 0, "text": "D2"}]}),
            event({"choices": [{"index": 0, "text": "D3"}]}),
            event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                            "total_tokens": 7}}),
            b"data: [DONE]\n\n"]


def sse_texts(raw: bytes) -> list[Any]:
    out = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: ") and ev != b"data: [DONE]":
            out.append(json.loads(ev[6:]))
    return out


async def answering_p(request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response(p_answer())


def test_stream_starts_with_prefills_token_before_decode_answers() -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            client_has_p = asyncio.Event()

            async def d_after_client_has_p(request: web.Request, body: dict
                                           ) -> web.StreamResponse:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                # nothing from D until the client holds P's token: it did not wait for D
                await asyncio.wait_for(client_has_p.wait(), WAIT_S)
                for e in D_EVENTS[:1] + [D_EVENTS[1][:9], D_EVENTS[1][9:]] + D_EVENTS[2:]:
                    await resp.write(e)  # one event split in two: the usage edit waits
                return resp

            h.prefill[0].on_generate = answering_p
            h.decode[0].on_generate = d_after_client_has_p
            raw = b""
            async with h.client.post(h.url + "/v1/completions", json=completion(
                    stream=True, min_tokens=4, stream_options={"include_usage": True})) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    raw += chunk
                    if raw.startswith(b"data: ") and b"\n\n" in raw:
                        client_has_p.set()
            chunks = sse_texts(raw)
            assert chunks[0]["choices"][0]["text"] == P_TEXT
            assert chunks[0]["choices"][0]["token_ids"] == [P_TOKEN]
            assert chunks[0]["choices"][0]["finish_reason"] is None
            assert [c["choices"][0]["text"] for c in chunks[1:3]] == ["D2", "D3"]
            assert chunks[3]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                          "total_tokens": 8}
            assert raw.endswith(b"data: [DONE]\n\n")
            _, p_body, _ = h.prefill[0].requests[0]
            _, d_body, _ = h.decode[0].requests[0]
            assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1
            assert d_body["max_tokens"] == 15 and d_body["min_tokens"] == 3
            assert d_body["kv_transfer_params"]["first_token_from_prefill"] is True

    run(main())


def test_json_answer_has_prefills_token_in_front() -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            async def d_json(request: web.Request, body: dict) -> web.StreamResponse:
                return web.json_response({
                    "id": "cmpl-x", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": "D2D3", "finish_reason": "length",
                                 "token_ids": [12, 13]}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

            h.prefill[0].on_generate = answering_p
            h.decode[0].on_generate = d_json
            status, out = await h.post("/v1/completions", completion(return_token_ids=True))
            assert status == 200, out
            choice = out["choices"][0]
            assert choice["text"] == P_TEXT + "D2D3" and choice["token_ids"] == [11, 12, 13]
            assert choice["finish_reason"] == "length"
            assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                    "total_tokens": 8}

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_answer_ends_at_prefills_token_and_decode_is_cancelled(stream: bool) -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            async def p_stops(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.wait_for(h.decode[0].received.wait(), WAIT_S)
                return web.json_response(p_answer(finish_reason="stop"))

            async def d_waits(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.sleep(WAIT_S * 3)  # as a real D waiting for its KV
                return web.json_response({})

            h.prefill[0].on_generate = p_stops
            h.decode[0].on_generate = d_waits
            if stream:
                async with h.client.post(h.url + "/v1/completions",
                                         json=completion(stream=True)) as r:
                    raw = await r.read()
                (chunk,) = sse_texts(raw)
                assert chunk["choices"][0]["text"] == P_TEXT
                assert chunk["choices"][0]["finish_reason"] == "stop"
                assert raw.endswith(b"data: [DONE]\n\n")
            else:
                status, out = await h.post("/v1/completions", completion())
                assert status == 200, out
                assert out["choices"][0]["text"] == P_TEXT
                assert out["choices"][0]["finish_reason"] == "stop"
                assert out["kv_transfer_params"] is None
            await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)

    run(main())


def test_decode_failing_after_prefills_token_ends_the_stream_with_an_error() -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            async def d_fails(request: web.Request, body: dict) -> web.StreamResponse:
                await asyncio.wait_for(h.prefill[0].received.wait(), WAIT_S)
                await asyncio.sleep(0.2)  # after P's token went out
                return web.json_response({"error": {"message": "KV never came",
                                                    "code": 500}}, status=500)

            h.prefill[0].on_generate = answering_p
            h.decode[0].on_generate = d_fails
            async with h.client.post(h.url + "/v1/completions",
                                     json=completion(stream=True)) as r:
                raw = await r.read()
            chunks = sse_texts(raw)
            assert chunks[0]["choices"][0]["text"] == P_TEXT
            assert "KV never came" in chunks[1]["error"]["message"]

    run(main())


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": 1}, {"seed": 3}, {"stop": ["\n\n"]}, {"max_tokens": 1},
    {"frequency_penalty": 0.5}, {"response_format": {"type": "json_object"}},
    {"prompt": ["a", "b"]},
])
def test_requests_that_could_tell_take_the_usual_path(extra: dict) -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            status, out = await h.post("/v1/completions", completion(**extra))
            assert status == 200, out
            assert out["choices"][0]["text"] == "decoded by " + h.decode[0].url
            _, d_body, _ = h.decode[0].requests[0]
            assert "first_token_from_prefill" not in d_body["kv_transfer_params"]
            assert d_body.get("max_tokens") == completion(**extra).get("max_tokens")

    run(main())


def test_eligibility() -> None:
    assert ineligible(completion(), chat=False) is None
    assert ineligible(completion(prompt=[1, 2, 3], stop="\n", max_tokens=None), False) is None
    assert "chat" in ineligible({"model": MODEL, "messages": []}, chat=True)
    assert "stop strings" in ineligible(completion(stop="ab"), False)
    assert "seed" in ineligible(completion(seed=1), False)
    assert "max_tokens" in ineligible(completion(max_tokens=1), False)


def test_usage_edit_counts_prefills_token_and_passes_the_rest_through() -> None:
    edit = UsagePlusOne()
    usage = event({"choices": [], "usage": {"completion_tokens": 4, "total_tokens": 9}})
    plain = event({"choices": [{"text": "x"}]})
    out = edit.feed(plain[:5]) + edit.feed(plain[5:] + usage[:12]) + edit.feed(usage[12:])
    out += edit.feed(b"data: [DONE]\n\n") + edit.flush()
    assert out.startswith(plain) and out.endswith(b"data: [DONE]\n\n")
    assert sse_texts(out)[1]["usage"] == {"completion_tokens": 5, "total_tokens": 10}


def test_client_leaving_after_prefills_token_cancels_decode() -> None:
    async def main() -> None:
        async with Harness(first_token_from_prefill=True) as h:
            async def slow_d(request: web.Request, body: dict) -> web.StreamResponse:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await asyncio.sleep(WAIT_S * 3)
                return resp

            h.prefill[0].on_generate = answering_p
            h.decode[0].on_generate = slow_d
            r = await h.client.post(h.url + "/v1/completions", json=completion(stream=True))
            assert P_TEXT.encode() in await r.content.readany()
            r.close()
            await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)

    run(main())
