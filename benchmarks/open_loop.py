"""Open-loop load points for ttft_bench.py: request rates, and what one rate's run measured.

A rate point sends a fixed number of requests with Poisson arrivals at a set rate
(``vllm bench serve --request-rate R``, burstiness 1, no concurrency cap), so requests keep
arriving whether or not the server keeps up: unlike a closed loop (``--max-concurrency``), a
slow server meets a growing queue instead of a slower client. Rates are absolute (``2.5``,
requests per second) or fractions of P's prefill capacity (``0.7x``): ttft_bench.py measures
that capacity on the single instance as the completion rate of a burst of prompts of the
point's input length with one output token each, all sent at once (the single instance runs
on one GPU with P's flags, so it prefills as P does).

Every figure here comes from ``vllm bench serve --save-result --save-detailed``'s per-request
lists (``ttfts``, ``latencies``, ``output_lens``, ``errors``, ``start_times``), not from its
means: percentiles of TTFT and TPOT, the offered and achieved rates, and the goodput, the
requests per second that met both objectives (TTFT <= ``slo_ttft_ms`` and TPOT <=
``slo_tpot_ms``; a request with one output token has no TPOT and is judged by its TTFT).
A request's TPOT is vLLM's: (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rate:
    """One ``--rates`` entry: requests per second, or a fraction of P's capacity."""

    value: float
    of_capacity: bool = False

    @property
    def label(self) -> str:
        return f"{self.value:g}x" if self.of_capacity else f"{self.value:g}rps"

    def per_second(self, capacity_rps: float | None) -> float:
        if not self.of_capacity:
            return self.value
        if not capacity_rps:
            raise ValueError(f"rate {self.label} is a fraction of P's prefill capacity, which "
                             f"is not known: run 'single' first or give --capacity")
        return self.value * capacity_rps


def parse_rates(text: str) -> list[Rate]:
    """``--rates`` values: ``0.5x,0.7x`` (fractions of the capacity) or ``2.5`` (requests per
    second), comma-separated or as separate words."""
    rates = []
    for word in (w.strip() for w in text.split(",")):
        of_capacity = word.endswith("x")
        number = word[:-1] if of_capacity else word
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if not word or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"--rates {word!r}: use a positive number of requests per second (2.5) or a "
                f"fraction of P's prefill capacity (0.7x)")
        rates.append(Rate(value, of_capacity))
    return rates


def rate_shape(spec: str) -> tuple[int, int, int]:
    """``--rate-shape IN:OUT:N`` -> (input len, output len, requests per rate), all >= 1."""
    parts = spec.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--rate-shape {spec!r}: expected IN:OUT:N, three positive integers (input "
            f"tokens, output tokens, requests per rate), e.g. 4096:128:200")
    i, o, n = (int(p) for p in parts)
    return i, o, n


def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile, without numpy."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(frozen=True)
class Served:
    """One successful request: its TTFT and TPOT (None with one output token), seconds."""

    ttft_s: float
    tpot_s: float | None


def per_request(result: dict[str, Any]) -> list[Served]:
    """The successful requests of a ``--save-detailed`` result. vLLM lists ``ttfts``,
    ``latencies`` and ``errors`` for every request and ``output_lens`` for the successful
    ones only, in order. Without ``latencies``, a request's latency is its TTFT plus its
    inter-token gaps (``itls``: the same end, its last token)."""
    latencies = result.get("latencies")
    if latencies is None and "itls" in result and "ttfts" in result:
        latencies = [t + sum(gaps) for t, gaps in zip(result["ttfts"], result["itls"])]
    missing = [k for k in ("ttfts", "output_lens") if k not in result]
    if latencies is None:
        missing.append("latencies")
    if missing:
        raise ValueError(f"the result has no per-request {missing}: run vllm bench serve with "
                         f"--save-result --save-detailed")
    errors = result.get("errors") or [""] * len(result["ttfts"])
    ok = [i for i, e in enumerate(errors) if not e]
    lens = result["output_lens"]
    if len(lens) != len(ok):
        raise ValueError(f"{len(lens)} output lengths for {len(ok)} successful requests")
    served = []
    for i, n in zip(ok, lens):
        ttft, latency = result["ttfts"][i], latencies[i]
        served.append(Served(ttft, (latency - ttft) / (n - 1) if n > 1 else None))
    return served


def goodput(served: list[Served], duration_s: float, slo_ttft_ms: float,
            slo_tpot_ms: float) -> tuple[int, float]:
    """(requests that met both objectives, those per second of the run)."""
    good = sum(1 for r in served if r.ttft_s * 1e3 <= slo_ttft_ms
               and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms))
    return good, good / duration_s if duration_s > 0 else 0.0


def offered_rate(result: dict[str, Any]) -> float | None:
    """Arrivals per second the client achieved (from the requests' start times)."""
    starts = sorted(result.get("start_times") or [])
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return None
    return (len(starts) - 1) / (starts[-1] - starts[0])


def summarize_rate(result: dict[str, Any], rate_rps: float, slo_ttft_ms: float,
                   slo_tpot_ms: float) -> dict[str, Any]:
    """One rate point's figures, all from the per-request lists."""
    served = per_request(result)
    duration = float(result["duration"])
    good, good_rps = goodput(served, duration, slo_ttft_ms, slo_tpot_ms)
    ttfts = [r.ttft_s * 1e3 for r in served]
    tpots = [r.tpot_s * 1e3 for r in served if r.tpot_s is not None]
    out: dict[str, Any] = {
        "request_rate": round(rate_rps, 4), "offered_rate": offered_rate(result),
        "achieved_rate": round(len(served) / duration, 4) if duration > 0 else 0.0,
        "completed": len(served), "failed": len(result["ttfts"]) - len(served),
        "duration_s": round(duration, 3), "goodput": round(good_rps, 4), "good": good,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}}
    if out["offered_rate"] is not None:
        out["offered_rate"] = round(out["offered_rate"], 4)
    if ttfts:
        out["ttft_ms"] = {f"p{p}": round(percentile(ttfts, p), 2) for p in (50, 90, 99)}
        out["ttft_ms"]["mean"] = round(sum(ttfts) / len(ttfts), 2)
    if tpots:
        out["tpot_ms"] = {f"p{p}": round(percentile(tpots, p), 3) for p in (50, 99)}
        out["tpot_ms"]["mean"] = round(sum(tpots) / len(tpots), 3)
    return out


def one_line(label: str, point: dict[str, Any]) -> str:
    """The log line of a rate point (plot_results.py reads it)."""
    ttft = point.get("ttft_ms") or {}
    tpot = point.get("tpot_ms") or {}

    def ms(d: dict[str, float], keys: tuple[str, ...], digits: int) -> str:
        return "/".join(f"{d[k]:.{digits}f}" if k in d else "-" for k in keys)

    offered = "-" if point["offered_rate"] is None else f"{point['offered_rate']:.2f}"
    return (f"rate {label} ({point['request_rate']:.2f} req/s, offered {offered}): "
            f"TTFT p50/p90/p99 "
            f"{ms(ttft, ('p50', 'p90', 'p99'), 1)} ms, TPOT p50/p99 "
            f"{ms(tpot, ('p50', 'p99'), 2)} ms, achieved {point['achieved_rate']:.2f} "
            f"requests/s, goodput {point['goodput']:.2f} requests/s ({point['good']}/"
            f"{point['completed']} within TTFT {point['slo']['ttft_ms']:g} ms and TPOT "
            f"{point['slo']['tpot_ms']:g} ms, {point['failed']} failed)")
