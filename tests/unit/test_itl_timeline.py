"""benchmarks/itl_timeline.py: join and steady decode steps told apart from the per-token times
of a ``vllm bench serve --save-detailed`` result, on a simulated engine with known step times."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import BENCHMARKS, load

itl_timeline = load("itl_timeline")

STEADY_S, JOIN_S = 0.010, 0.030


def simulated_result(joins: dict[int, int], tokens: int, steps: int) -> dict:
    """An engine whose decode steps take STEADY_S, and JOIN_S when a request joins the batch.
    ``joins``: request index -> the step whose output is its first token. Each request gets a
    token from every step after that, until it has ``tokens``. Arrivals at the client are a
    few tenths of a millisecond apart within one step (separate streams)."""
    ends, t = [], 100.0
    for step in range(steps):
        t += JOIN_S if step in joins.values() else STEADY_S
        ends.append(t)
    result: dict = {"start_times": [], "ttfts": [], "itls": []}
    for i, first in sorted(joins.items()):
        jitter = 0.0002 * i
        times = [ends[s] + jitter for s in range(first, min(steps, first + tokens))]
        start = times[0] - 0.5
        result["start_times"].append(start)
        result["ttfts"].append(times[0] - start)
        result["itls"].append([b - a for a, b in zip(times, times[1:])])
    return result


def test_join_steps_and_steady_steps_are_told_apart() -> None:
    # four requests in the first step, two joining later (steps 5 and 9)
    result = simulated_result({0: 0, 1: 0, 2: 0, 3: 0, 4: 5, 5: 9}, tokens=12, steps=25)
    s = itl_timeline.split(result)
    assert s["median_join_itl_ms"] == pytest.approx(JOIN_S * 1e3, abs=0.5)
    assert s["median_steady_itl_ms"] == pytest.approx(STEADY_S * 1e3, abs=0.5)
    # the step-5 join is a gap for requests 0-3, the step-9 one for requests 0-4
    assert round(s["join_fraction"] * s["gaps"]) == 4 + 5
    assert s["gaps"] == 4 * 11 + 11 + 11


def test_a_request_s_own_first_token_does_not_make_its_next_gap_a_join() -> None:
    # one request alone: no one else ever joins its steps
    s = itl_timeline.split(simulated_result({0: 0}, tokens=8, steps=8))
    assert s["join_fraction"] == 0 and s["median_join_itl_ms"] is None
    assert s["median_steady_itl_ms"] == pytest.approx(STEADY_S * 1e3, abs=0.5)


def test_failed_requests_are_skipped_and_the_timeline_counts_joins_per_window() -> None:
    result = simulated_result({0: 0, 1: 0, 2: 40}, tokens=60, steps=80)
    result["start_times"].append(0.0)
    result["ttfts"].append(0.0)  # what vllm bench serve records for a failed request
    result["itls"].append([])
    rows = itl_timeline.timeline(result, window_s=0.25)
    assert sum(r["joined"] for r in rows) == 3
    assert [r["joined"] for r in rows if r["joined"]] == [2, 1]
    joined_later = next(r for r in rows if r["t_s"] > 0 and r["joined"])
    assert joined_later["median_join_itl_ms"] == pytest.approx(JOIN_S * 1e3, abs=0.5)


def with_first_tokens_from_p(result: dict, handover_s: float = 0.1) -> dict:
    """The same engine behind the first token from P: every request's first token came from P,
    ``handover_s`` before D's admitting step gave it its second (the engine's first)."""
    out: dict = {"start_times": [], "ttfts": [], "itls": []}
    for start, ttft, itls in zip(result["start_times"], result["ttfts"], result["itls"]):
        out["start_times"].append(start)
        out["ttfts"].append(ttft - handover_s)
        out["itls"].append([handover_s, *itls])
    return out


def test_with_the_first_token_from_p_joins_are_found_by_the_second_token() -> None:
    engine = simulated_result({0: 0, 1: 0, 2: 0, 3: 0, 4: 5, 5: 9}, tokens=12, steps=25)
    ft = with_first_tokens_from_p(engine)
    # read as D's joins, the same steps as without P's tokens; the hand-over gaps are no steps
    assert itl_timeline.split(ft, join_token=1) == itl_timeline.split(engine)
    # read by the first token (the default), the joins land on the wrong gaps
    wrong = itl_timeline.split(ft)
    assert wrong["median_join_itl_ms"] != pytest.approx(JOIN_S * 1e3, abs=0.5)
    rows = itl_timeline.timeline(ft, window_s=0.25, join_token=1)
    assert sum(r["joined"] for r in rows) == 6
    with pytest.raises(ValueError, match="join_token"):
        itl_timeline.gaps([[0.0, 0.1]], join_token=-1)


def test_the_benchmark_reads_its_first_token_configuration_by_the_second_token() -> None:
    ttft_bench = load("ttft_bench")
    assert ttft_bench.join_token(ttft_bench.parse_config("layerkv-ft")) == 1
    assert ttft_bench.join_token(ttft_bench.parse_config("layerkv")) == 0
    assert ttft_bench.join_token(ttft_bench.parse_config("nixl")) == 0


def test_a_result_without_per_token_times_says_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(itl_timeline.NotDetailed, match="--save-detailed"):
        itl_timeline.split({"ttfts": [0.1]})
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"mean_tpot_ms": 17.2}))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "itl_timeline.py"), str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--save-detailed" in r.stderr, r.stderr


def test_the_command_prints_one_row_per_result_plain_or_gzipped(tmp_path: Path) -> None:
    data = json.dumps(simulated_result({0: 0, 1: 0, 2: 5}, tokens=10, steps=20)).encode()
    (tmp_path / "layerkv_c16_in4096_out128.json").write_bytes(data)
    (tmp_path / "nixl_c16_in4096_out128.json.gz").write_bytes(gzip.compress(data))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "itl_timeline.py"),
                        str(tmp_path / "layerkv_c16_in4096_out128.json"),
                        str(tmp_path / "nixl_c16_in4096_out128.json.gz")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.strip().splitlines()[-2:]
    for row, name in zip(rows, ("layerkv", "nixl")):
        assert row.startswith(f"| {name}_c16_in4096_out128 |") and "| 30.0 | 10.0 |" in row, rows


def test_a_missing_result_is_named_in_the_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(BENCHMARKS / "itl_timeline.py"),
                        str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "nope.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tokens_that_came_in_one_chunk_are_counted() -> None:
    """vllm bench serve keeps one gap per chunk: a chunk with 3 tokens is one gap, not 3."""
    result = simulated_result({0: 0, 1: 0}, tokens=6, steps=6)
    result["output_lens"] = [6, 6]
    assert itl_timeline.split(result)["merged_tokens"] == 0
    itls = result["itls"][1]
    result["itls"][1] = [itls[0], itls[1] + itls[2] + itls[3], itls[4]]  # tokens 3-5 together
    s = itl_timeline.split(result)
    assert s["merged_tokens"] == 2 and s["gaps"] == 5 + 3


def test_steady_steps_are_split_by_batch_size_and_by_a_request_on_its_way(tmp_path: Path
                                                                          ) -> None:
    """An engine whose steps take 10 ms, and 14 ms while request 2 is on its way (sent at step
    20, first token at step 40): the split finds the slower steps in ``in_flight`` only, and
    counts 2 requests decoding before step 40, 3 until requests 0 and 1 end, then 1."""
    on_way_s = 0.014
    ends, t = [], 100.0
    for step in range(80):
        t += on_way_s if 20 < step <= 40 else STEADY_S
        ends.append(t)
    result: dict = {"start_times": [], "ttfts": [], "itls": []}
    for i, (first, sent) in enumerate([(0, ends[0] - 0.5), (0, ends[0] - 0.5), (40, ends[20])]):
        times = [ends[s] + 0.0002 * i for s in range(first, min(80, first + 60))]
        result["start_times"].append(sent)
        result["ttfts"].append(times[0] - sent)
        result["itls"].append([b - a for a, b in zip(times, times[1:])])
    load_split = itl_timeline.steady_by_load(result)
    assert load_split["in_flight"]["median_ms"] == pytest.approx(on_way_s * 1e3, abs=0.5)
    assert load_split["none_in_flight"]["median_ms"] == pytest.approx(STEADY_S * 1e3, abs=0.5)
    assert set(load_split["decoding"]) == {1, 2, 3}
    assert load_split["decoding"][3]["median_ms"] == pytest.approx(STEADY_S * 1e3, abs=0.5)
    # the join step (request 2's first token) is in neither class
    steady = itl_timeline.split(result)
    split_gaps = load_split["in_flight"]["gaps"] + load_split["none_in_flight"]["gaps"]
    assert split_gaps == round(steady["gaps"] * (1 - steady["join_fraction"]))
    path = tmp_path / "layerkv_rate0.5x_in4096_out128.json"
    path.write_text(json.dumps(result))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "itl_timeline.py"), "--by-load",
                        str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("| another request on its way | none on its way | 1 decoding | 2 decoding | "
            "3 decoding |") in r.stdout
    assert "| layerkv_rate0.5x_in4096_out128 | 14.0 | 10.0 |" in r.stdout, r.stdout
