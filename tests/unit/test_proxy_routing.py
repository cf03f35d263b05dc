"""How the proxy picks P and D (routing.Router): least-loaded by default, round-robin on
request; and that every request's hold on an instance ends when that instance is done with it,
however the request ends."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from test_proxy import ADMIN, WAIT_S, Harness, completion, free_port, one_token_then_stall, run

from vllm_layerkv.proxy import ROUTING_POLICIES, Backend, Router
from vllm_layerkv.proxy import backends as backends_module


def backends(n: int) -> list[Backend]:
    return [Backend(url=f"http://127.0.0.1:{8100 + i}", role="prefill") for i in range(n)]


def urls(picked: list[Backend]) -> list[int]:
    return [int(b.url.rsplit(":", 1)[1]) - 8100 for b in picked]


def test_least_loaded_takes_the_fewest_in_flight_and_breaks_ties_in_turn() -> None:
    router = Router(backends(3))
    # idle: in turn, like round-robin (each lease released at once)
    picked = []
    for _ in range(4):
        lease = router.pick()
        picked.append(lease.backend)
        lease.release()
    assert urls(picked) == [0, 1, 2, 0]
    # backend 1 is busy with two requests, backend 2 with one: new requests go to 0, then to 2
    held = [router.pick() for _ in range(3)]  # 1, 2, 0
    held.append(router.pick())  # all at 1: the turn goes on, to 1
    assert urls([lease.backend for lease in held]) == [1, 2, 0, 1]
    held[2].release()  # 0 is free again
    assert urls([router.pick().backend]) == [0]
    assert [b.in_flight for b in router.items] == [1, 2, 1]


def test_round_robin_ignores_the_load() -> None:
    router = Router(backends(2), "round-robin")
    held = [router.pick() for _ in range(3)]  # nothing released
    assert urls([lease.backend for lease in held]) == [0, 1, 0]
    assert [b.in_flight for b in router.items] == [2, 1]


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_an_unreachable_backend_is_passed_over_unless_all_are(policy: str) -> None:
    router = Router(backends(3), policy)

    def picks(n: int) -> list[int]:
        picked = []
        for _ in range(n):
            lease = router.pick()
            picked.append(lease.backend)
            lease.release()
        return urls(picked)

    router.items[0].mark_unreachable("test")
    assert picks(4) == [1, 2, 1, 2]
    for b in router.items:
        b.mark_unreachable("test")
    assert sorted(picks(3)) == [0, 1, 2]
    router.items[0].mark_reachable()
    assert router.items[0].unreachable_until == 0.0


def test_a_lease_releases_once() -> None:
    router = Router(backends(1))
    lease = router.pick()
    lease.release()
    lease.release()
    assert router.items[0].in_flight == 0


@pytest.mark.parametrize("items,policy,needle", [
    ([], "least-loaded", "at least one backend"),
    (backends(1), "random", "least-loaded, round-robin, got 'random'"),
])
def test_bad_router_input_says_what_works(items, policy, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        Router(items, policy)
    assert ROUTING_POLICIES == ("least-loaded", "round-robin")


async def wait_in_flight(router: Router, want: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S
    while [b.in_flight for b in router.items] != want:
        assert time.monotonic() < deadline, [b.in_flight for b in router.items]
        await asyncio.sleep(0.005)


def holding(gate: asyncio.Event) -> object:
    async def handler(request: web.Request, body: dict) -> web.StreamResponse:
        await gate.wait()
        return web.json_response({"id": "cmpl", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "held"}]})
    return handler


@pytest.mark.parametrize("routing,second_and_third", [
    ("least-loaded", [1, 1]),  # P0 is busy: both go to P1
    ("round-robin", [1, 0]),  # in turn, P0 gets one although it is busy
])
def test_a_busy_prefill_instance_gets_new_requests_only_in_turn_under_round_robin(
        routing: str, second_and_third: list[int]) -> None:
    async def main() -> None:
        async with Harness(2, 1, routing=routing) as h:
            await h.proxy.wait_ready()
            gate = asyncio.Event()
            h.prefill[0].on_generate = holding(gate)  # a long prompt on P0
            # D answers at once; the first request's P part goes on in the background
            status, out = await h.post("/v1/completions", completion())
            assert status == 200, out
            for _ in second_and_third:
                await wait_in_flight(h.proxy.prefill, [1, 0])  # P1's previous one is done
                status, out = await h.post("/v1/completions", completion())
                assert status == 200, out
            p_seq = [i for role, i, _ in h.cluster.log if role == "prefill"]
            assert p_seq == [0, *second_and_third]
            gate.set()
            await wait_in_flight(h.proxy.prefill, [0, 0])
            await wait_in_flight(h.proxy.decode, [0])

    run(main())


def test_a_decode_instance_streaming_a_long_answer_is_passed_over() -> None:
    async def main() -> None:
        async with Harness(1, 2) as h:
            await h.proxy.wait_ready()
            gate = asyncio.Event()

            async def long_stream(request: web.Request, body: dict) -> web.StreamResponse:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"tok": 0}\n\n')
                await gate.wait()
                await resp.write(b"data: [DONE]\n\n")
                return resp

            h.decode[0].on_generate = long_stream
            r = await h.client.post(h.url + "/v1/completions", json=completion(stream=True))
            assert r.status == 200 and (await r.content.readany()).startswith(b"data: ")
            for _ in range(2):
                status, out = await h.post("/v1/completions", completion())
                assert status == 200 and out["choices"][0]["text"] == "decoded by " + \
                    h.decode[1].url, out
                await wait_in_flight(h.proxy.decode, [1, 0])
            async with h.client.get(h.url + "/health", headers=ADMIN) as health:
                report = await health.json()
            assert report["decode"][h.decode[0].url]["in_flight"] == 1
            assert report["decode"][h.decode[1].url]["in_flight"] == 0
            gate.set()
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
            r.close()
            await wait_in_flight(h.proxy.decode, [0, 0])
            await wait_in_flight(h.proxy.prefill, [0])

    run(main())


def test_holds_end_when_the_client_goes_away_and_when_a_backend_fails() -> None:
    async def main() -> None:
        async with Harness(1, 1) as h:
            await h.proxy.wait_ready()
            gate = asyncio.Event()
            h.prefill[0].on_generate = holding(gate)  # never answers before the client leaves

            h.decode[0].on_generate = one_token_then_stall
            r = await h.client.post(h.url + "/v1/completions", json=completion(stream=True))
            assert r.status == 200
            await asyncio.wait_for(h.prefill[0].received.wait(), WAIT_S)
            await wait_in_flight(h.proxy.prefill, [1])
            r.close()
            await asyncio.wait_for(h.decode[0].cancelled.wait(), WAIT_S)
            await wait_in_flight(h.proxy.prefill, [0])
            await wait_in_flight(h.proxy.decode, [0])

            async def failing_d(request: web.Request, body: dict) -> web.StreamResponse:
                return web.json_response({"error": {"message": "no"}}, status=500)

            h.decode[0].on_generate = failing_d
            status, _ = await h.post("/v1/completions", completion())
            assert status == 500
            await wait_in_flight(h.proxy.prefill, [0])
            await wait_in_flight(h.proxy.decode, [0])

    run(main())


def test_hold_ends_when_the_prefill_endpoint_is_unknown() -> None:
    """Discovery failed: the request is answered before P is asked."""
    async def main() -> None:
        async with Harness(1, 1, kv_endpoints=[None]) as h:
            await h.proxy.wait_ready()
            status, out = await h.post("/v1/completions", completion())
            assert status == 502, out
            assert h.prefill[0].requests == [] and h.decode[0].requests == []
            assert [b.in_flight for b in h.proxy.prefill.items] == [0]
            assert [b.in_flight for b in h.proxy.decode.items] == [0]

    run(main())


def test_requests_route_around_an_unreachable_decode_instance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One request finds D0 down (502, naming it); the next ones go to D1 until the back-off
    ends, and then D0 is tried again."""
    monkeypatch.setattr(backends_module, "UNREACHABLE_BACKOFF_S", 0.5)
    dead = f"http://127.0.0.1:{free_port()}"

    async def main() -> None:
        async with Harness(1, 1, dead_decode_urls=[dead], startup_timeout=0.2) as h:
            await h.proxy.wait_ready()
            status, out = await h.post("/v1/completions", completion())
            assert status == 502 and "decode instance 0" in out["error"]["message"], out
            assert dead not in out["error"]["message"]  # the URL goes to the proxy's log
            for _ in range(3):
                status, out = await h.post("/v1/completions", completion())
                assert status == 200, out
            await asyncio.sleep(0.6)
            status, out = await h.post("/v1/completions", completion())
            assert status == 502, out  # tried again after the back-off
            assert [b.in_flight for b in h.proxy.decode.items] == [0, 0]
            assert len(h.decode[0].requests) == 3

    run(main())


def test_health_polling_marks_an_unreachable_instance_before_any_request_fails() -> None:
    async def main() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with Harness(1, 1, dead_decode_urls=[dead], startup_timeout=0.2) as h:
            await h.proxy.wait_ready()
            async with h.client.get(h.url + "/health") as r:
                assert r.status == 503
            for _ in range(2):
                status, out = await h.post("/v1/completions", completion())
                assert status == 200, out

    run(main())


def test_model_listings_hold_nothing() -> None:
    async def main() -> None:
        async with Harness(1, 2) as h:
            for _ in range(3):
                async with h.client.get(h.url + "/v1/models") as r:
                    assert r.status == 200
            assert [h.decode[i].models_gets for i in range(2)] == [2, 1]
            assert [b.in_flight for b in h.proxy.decode.items] == [0, 0]

    run(main())
