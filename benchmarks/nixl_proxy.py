"""Sequential pull proxy for vLLM's NixlConnector, the baseline LayerKV is compared with.

NixlConnector (pull mode) needs P's response before D can start: P returns its block ids in
``kv_transfer_params``, the proxy forwards them to D, D reads the KV. This is what vLLM's own
``toy_proxy_server.py`` does, with the same request fields. Completions only (what
``vllm bench serve`` uses).

Usage: python benchmarks/nixl_proxy.py --prefill URL --decode URL --port N
"""

from __future__ import annotations

import argparse
import itertools
import uuid

import aiohttp
from aiohttp import web


def make_app(prefill: list[str], decode: list[str]) -> web.Application:
    p_cycle, d_cycle = itertools.cycle(prefill), itertools.cycle(decode)
    app = web.Application()

    async def startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=30),
            connector=aiohttp.TCPConnector(limit=0))

    async def cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            p_body.pop(key, None)
        async with session.post(next(p_cycle) + "/v1/completions", json=p_body,
                                headers=headers) as p_resp:
            p_json = await p_resp.json()
            if p_resp.status != 200:
                return web.json_response(p_json, status=p_resp.status)
        d_body = dict(body, kv_transfer_params=p_json.get("kv_transfer_params"))
        async with session.post(next(d_cycle) + "/v1/completions", json=d_body,
                                headers=headers) as d_resp:
            if not body.get("stream"):
                return web.json_response(await d_resp.json(), status=d_resp.status)
            out = web.StreamResponse(status=d_resp.status,
                                     headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in d_resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def models(request: web.Request) -> web.Response:
        async with request.app["session"].get(decode[0] + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instance URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    ap.add_argument("--port", type=int, required=True, help="port the proxy listens on")
    args = ap.parse_args()
    web.run_app(make_app([u.rstrip("/") for u in args.prefill],
                         [u.rstrip("/") for u in args.decode]),
                host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
