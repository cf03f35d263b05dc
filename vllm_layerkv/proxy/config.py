"""The proxy's settings (``vllm-layerkv proxy`` options, or ``build_app``'s keywords), apart from
its backends' URLs, checked on construction (a ValueError names the option to change)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_layerkv.proxy.bodies import DEFAULT_MAX_JSON_DEPTH

MAX_JSON_DEPTH_CEILING = 500
"""Bodies are parsed and encoded again by Python's json, whose recursion stops near 1000
levels: the depth limit stays well below."""


@dataclass(frozen=True)
class ProxyConfig:
    startup_timeout: float = 600.0
    """How long start-up waits for every backend's ``/health`` (``--timeout``)."""
    connect_timeout: float = 10.0
    """Connecting to a backend; reads have no timeout (generations can be long)."""
    backend_api_key: str | None = None
    """The backends' API key (``VLLM_API_KEY``), sent only on the proxy's own requests
    (discovery, health checks); a client's request carries the client's own
    ``Authorization`` header, or none."""
    api_keys: tuple[str, ...] = ()
    """Keys clients must present as ``Authorization: Bearer <key>`` (``--api-key``); none: the
    proxy does not check clients."""
    admin_key: str | None = None
    """The key that unlocks the detailed ``/health`` (``--admin-key``)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (``--max-body-bytes``); larger ones get a 413."""
    max_concurrent_requests: int = 1024
    """Requests served at once (``--max-concurrent-requests``); more get a 503."""
    header_timeout: float = 10.0
    """Seconds from a new connection to its complete first request head (``--header-timeout``)."""
    body_timeout: float = 60.0
    """Seconds from a request's head to the end of its body (``--body-timeout``); 408 after."""
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    """Deepest nesting of arrays and objects in a request body (``--max-json-depth``)."""
    trace_path: str = ""
    """Per-request timestamps by transfer_id (``--trace``); off when empty."""
    first_token_from_prefill: bool = False
    """Answer eligible requests with P's token first; D continues from it (first_token.py)."""
    routing: str = "least-loaded"
    """How each request picks its P and its D (routing.ROUTING_POLICIES)."""

    def __post_init__(self) -> None:
        for option, value in (("--max-body-bytes", self.max_body_bytes),
                              ("--max-concurrent-requests", self.max_concurrent_requests)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{option} must be a positive integer, got {value!r}")
        for option, seconds in (("--header-timeout", self.header_timeout),
                                ("--body-timeout", self.body_timeout),
                                ("--timeout", self.startup_timeout),
                                ("the connect timeout", self.connect_timeout)):
            if not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ValueError(f"{option} must be a positive number of seconds, got "
                                 f"{seconds!r}")
        if type(self.max_json_depth) is not int \
                or not 1 <= self.max_json_depth <= MAX_JSON_DEPTH_CEILING:
            raise ValueError(f"--max-json-depth must be an integer from 1 to "
                             f"{MAX_JSON_DEPTH_CEILING}, got {self.max_json_depth!r}")
        if any(not k for k in self.api_keys) or self.admin_key == "":
            raise ValueError("--api-key and --admin-key must not be empty strings")
