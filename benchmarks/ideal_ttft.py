"""The ideal TTFT of a P/D configuration at c=1, from its link's rate, for ttft_bench.py.

P/D can hide the KV transfer behind P's prefill, but not beyond it: a transfer that takes
longer than the prefill ends the TTFT. So for a prompt of n tokens:

    ideal(n) = max(single(n), single(n) - prefill(n) + kv_bytes(n) / link_rate)

- ``single(n)``: the single instance's median TTFT at c=1, from the same run;
- ``prefill(n)``: P's prefill time, taken as ``single(n) - overhead``, where ``overhead`` is the
  single instance's median TTFT at a 16-token prompt (``OVERHEAD_PROMPT_LEN``), measured in the
  same run. That is the part of a TTFT that does not grow with the prompt (the request's way
  through the API server and scheduler, one short forward, the first token's way back), which
  a P/D request pays too and which no transfer overlaps. It is measured on every run with
  ``single``, on the same instance as ``single(n)``, without traces; the traces' prefill
  segment (benchmarks/profile_trace.py) exists only for LayerKV configurations run with
  ``--trace``, and is P's prefill with LayerKV's hooks in it, not the single instance's.
- ``kv_bytes(n)``: n x the KV bytes of one token, from the model's config.json (layers x 2 x KV
  heads x head size x bytes per element; MLA: layers x (kv_lora_rank + qk_rope_head_dim) x
  bytes per element), all TP ranks together;
- ``link_rate``: the rate benchmarks/link_probe.py measured for the transport the
  configuration used (``--link-probe``), or for a ``layerkv-tcp-<N>g`` configuration the
  paced rate N / 8 GB/s when it is lower.

So ``ideal(n) = max(single(n), overhead + kv_bytes(n) / link_rate)``; each configuration's
ratio is its own median TTFT at c=1 over ``ideal(n)``.

``single(n) - overhead`` counts as prefill all that grows with the prompt, including the
request's intake (HTTP body, tokenization, input preparation: 35-37 ms at 8K tokens in
traced runs on H200 hosts), which comes before any KV exists and which no transfer can
overlap. So beside ``ideal(n)`` the report gives the same formula with ``prefill(n)`` as the
single instance's engine times it, ``engine_ideal(n)`` (``ENGINE_FORMULA``): the mean of
vLLM's ``vllm:request_prefill_time_seconds`` (first scheduled to first token, in the engine
core) over the point's requests. The engine's prefill is the shorter, so ``engine_ideal(n)``
is the higher of the two bounds, and the closer to what a perfect overlap reaches. With P's
own engine prefill time beside the single instance's, a run also shows whether sending
slowed P's prefill, without a trace.
"""

from __future__ import annotations

from typing import Any

from link_probe import probe_gbps  # benchmarks/link_probe.py, beside this script

OVERHEAD_PROMPT_LEN = 16
FORMULA = ("ideal(n) = max(single(n), single(n) - prefill(n) + kv_bytes(n) / link_rate), "
           "prefill(n) = single(n) - overhead, overhead = single's median TTFT at "
           f"{OVERHEAD_PROMPT_LEN} tokens")
ENGINE_FORMULA = ("engine_ideal(n) = max(single(n), single(n) - engine_prefill(n) + "
                  "kv_bytes(n) / link_rate), engine_prefill(n) = the single instance's mean "
                  "vllm:request_prefill_time_seconds over the point")


def ideal_ttft_ms(single_ttft_ms: float, overhead_ms: float, kv_bytes: float,
                  link_gbps: float) -> float:
    """The formula above; ``link_gbps`` in GB/s (1e9 bytes per second)."""
    return ideal_with_prefill_ms(single_ttft_ms, single_ttft_ms - overhead_ms, kv_bytes,
                                 link_gbps)


def ideal_with_prefill_ms(single_ttft_ms: float, prefill_ms: float, kv_bytes: float,
                          link_gbps: float) -> float:
    """``max(single, single - prefill + kv_bytes / link_rate)`` for a given prefill time."""
    transfer_ms = kv_bytes / (link_gbps * 1e9) * 1e3
    return max(single_ttft_ms, single_ttft_ms - prefill_ms + transfer_ms)


def link_rate(transport: str, ucx_tls: str | None, pacing_gbps: float,
              probe: list[dict[str, Any]]) -> tuple[float | None, str]:
    """(GB/s, what it is) of the link a configuration moved KV on: the probe's rate for its
    transport (NIXL: under its ``UCX_TLS``), capped by its pacing (gigabits per second)."""
    name = transport + (f" UCX_TLS={ucx_tls}" if transport == "nixl" and ucx_tls else "")
    probed = probe_gbps(probe, transport, ucx_tls) if probe else None
    if pacing_gbps > 0:
        paced = pacing_gbps / 8
        if probed is not None and probed < paced:
            return probed, f"{name} paced to {pacing_gbps:g} Gb/s, probed slower"
        return paced, f"{name} paced to {pacing_gbps:g} Gb/s"
    return probed, f"{name}, probed" if probed is not None else f"{name}, not probed"


def config_report(c1: dict[int, float], single: dict[int, float], overhead_ms: float | None,
                  token_bytes: int | None, link_gbps: float | None,
                  single_prefill: dict[int, float] | None = None
                  ) -> dict[int, dict[str, Any]]:
    """Per prompt length: the KV bytes, the ideal TTFT and the configuration's ratio to it.
    ``c1`` and ``single``: median TTFT (ms) by prompt length; ``single_prefill``: the single
    instance's engine prefill time (ms) by prompt length, for ``engine_ideal``. Empty where a
    term is missing."""
    if overhead_ms is None or token_bytes is None or not link_gbps:
        return {}
    rows = {}
    for n, ttft in sorted(c1.items()):
        if n not in single:
            continue
        kv = n * token_bytes
        ideal = ideal_ttft_ms(single[n], overhead_ms, kv, link_gbps)
        rows[n] = {"kv_bytes": kv, "single_ttft_ms": single[n],
                   "transfer_ms": round(kv / (link_gbps * 1e9) * 1e3, 2),
                   "ideal_ttft_ms": round(ideal, 2), "ttft_ms": ttft,
                   "ratio": round(ttft / ideal, 3)}
        if single_prefill and n in single_prefill:
            engine = ideal_with_prefill_ms(single[n], single_prefill[n], kv, link_gbps)
            rows[n].update(single_engine_prefill_ms=single_prefill[n],
                           engine_ideal_ttft_ms=round(engine, 2),
                           engine_ratio=round(ttft / engine, 3))
    return rows
