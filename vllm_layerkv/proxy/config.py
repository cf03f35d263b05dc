"""The proxy's settings (``vllm-layerkv proxy`` options, or ``build_app``'s keywords), apart from
its backends' URLs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProxyConfig:
    startup_timeout: float = 600.0
    """How long start-up waits for every backend's ``/health`` (``--timeout``)."""
    connect_timeout: float = 10.0
    """Connecting to a backend; reads have no timeout (generations can be long)."""
    api_key: str | None = None
    """The backends' API key, for the proxy's own requests (discovery, health); clients'
    ``Authorization`` headers are passed through instead."""
    trace_path: str = ""
    """Per-request timestamps by transfer_id (``--trace``); off when empty."""
    first_token_from_prefill: bool = False
    """Answer eligible requests with P's token first; D continues from it (first_token.py)."""
    routing: str = "least-loaded"
    """How each request picks its P and its D (routing.ROUTING_POLICIES)."""
