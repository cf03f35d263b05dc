"""What the proxy answers when something goes wrong: OpenAI-style error bodies (and their SSE
form for a stream already under way), the client's bad request (400), an unreachable or
misconfigured backend (502), and a backend's complete reply, kept to be passed on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_layerkv.proxy.backends import Backend


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as bodies go upstream and error events go to the client."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def error_json(status: int, message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": status}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_json(status, message, type_), status=status, headers=headers)


class BadRequest(Exception):
    """The client's request is malformed (HTTP 400)."""

    def response(self) -> web.Response:
        return error_response(400, str(self))


class UpstreamError(Exception):
    """A backend could not be reached, or is misconfigured: what the client gets (502)."""

    def __init__(self, backend: Backend | None, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.backend = backend
        self.status = status

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(self.status, str(self), "bad_gateway", headers)


@dataclass
class UpstreamReply:
    """A fully read upstream response."""

    backend: Backend
    status: int
    body: bytes
    content_type: str

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=self.status, body=self.body, headers={
            "Content-Type": self.content_type or "application/json", **(headers or {})})

    def error_message(self) -> tuple[str, str]:
        """(message, type) from a backend error body (OpenAI or vLLM style), for SSE events."""
        text = self.body.decode("utf-8", "replace")
        try:
            js = json.loads(text)
        except ValueError:
            return text[:2000] or f"HTTP {self.status}", "upstream_error"
        err = js.get("error", js) if isinstance(js, dict) else js
        if isinstance(err, dict):
            return str(err.get("message", text))[:2000], str(err.get("type", "upstream_error"))
        return text[:2000], "upstream_error"


def sse_error(status: int, message: str, type_: str) -> bytes:
    # Same shape vLLM itself emits when a stream fails part-way, followed by [DONE].
    return b"data: " + encode_json(error_json(status, message, type_)) + b"\n\ndata: [DONE]\n\n"
