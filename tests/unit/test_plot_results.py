"""benchmarks/plot_results.py: the table it collects from ttft_bench.py's logs."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load

plot_results = load("plot_results")

LOG = """\
[12:00:01] layerkv: first request TTFT 1520.3 ms, second 130.2 ms
[12:00:09] layerkv in=4096: median TTFT 126.6 ms
[12:00:40] layerkv load c=16: mean TTFT 301.6 ms, mean TPOT 22.41 ms
[12:01:02] single: first request TTFT 180.0 ms, second 121.5 ms
[12:01:30] single load c=16: mean TTFT 500.0 ms, mean TPOT 6.00 ms, mean E2E 1262.0 ms, 9.55 requests/s (median of 2 runs)
[12:01:10] single in=4096: median TTFT 120.1 ms
"""


def test_runs_split_over_calls_combine_into_one_table(tmp_path: Path) -> None:
    (tmp_path / "r1").mkdir()
    (tmp_path / "r2").mkdir()
    lines = LOG.splitlines(keepends=True)
    (tmp_path / "r1" / "bench.log").write_text("".join(lines[:3]))
    (tmp_path / "r2" / "bench.log").write_text("".join(lines[3:]))
    table = plot_results.collect([tmp_path / "r1", tmp_path / "r2"])
    assert table["c1_median_ttft_ms"] == {"layerkv": {4096: 126.6}, "single": {4096: 120.1}}
    assert table["load"] == {  # a log from before 2026-11-26 has no E2E and rate
        "layerkv": {"concurrency": 16, "mean_ttft_ms": 301.6, "mean_tpot_ms": 22.41},
        "single": {"concurrency": 16, "mean_ttft_ms": 500.0, "mean_tpot_ms": 6.0,
                   "mean_e2el_ms": 1262.0, "request_throughput": 9.55}}
    assert table["cold_start"] == {
        "layerkv": {"first_ttft_ms": 1520.3, "second_ttft_ms": 130.2},
        "single": {"first_ttft_ms": 180.0, "second_ttft_ms": 121.5}}
    md = plot_results.markdown(table)
    assert "| 4096 | 126.6 | 120.1 |" in md
    assert "| layerkv | 16 | 301.6 | 22.41 | - | - |" in md
    assert "| single | 16 | 500.0 | 6.00 | 1262.0 | 9.55 |" in md
    assert "| layerkv | 1520.3 | 130.2 |" in md
