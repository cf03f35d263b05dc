"""``--first-token-from-prefill``: the client gets P's token as its first token, and D continues
from it (its connector appends P's token to D's prompt; docs/architecture.md). TTFT then no
longer includes D's own first step.

This module holds what the mode changes in the bodies and answers:

* ``ineligible``: which requests it applies to. D's frontend never sees P's token, so only
  requests whose answer cannot depend on that are eligible: plain completions, n = 1, no
  logprobs, echo, seed, penalties on output tokens, structured output or multi-character stop
  strings. Everything else takes the usual path.
* ``PrefillToken``: P's token, read from P's JSON answer.
* The client's answer: P's token as an SSE chunk ahead of D's stream (``first_chunk``) or in
  front of D's JSON (``merge_reply``), and D's usage counting it (``UsagePlusOne``).

D is asked for one token fewer (``max_tokens``, ``min_tokens``); a request without
``max_tokens`` needs no change, since D's default limit already counts the appended token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_layerkv.proxy.errors import encode_json

FLAG = "first_token_from_prefill"
"""The decode request's kv_transfer_params key (request_params.DecodeParams)."""

_STRUCTURED_KEYS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "bad_words", "prompt_embeds", "suffix")


def ineligible(body: dict[str, Any], chat: bool) -> str | None:
    """Why a request cannot take P's first token (None: it can)."""
    if chat:
        return "chat completion (D's chat parsers would not see P's token)"
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt))
    if not single:
        return "not a single prompt"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "more than one sequence"
    if body.get("logprobs") is not None or body.get("echo"):
        return "logprobs or echo"
    if body.get("seed") is not None:
        return "seeded sampling (D's generator would restart at P's token)"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "penalties on output tokens (D does not count P's token as output)"
    for key in _STRUCTURED_KEYS:
        if body.get(key) is not None:
            return f"{key} (D's state would not include P's token)"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 2):
        return "max_tokens below 2 (P's token is the whole answer)"
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or any(not isinstance(s, str) or len(s) > 1 for s in stops):
        return "stop strings longer than one character (one could span P's and D's tokens)"
    return None


def decode_limits(body: dict[str, Any]) -> dict[str, Any]:
    """D's max_tokens / min_tokens: one fewer, P's token counting as the first."""
    out: dict[str, Any] = {}
    if isinstance(body.get("max_tokens"), int):
        out["max_tokens"] = body["max_tokens"] - 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        out["min_tokens"] = body["min_tokens"] - 1
    return out


@dataclass
class PrefillToken:
    """P's JSON answer (one token), as the client's first token."""

    reply: dict[str, Any]

    @classmethod
    def parse(cls, body: bytes) -> PrefillToken:
        reply = json.loads(body)
        choice = reply["choices"][0]
        if not isinstance(choice.get("text"), str):
            raise ValueError("prefill answer has no choices[0].text")
        return cls(reply)

    @property
    def choice(self) -> dict[str, Any]:
        return self.reply["choices"][0]

    @property
    def ends_answer(self) -> bool:
        """P stopped at its token (EOS, a stop token or string): D has nothing to add."""
        return self.choice.get("finish_reason") not in (None, "length")

    def as_answer(self) -> bytes:
        """P's answer alone, for a request that ended at P's token."""
        return encode_json({**self.reply, "kv_transfer_params": None})

    def first_chunk(self, final: bool) -> bytes:
        """P's token as the stream's first SSE event (``final``: it ends the answer)."""
        choice = {"index": 0, "text": self.choice["text"], "logprobs": None,
                  "finish_reason": self.choice.get("finish_reason") if final else None,
                  "stop_reason": self.choice.get("stop_reason") if final else None}
        if "token_ids" in self.choice:
            choice["token_ids"] = self.choice["token_ids"]
        chunk = {"id": self.reply.get("id"), "object": "text_completion",
                 "created": self.reply.get("created"), "model": self.reply.get("model"),
                 "choices": [choice]}
        return b"data: " + encode_json(chunk) + b"\n\n"

    def final_events(self, include_usage: bool) -> bytes:
        """After ``first_chunk(final=True)``: the usage event if asked for, and [DONE]."""
        usage = b""
        if include_usage:
            chunk = {"id": self.reply.get("id"), "object": "text_completion",
                     "created": self.reply.get("created"), "model": self.reply.get("model"),
                     "choices": [], "usage": self.reply.get("usage")}
            usage = b"data: " + encode_json(chunk) + b"\n\n"
        return usage + b"data: [DONE]\n\n"

    def merge_reply(self, decode_body: bytes) -> bytes:
        """D's JSON answer with P's token in front: text, token ids, usage."""
        reply = json.loads(decode_body)
        choice = reply["choices"][0]
        choice["text"] = self.choice["text"] + choice.get("text", "")
        if isinstance(choice.get("token_ids"), list) and "token_ids" in self.choice:
            choice["token_ids"] = list(self.choice["token_ids"]) + choice["token_ids"]
        _count_token(reply.get("usage"))
        return encode_json(reply)


def _count_token(usage: Any) -> None:
    if isinstance(usage, dict):
        for key in ("completion_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                usage[key] += 1


class UsagePlusOne:
    """Rewrites D's SSE stream so that every usage it reports counts P's token. Events pass
    through byte for byte unless they carry usage; a partial event waits for its end."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        end = self._buf.rfind(b"\n\n")
        if end < 0:
            return b""
        done, self._buf = self._buf[:end + 2], self._buf[end + 2:]
        if b'"usage"' not in done:
            return done
        return b"".join(_edit_event(e) for e in done.split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


def _edit_event(event: bytes) -> bytes:
    if event.startswith(b"data: {") and b'"usage"' in event:
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            _count_token(chunk["usage"])
            return b"data: " + encode_json(chunk) + b"\n\n"
    return event + b"\n\n"
