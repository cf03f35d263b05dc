"""``vllm-layerkv`` command line: argparse and dispatch only; the work lives in the modules.

    vllm-layerkv proxy --prefill URL [URL ...] --decode URL [URL ...] --port N
                       [--host 127.0.0.1] [--timeout S] [--routing POLICY] [--log-level LEVEL]
                       [--event-loop auto|uvloop|asyncio]
                       [--api-key KEY [KEY ...]] [--admin-key KEY] [limits: docs/proxy.md]

To add a subcommand: write ``_add_<name>(subparsers, common)`` that registers its arguments and
sets ``func``, and call it from ``build_parser``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Sequence


def _backend_url(role: str) -> Callable[[str], str]:
    """argparse ``type=`` that validates a backend URL (the error names what to change)."""

    def check(text: str) -> str:
        from vllm_layerkv.proxy import parse_backend_url

        try:
            parse_backend_url(text, role)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1-65535, got {text!r}")
    return int(text)


def _run_proxy(args: argparse.Namespace) -> int:
    from vllm_layerkv.proxy import run_proxy

    run_proxy(args)
    return 0


def _add_proxy(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from vllm_layerkv.proxy.routing import ROUTING_POLICIES

    p = sub.add_parser(
        "proxy", parents=[common], help="OpenAI-compatible prefill/decode proxy",
        description="Route OpenAI completion/chat requests to a prefill and a decode vLLM "
                    "instance at the same time (by default the instance of each list with the "
                    "fewest requests in flight); see docs/proxy.md.")
    p.add_argument("--prefill", nargs="+", required=True, type=_backend_url("prefill"),
                   metavar="URL", help="prefill instances, e.g. http://127.0.0.1:8100; append "
                   "#kv=HOST:PORT to give the LayerKV endpoint instead of discovering it")
    p.add_argument("--decode", nargs="+", required=True, type=_backend_url("decode"),
                   metavar="URL", help="decode instances, e.g. http://127.0.0.1:8200")
    p.add_argument("--port", type=_port, required=True, help="port the proxy listens on")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait at start-up for backends to become healthy "
                        "(default 600)")
    p.add_argument("--trace", default="", metavar="PATH",
                   help="append per-request timestamps (JSON lines, by transfer_id) to "
                        "PATH.proxy.0, for benchmarks/profile_trace.py (default: off)")
    p.add_argument("--first-token-from-prefill", action="store_true",
                   help="answer eligible completions with the token P samples, D continuing "
                        "from it: TTFT without D's first step (see docs/proxy.md for which "
                        "requests, and what D needs)")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="least-loaded",
                   help="how each request picks its prefill and its decode instance: "
                        "least-loaded (the fewest requests in flight, ties in turn; default) or "
                        "round-robin")
    from vllm_layerkv.proxy.event_loop import EVENT_LOOPS

    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the proxy's event loop: uvloop, asyncio's own, or auto (default): "
                        "uvloop where it is installed, as vLLM's API server does")
    from vllm_layerkv.proxy.config import ProxyConfig

    limits = ProxyConfig()
    p.add_argument("--api-key", nargs="+", metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' (one of these keys) on "
                        "every route but /health; default: $LAYERKV_PROXY_API_KEY, else no check")
    p.add_argument("--admin-key", metavar="KEY",
                   help="key that unlocks the detailed /health (backend URLs, LayerKV "
                        "endpoints, errors); default: $LAYERKV_PROXY_ADMIN_KEY, else none")
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes, metavar="N",
                   help=f"largest request body accepted, else 413 (default "
                        f"{limits.max_body_bytes})")
    p.add_argument("--max-concurrent-requests", type=int,
                   default=limits.max_concurrent_requests, metavar="N",
                   help=f"requests served at once, else 503 with Retry-After (default "
                        f"{limits.max_concurrent_requests})")
    p.add_argument("--header-timeout", type=float, default=limits.header_timeout, metavar="S",
                   help=f"seconds a new connection has to send its first request head, else "
                        f"it is closed (default {limits.header_timeout:g})")
    p.add_argument("--body-timeout", type=float, default=limits.body_timeout, metavar="S",
                   help=f"seconds a request has to send its whole body, else 408 (default "
                        f"{limits.body_timeout:g})")
    p.add_argument("--max-json-depth", type=int, default=limits.max_json_depth, metavar="N",
                   help=f"deepest nesting of arrays and objects in a request body, else 400 "
                        f"(default {limits.max_json_depth})")
    p.set_defaults(func=_run_proxy)


def build_parser() -> argparse.ArgumentParser:
    # Options every subcommand takes (given after the subcommand's name).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="logging level (debug: one line per proxied request)")
    parser = argparse.ArgumentParser(prog="vllm-layerkv",
                                     description="LayerKV tools for vLLM P/D disaggregation")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_proxy(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
