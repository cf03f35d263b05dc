"""What the proxy answers when something goes wrong: OpenAI-style error bodies (and their SSE
form for a stream already under way), a request the proxy refuses (``Refused``: 400, 401, 408,
413, 503), an unreachable or misconfigured backend (502), and a backend's complete reply, kept
to be passed on.

A 502 says which role failed (prefill or decode, and the instance's number in its list), never
the instance's URL: the URL and the underlying error go to the proxy's log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.backends import Backend

logger = init_logger(__name__)


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as bodies go upstream and error events go to the client."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def error_json(status: int, message: str, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": status}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_json(status, message, type_), status=status, headers=headers)


class Refused(Exception):
    """A request the proxy answers itself, without asking a backend: ``str()`` is the message,
    which says what to change. ``close``: the connection is closed after the answer, as its
    request body was not read to the end (server.LINGERING_S)."""

    status = 400
    type_ = "invalid_request_error"

    def __init__(self, message: str, *, status: int | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        if type_ is not None:
            self.type_ = type_
        self.headers = headers
        self.close = close

    def response(self) -> web.Response:
        response = error_response(self.status, str(self), self.type_, self.headers)
        if self.close:
            response.force_close()
        return response


class BadRequest(Refused):
    """The client's request is malformed (HTTP 400)."""


class UpstreamError(Exception):
    """A backend could not be reached, broke off its answer, or is misconfigured: what the
    client gets (502). ``str()`` is the client's message: the role and number of the instance
    (``Backend.name``) and what went wrong, without its URL. ``detail`` (with the URL and the
    underlying error) is logged when the client is answered (``report``)."""

    def __init__(self, backend: Backend | None, message: str, detail: str = "",
                 status: int = 502) -> None:
        super().__init__(message)
        self.backend = backend
        self.detail = detail or message
        self.status = status

    def report(self) -> str:
        """Log the detail; the client's message."""
        logger.warning("answering HTTP %d: %s", self.status, self.detail)
        return str(self)

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(self.status, self.report(), "bad_gateway", headers)


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
