"""The request bodies: the client's, checked (400 with what to change), and the two the proxy
derives from it, P's (prefill, one token, keep the KV for D) and D's (the client's request,
plus where its KV comes from).

The client's body must be UTF-8 JSON nested at most ``--max-json-depth`` levels. A body nested
deeper than the interpreter's recursion limit stops the parser (RecursionError, caught); one
within it is measured after parsing, without recursion.

``kv_transfer_params`` are the proxy's alone: whatever a client puts there (a transfer_id of
its choosing, ``layerkv_discover``, another request's endpoint) is removed on every path, also
from ``vllm_xargs``, which vLLM merges into the same request parameters."""

from __future__ import annotations

import json
from typing import Any

from vllm_layerkv.common.log import init_logger
from vllm_layerkv.proxy.errors import BadRequest
from vllm_layerkv.proxy.first_token import FLAG as FIRST_TOKEN_FLAG
from vllm_layerkv.proxy.first_token import decode_limits

logger = init_logger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

TRANSFER_PARAMS = "kv_transfer_params"
EXTRA_ARGS = "vllm_xargs"
"""vLLM copies these into the request's extra arguments, where it also reads
``kv_transfer_params`` from."""

DEFAULT_MAX_JSON_DEPTH = 128


def parse_request_body(raw: bytes, chat: bool, max_depth: int = DEFAULT_MAX_JSON_DEPTH
                       ) -> dict[str, Any]:
    """Decode and minimally validate a completion/chat body; BadRequest says what to change."""
    endpoint = CHAT_PATH if chat else COMPLETIONS_PATH
    example = ('{"model": "...", "messages": [{"role": "user", "content": "Hi"}]}' if chat
               else '{"model": "...", "prompt": "Hello"}')
    if not raw.strip():
        raise BadRequest(f"request body is empty; POST a JSON object to {endpoint}, e.g. {example}")
    too_deep = BadRequest(f"request body nests JSON more than {max_depth} levels deep (the "
                          f"proxy's --max-json-depth)")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8 ({e.reason} at byte {e.start}); POST a "
                         f"UTF-8 JSON object to {endpoint}") from None
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON ({e}); POST a JSON object to "
                         f"{endpoint}, e.g. {example}") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth and nests_deeper(body, max_depth):
        raise too_deep
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got a JSON {type(body).__name__}; "
                         f"e.g. {example}")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("missing 'model': set it to the model name the backends serve "
                         "(GET /v1/models lists it)")
    if chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("missing 'messages': chat requests need a non-empty list of "
                             "messages, e.g. [{\"role\": \"user\", \"content\": \"Hi\"}] "
                             "(use /v1/completions for a plain 'prompt')")
    elif body.get("prompt") is None:
        raise BadRequest("missing 'prompt': completion requests need a 'prompt' (a string, a "
                         "list of strings or of token ids); use /v1/chat/completions for "
                         "'messages'")
    return body


def nests_deeper(value: Any, max_depth: int) -> bool:
    """Whether a parsed JSON value has arrays or objects nested more than ``max_depth`` deep
    (the outermost counts 1). Iterative: depth costs no Python recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def strip_transfer_params(body: dict[str, Any]) -> bool:
    """Remove the client's ``kv_transfer_params`` (top level and in ``vllm_xargs``); True if
    there were any."""
    found = TRANSFER_PARAMS in body  # even null: a body sent on unchanged must not carry it
    body.pop(TRANSFER_PARAMS, None)
    extra = body.get(EXTRA_ARGS)
    if isinstance(extra, dict) and TRANSFER_PARAMS in extra:
        body[EXTRA_ARGS] = {k: v for k, v in extra.items() if k != TRANSFER_PARAMS}
        found = True
    return found


def needs_prompt_logprobs(body: dict[str, Any], chat: bool) -> bool:
    """True if the response must contain logprobs of the prompt, which only P computes."""
    if body.get("prompt_logprobs") is not None:
        return True
    return (not chat) and bool(body.get("echo")) and body.get("logprobs") is not None


def prefill_body(body: dict[str, Any], transfer_id: str, chat: bool,
                 first_token: bool = False) -> dict[str, Any]:
    """The body sent to P: prefill the prompt, generate one token, keep the KV for D.
    ``first_token``: that token is the client's (first_token.py), so P samples it exactly as
    the client asked, min_tokens included."""
    p = dict(body)
    p["max_tokens"] = 1
    if chat and "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    # stream_options is rejected without stream=true; min_tokens > max_tokens is rejected;
    # best_of >= n sampling is D's business (P makes exactly one sequence).
    for key in ("stream_options", "min_tokens", "best_of"):
        p.pop(key, None)
    if first_token and isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        p["min_tokens"] = 1  # no EOS as the first token, as on a single instance
    p["n"] = 1
    p["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return p


def decode_body(body: dict[str, Any], transfer_id: str, host: str, port: int,
                first_token: bool = False) -> dict[str, Any]:
    """The body sent to D: the client's request, plus where its KV comes from.
    ``first_token``: D continues from P's token, so it makes one token fewer."""
    d = dict(body)
    d["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id,
                               "remote_host": host, "remote_port": port}
    if first_token:
        d.update(decode_limits(body))
        d["kv_transfer_params"][FIRST_TOKEN_FLAG] = True
    return d
