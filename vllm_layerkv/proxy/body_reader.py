"""The client's request body, read within the proxy's limits: at most ``--max-body-bytes``
(413 otherwise, refused from ``Content-Length`` before anything is read when the client
declares it), and all of it within ``--body-timeout`` (408 otherwise), so that a client that
sends its body slowly, or not at all, cannot hold a request open. A refused body's connection
is closed after the answer, rather than kept for another request (server.LINGERING_S)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from vllm_layerkv.proxy.errors import Refused


def too_large(max_bytes: int) -> Refused:
    return Refused(f"request body exceeds the proxy's limit of {max_bytes} bytes "
                   f"(--max-body-bytes)", status=413, close=True)


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, or Refused (413, 408)."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise too_large(max_bytes)
    try:
        return await asyncio.wait_for(_read_up_to(request, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise Refused(f"request body not received within {timeout:g} s (the proxy's "
                      f"--body-timeout)", status=408, close=True) from None


async def _read_up_to(request: web.Request, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in request.content.iter_any():
        if len(body) + len(chunk) > max_bytes:
            raise too_large(max_bytes)
        body += chunk
    return bytes(body)
