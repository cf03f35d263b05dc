"""Decode steps as the client saw them, from a ``vllm bench serve --save-detailed`` result.

Why: in the one 2 x H200 load run (c=16, 4K in / 128 out, eager), LayerKV's decode instance
produced tokens every 22.4 ms against NixlConnector's 17.2 ms, and the server-side traces could
not say why (benchmarks/results/2026-11-23-h200x2). This reads what the client recorded, the
same way for every configuration, so NixlConnector's D is measured exactly like LayerKV's.

A detailed result has, per request, when it was sent (``start_times``), its TTFT and the gaps
between its later tokens (``itls``), hence the arrival time of every token. Every running
request gets one token per decode step, so each gap is (about) one engine step. A gap during
which *another* request received its first token is a **join** gap: that step took a new
request into the batch. On a P/D decode instance a join step computes the new request's last
prompt token (its KV came from P) and does whatever the connector adds to that step; on a
single instance it also runs the new request's prefill. The rest are **steady** gaps: decode
only. If a configuration's decode is slow only in join steps, its cost is in taking requests
in; if steady steps are slow too, it is in every step.

With the first token from P (``layerkv-ft``, proxy ``--first-token-from-prefill``) a request's
first token is P's, not D's: the step that takes it into D's batch gives it its *second* token.
There, ``join_token=1`` (``--join-token 1``) marks joins by other requests' second tokens, and
each request's first gap (P's token to D's, the hand-over, not a step) counts as neither kind.
With the default (0) a ``layerkv-ft`` result has its joins in the wrong gaps, and its join
steps look as fast as steady ones (corrected in benchmarks/results/2026-11-24-h200-first-token).

``vllm bench serve`` records one gap per streamed chunk. A chunk that carries several tokens
(the server, the proxy or the client fell behind and read them together) gives one longer gap
instead of several; ``merged_tokens`` counts the tokens that came that way. On the GPU hosts it
is normally 0; on the 2-core CI machine it is not, so a gap there is not always one step.

Usage:
    python benchmarks/itl_timeline.py RESULT.json[.gz] [RESULT.json ...] [--window 1.0]
        [--join-token 0|1] [--plot itl_timeline.png] [--by-load]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from png import save_png  # benchmarks/png.py, beside this script

JOIN_SLACK = 0.5
"""A first token counts as part of a gap that ends up to this fraction of the median gap before
it. The tokens of one engine step reach the client over separate streams, one after another:
on the GPU hosts a fraction of a millisecond apart, on a busy 2-core CPU host up to ~3 ms (seen
with 8 ms steps). Half a step attributes each first token to the step that produced it."""


class NotDetailed(ValueError):
    """The result has no per-token times (run ``vllm bench serve`` with ``--save-detailed``)."""


def token_times(result: dict[str, Any]) -> list[list[float]]:
    """Per successful request, the client-side arrival time (s) of each of its tokens."""
    missing = [k for k in ("start_times", "ttfts", "itls") if k not in result]
    if missing:
        raise NotDetailed(f"the result has no {', '.join(missing)}: run vllm bench serve "
                          "with --save-detailed")
    requests = []
    for start, ttft, itls in zip(result["start_times"], result["ttfts"], result["itls"]):
        if not ttft:  # a failed request: no tokens
            continue
        t = start + ttft
        times = [t]
        for gap in itls:
            t += gap
            times.append(t)
        requests.append(times)
    return requests


def gaps(requests: list[list[float]], slack: float = JOIN_SLACK, join_token: int = 0
         ) -> list[tuple[float, float, bool]]:
    """Every gap between two tokens of one request that D's steps made: (end time, length s,
    join?). A gap (a, b] is a join gap if another request's token number ``join_token`` (the
    one D's admitting step gives it) arrived in (a + s, b + s], s being ``slack`` times the
    median gap (see the module docstring and JOIN_SLACK). A request's first ``join_token`` gaps
    come before D's first token for it, and are left out."""
    if join_token < 0:
        raise ValueError(f"join_token must be 0 or more, not {join_token}")
    pairs = [(a, b) for times in requests
             for a, b in zip(times[join_token:], times[join_token + 1:])]
    if not pairs:
        return []
    s = slack * statistics.median(b - a for a, b in pairs)
    joins = sorted(times[join_token] for times in requests if len(times) > join_token)
    out = []
    for a, b in pairs:
        # this request's own joining token is at or before a: never inside its own gaps
        i = bisect.bisect_right(joins, a + s)
        out.append((b, b - a, i < len(joins) and joins[i] <= b + s))
    return out


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 2) if values else None


def split(result: dict[str, Any], slack: float = JOIN_SLACK,
          join_token: int = 0) -> dict[str, Any]:
    """Median gap overall, in join steps and in steady (decode-only) steps, and how many
    tokens reached the client in a chunk with others (``merged_tokens``; None without
    ``output_lens``). ``join_token``: see ``gaps``."""
    requests = token_times(result)
    g = gaps(requests, slack, join_token)
    merged = None
    if "output_lens" in result:
        generated = sum(n for n, ttft in zip(result["output_lens"], result["ttfts"]) if ttft)
        merged = generated - sum(len(times) for times in requests)
    join = [length for _, length, j in g if j]
    steady = [length for _, length, j in g if not j]
    return {
        "gaps": len(g),
        "merged_tokens": merged,
        "join_fraction": round(len(join) / len(g), 3) if g else None,
        "median_itl_ms": _median_ms([length for _, length, _ in g]),
        "median_join_itl_ms": _median_ms(join),
        "median_steady_itl_ms": _median_ms(steady),
        "mean_steady_itl_ms": round(statistics.fmean(steady) * 1e3, 2) if steady else None,
    }


def steady_by_load(result: dict[str, Any], slack: float = JOIN_SLACK, join_token: int = 0
                   ) -> dict[str, Any]:
    """Steady gaps by what else was going on when each ended: how many requests were decoding
    (their first token at or before it, their last at or after it), and whether another request
    was on its way to its first token (sent, first token not yet out: P prefilling it, its KV
    moving to D). A cost that every decode step carries shows at every batch size with or
    without a request on its way; a cost of receiving KV only in ``in_flight``."""
    spans = []  # (sent, first token, last token) of each successful request
    for start, ttft, itls in zip(result.get("start_times", []), result.get("ttfts", []),
                                 result.get("itls", [])):
        if ttft:
            spans.append((start, start + ttft, start + ttft + sum(itls)))
    requests = token_times(result)
    decoding: dict[int, list[float]] = {}
    in_flight: list[float] = []
    none_in_flight: list[float] = []
    for end, length, join in gaps(requests, slack, join_token):
        if join:
            continue
        n = sum(1 for _, first, last in spans if first <= end <= last)
        decoding.setdefault(n, []).append(length)
        # the gap's own request has its first token before ``end``: never counted here
        (in_flight if any(sent <= end < first for sent, first, _ in spans)
         else none_in_flight).append(length)

    def cell(values: list[float]) -> dict[str, Any]:
        return {"gaps": len(values), "median_ms": _median_ms(values)}

    return {"decoding": {n: cell(v) for n, v in sorted(decoding.items())},
            "in_flight": cell(in_flight), "none_in_flight": cell(none_in_flight)}


def timeline(result: dict[str, Any], window_s: float = 1.0, slack: float = JOIN_SLACK,
             join_token: int = 0) -> list[dict[str, Any]]:
    """Per window of the run (by gap end time, from the first token on): median steady gap,
    median join gap, and how many requests joined."""
    requests = token_times(result)
    if not requests:
        return []
    t0 = min(times[0] for times in requests)
    buckets: dict[int, tuple[list[float], list[float]]] = {}
    for end, length, join in gaps(requests, slack, join_token):
        steady, joins = buckets.setdefault(int((end - t0) // window_s), ([], []))
        (joins if join else steady).append(length)
    firsts: dict[int, int] = {}
    for times in requests:
        if len(times) <= join_token:
            continue
        k = int((times[join_token] - t0) // window_s)
        firsts[k] = firsts.get(k, 0) + 1
    return [{"t_s": round(k * window_s, 3), "median_steady_itl_ms": _median_ms(steady),
             "median_join_itl_ms": _median_ms(joins), "joined": firsts.get(k, 0)}
            for k, (steady, joins) in sorted(buckets.items())]


def print_by_load(loads: dict[str, dict[str, Any]]) -> None:
    """Median steady gap (ms) per result, by batch size and by a request on its way; a batch
    size with fewer than 1 % of a result's steady gaps is left out for it."""
    shown = {name: {n: c["median_ms"] for n, c in load["decoding"].items()
                    if c["gaps"] >= 0.01 * sum(x["gaps"] for x in load["decoding"].values())}
             for name, load in loads.items()}
    sizes = sorted({n for cells in shown.values() for n in cells})
    print()
    print("| result | another request on its way | none on its way | "
          + " | ".join(f"{n} decoding" for n in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    for name, load in loads.items():
        by_n = [shown[name].get(n) for n in sizes]
        print(f"| {name} | {load['in_flight']['median_ms']} | "
              f"{load['none_in_flight']['median_ms']} | "
              + " | ".join("-" if v is None else str(v) for v in by_n) + " |")


def plot(timelines: dict[str, list[dict[str, Any]]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib); the table above "
                         "does not") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, rows in timelines.items():
        xs = [r["t_s"] for r in rows if r["median_steady_itl_ms"] is not None]
        ys = [r["median_steady_itl_ms"] for r in rows if r["median_steady_itl_ms"] is not None]
        ax.plot(xs, ys, marker=".", label=f"{name} (steady steps)")
    ax.set_xlabel("time since the first token (s)")
    ax.set_ylabel("median gap between tokens (ms)")
    ax.set_title("Decode step length seen by the client")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--window", type=float, default=1.0, help="timeline window (s)")
    ap.add_argument("--join-token", type=int, default=0, choices=(0, 1),
                    help="which of a request's tokens D's admitting step gives it: 0, or 1 "
                         "for results of the first token from P (layerkv-ft)")
    ap.add_argument("--plot", type=Path, help="write the timeline plot here (needs matplotlib)")
    ap.add_argument("--by-load", action="store_true",
                    help="also split each result's steady steps by the number of requests "
                         "decoding and by whether another request was on its way to its first "
                         "token (batch sizes with at least 1 %% of the gaps)")
    args = ap.parse_args()
    if args.window <= 0:
        ap.error("--window must be > 0 seconds")
    timelines = {}
    loads: dict[str, dict[str, Any]] = {}
    print("| result | gaps | join fraction | median ITL | join steps | steady steps |")
    print("|---|---|---|---|---|---|")
    for path in args.results:
        try:
            raw = path.read_bytes()
            result = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
            s = split(result, join_token=args.join_token)
        except (OSError, ValueError) as e:  # missing, not gzip, not JSON, not detailed
            raise SystemExit(f"{path}: {e}") from None
        name = path.name.removesuffix(".gz").removesuffix(".json")
        if name in timelines:  # the same point of another run
            name = f"{path.parent.name}/{name}"
        print(f"| {name} | {s['gaps']} | {s['join_fraction']} | {s['median_itl_ms']} | "
              f"{s['median_join_itl_ms']} | {s['median_steady_itl_ms']} |")
        timelines[name] = timeline(result, args.window, join_token=args.join_token)
        if args.by_load:
            loads[name] = steady_by_load(result, join_token=args.join_token)
    if loads:
        print_by_load(loads)
    if args.plot:
        plot(timelines, args.plot)


if __name__ == "__main__":
    main()
