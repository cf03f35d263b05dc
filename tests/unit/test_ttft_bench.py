"""benchmarks/ttft_bench.py: the pieces that do not need a server."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmark_scripts import load

ttft_bench = load("ttft_bench")


def test_every_benchmark_point_has_its_own_seed() -> None:
    points = [(c, i, o) for c in (1, 16, 64) for i in (64, 1024, 4096, 8192, 16000)
              for o in (8, 128, 512)]
    seeds = {ttft_bench.dataset_seed(*p) for p in points}
    assert len(seeds) == len(points)


@pytest.mark.parametrize("point", [(1, 16000, 8), (64, 16000, 512), (999, 10**6, 10**5)])
def test_seed_is_one_vllm_bench_serve_accepts(point: tuple[int, int, int]) -> None:
    seed = ttft_bench.dataset_seed(*point)
    assert 0 <= seed < 2**32
    np.random.seed(seed)  # what vllm bench serve does with it (raises past 2**32 - 1)


def test_different_tp_configurations_parse_place_and_bind() -> None:
    """``layerkv-tp2-tp1``: P with TP2 and D with TP1, on two GPUs when there are (P on 0-1, D
    sharing GPU 1 with only two), on CPU one core per P rank and D on core 1."""
    config = ttft_bench.parse_config("layerkv-tp2-tp1")
    assert (config.family, config.p_tp, config.d_tp, config.unstaged) == ("layerkv", 2, 1, False)
    assert ttft_bench.parse_config("layerkv-tp1-tp2-unstaged").unstaged
    assert ttft_bench.placement("prefill", 2, 1, 4) == ("0,1", False)
    assert ttft_bench.placement("decode", 1, 2, 4) == ("2", False)
    assert ttft_bench.placement("decode", 1, 2, 2) == ("1", True)
    assert ttft_bench.cpu_bind("prefill", 2) == "0|1"
    assert ttft_bench.cpu_bind("decode", 1) == "1"
    for bad in ("single-tp2-tp1", "nixl-tp2-tp1-unstaged", "layerkv-tp2"):
        with pytest.raises(SystemExit):
            ttft_bench.parse_config(bad)
    with pytest.raises(SystemExit, match="needs 4 GPUs"):
        ttft_bench.placement("prefill", 4, 1, 2)


class FakePrefill:
    """What transfer_counters reads of a server: its /metrics text."""

    def __init__(self, text: str):
        self.text = text

    def metrics(self) -> str:
        return self.text


def test_transfer_counters_count_requests_once_per_prefill_rank() -> None:
    """Every P rank counts each transfer it sent: with TP2, 16 transfers_sent are 8 requests,
    and 40 group sends over both ranks are 5 transfer operations per request."""
    text = "\n".join([
        '# TYPE vllm:layerkv_groups_sent counter',
        'vllm:layerkv_groups_sent_total{engine="0"} 40.0',
        'vllm:layerkv_transfers_sent_total{engine="0"} 16.0',
        'vllm:layerkv_bytes_sent_total{engine="0"} 1048576.0',
    ])
    counters = ttft_bench.transfer_counters(FakePrefill(text), p_tp=2)
    assert counters["requests"] == 8
    assert counters["transfer_ops_per_request"] == 5.0
    assert counters["layerkv_bytes_sent"] == 1048576.0
    assert "requests" not in ttft_bench.transfer_counters(FakePrefill(""), p_tp=1)


class FakeServer:
    """What bring_up uses of a vLLM server: start, readiness, stop."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.url = "http://127.0.0.1:1"
        self.stopped = False

    def start(self) -> None:
        self.pid = 1

    def poll_ready(self) -> bool:
        return True

    def stop(self) -> None:
        self.stopped = True


class NoWorker:
    """In place of the ``vllm bench serve`` worker (BenchServe), for runs that bench nothing."""

    def __init__(self, *args) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_proxy_that_fails_to_start_takes_its_servers_down(tmp_path) -> None:
    import sys

    from vllm_layerkv.testing.servers import ServerError

    p, d = FakeServer(), FakeServer()
    deployment = ttft_bench.Deployment([p, d], [sys.executable, "-c", "raise SystemExit(3)"],
                                       tmp_path / "proxy.log")
    args = argparse.Namespace(device="cpu", num_gpus=2, start_timeout=10)
    with pytest.raises(ServerError, match="exited with 3"):
        ttft_bench.bring_up(deployment, ttft_bench.parse_config("layerkv"), args)
    assert p.stopped and d.stopped


def test_a_configuration_that_does_not_start_is_recorded_and_the_next_one_runs(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One configuration failing to start must not cost the others their measurements."""
    import sys

    from vllm_layerkv.testing.servers import ServerError

    def bring_up(deployment, config, args):
        if config.name == "single":
            raise ServerError("single exited with rc=1 during start-up")
        return "http://127.0.0.1:1", []

    def measure(config, url, decoder, args, runner, identity, res, save, groups, capacity,
                gpus, engines):
        res["measured_at"] = url
        return True

    monkeypatch.setattr(ttft_bench, "BenchServe", NoWorker)
    monkeypatch.setattr(ttft_bench, "deploy", lambda *a: ttft_bench.Deployment([FakeServer()]))
    monkeypatch.setattr(ttft_bench, "bring_up", bring_up)
    monkeypatch.setattr(ttft_bench, "measure", measure)
    monkeypatch.setattr(ttft_bench, "transfer_counters", lambda *a: {})
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["ttft_bench.py", "--device", "cpu", "--model", "m",
                                      "--configs", "single", "layerkv", "--out", str(out)])
    assert ttft_bench.main() == 1
    results = json.loads((out / "summary.json").read_text())["results"]
    assert results["single"]["error"] == ("did not start: single exited with rc=1 during "
                                          "start-up")
    assert results["layerkv"]["measured_at"] == "http://127.0.0.1:1"
    assert "error" not in results["layerkv"]


def test_a_placement_the_machine_cannot_hold_fails_before_anything_starts(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    started = []

    class Worker:
        def __init__(self, *args) -> None:
            pass

        def start(self) -> None:
            started.append("worker")

        def close(self) -> None:
            pass

    monkeypatch.setattr(ttft_bench, "BenchServe", Worker)
    monkeypatch.setattr(ttft_bench, "deploy", lambda *a: started.append("deploy"))
    monkeypatch.setattr(sys, "argv", ["ttft_bench.py", "--device", "cuda", "--model", "m",
                                      "--num-gpus", "1", "--configs", "single",
                                      "layerkv-tp2-tp1", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="TP 2 needs 2 GPUs"):
        ttft_bench.main()
    assert started == []


def test_a_malformed_load_point_is_refused_before_anything_starts(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    assert ttft_bench.load_point("16:4096:128:200") == (16, 4096, 128, 200)
    monkeypatch.setattr(sys, "argv", ["ttft_bench.py", "--model", "m", "--load", "16:4096",
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        ttft_bench.main()
    assert "expected C:IN:OUT:N, four positive integers" in capsys.readouterr().err


def test_a_point_keeps_per_token_times_but_not_the_generated_texts(tmp_path) -> None:
    """vllm bench serve runs with --save-detailed: the point's file keeps what itl_timeline.py
    reads (start times, TTFTs, gaps) and loses the generated texts; the summary splits the
    decode steps."""
    calls = []

    class Runner:  # stands in for bench_serve.BenchServe: writes the result vLLM would
        def run(self, argv, stdout_path, timeout):
            calls.append(argv)
            out = Path(argv[argv.index("--result-dir") + 1])
            (out / argv[argv.index("--result-filename") + 1]).write_text(json.dumps({
                "median_ttft_ms": 50.0, "completed": 2, "failed": 0,
                "start_times": [1.0, 1.0], "ttfts": [0.05, 0.05],
                "itls": [[0.01, 0.01], [0.01, 0.01]], "generated_texts": ["a b", "c d"]}))

    args = argparse.Namespace(tokenizer=None, model="m", bench_timeout=60)
    result = ttft_bench.bench(Runner(), "http://x", args, tmp_path, "layerkv_c2_in16_out3", 16,
                              3, 2, 2)
    assert "--save-detailed" in calls[0]
    saved = json.loads((tmp_path / "layerkv_c2_in16_out3.json").read_text())
    assert "generated_texts" not in saved and "generated_texts" not in result
    assert saved["itls"] == [[0.01, 0.01], [0.01, 0.01]]
    steps = ttft_bench.summarize(result)["steps"]
    assert steps["gaps"] == 4 and steps["median_steady_itl_ms"] == 10.0


def deploy_args(**changes: object) -> argparse.Namespace:
    """The options ``deploy`` reads, as the parser leaves them on CPU."""
    return argparse.Namespace(**{
        "device": "cpu", "num_gpus": 2, "gpu_memory_utilization": 0.85, "load_format": None,
        "model": "/m", "cuda_graphs": False, "dtype": None, "max_model_len": 2048,
        "max_num_batched_tokens": None, "max_num_seqs": 8, "no_prefix_caching": False,
        "trace": False, "kv_cache_dtype": None, "decode_first_gpu": None, "vllm_args": "",
        "tp_vllm_args": "", **changes})


def test_layerkv_ft_runs_the_proxy_with_the_first_token_from_prefill(tmp_path) -> None:
    args = deploy_args()
    ft = ttft_bench.deploy(ttft_bench.parse_config("layerkv-ft"), args, tmp_path)
    plain = ttft_bench.deploy(ttft_bench.parse_config("layerkv"), args, tmp_path)
    assert ft.proxy_cmd is not None and plain.proxy_cmd is not None
    assert ft.proxy_cmd[-1] == "--first-token-from-prefill"
    assert "--first-token-from-prefill" not in plain.proxy_cmd


@pytest.mark.parametrize("config", ["single", "nixl", "layerkv"])
def test_kv_cache_dtype_reaches_every_server(config: str, tmp_path) -> None:
    """P, D and the single instance must store KV alike, or the comparison is not one."""
    deployed = ttft_bench.deploy(ttft_bench.parse_config(config), deploy_args(
        kv_cache_dtype="fp8"), tmp_path)
    for server in deployed.servers:
        cmd = server.command()
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8", cmd
    plain = ttft_bench.deploy(ttft_bench.parse_config(config), deploy_args(), tmp_path)
    assert not any("--kv-cache-dtype" in s.command() for s in plain.servers)


def test_each_repeat_of_a_load_point_has_prompts_of_its_own() -> None:
    """A repeat with the first run's prompts would hit the prefix cache: no prefill at all."""
    assert ttft_bench.dataset_seed(16, 4096, 128, 1) == ttft_bench.dataset_seed(16, 4096, 128)
    seeds = {ttft_bench.dataset_seed(16, 4096, 128, r) for r in (1, 2, 3)}
    assert len(seeds) == 3 and all(0 <= s < 2**32 for s in seeds)


def decode_metrics(itl_sum_s: float, tokens: int, steps: int) -> str:
    """The two histograms of a vLLM /metrics text that decode_server_steps reads."""
    labels = '{engine="0",model_name="m"}'
    return (f"vllm:inter_token_latency_seconds_sum{labels} {itl_sum_s}\n"
            f"vllm:inter_token_latency_seconds_count{labels} {tokens}\n"
            f"vllm:iteration_tokens_total_sum{labels} {tokens}\n"
            f"vllm:iteration_tokens_total_count{labels} {steps}\n")


def test_the_decode_instance_s_own_itl_is_read_from_two_scrapes() -> None:
    before, after = decode_metrics(1.0, 100, 10), decode_metrics(3.0, 200, 20)
    assert ttft_bench.decode_server_steps(before, after) == {
        "mean_itl_ms": 20.0, "itl_tokens": 100, "engine_steps": 10}
    assert ttft_bench.decode_server_steps(before, before)["mean_itl_ms"] is None
    assert ttft_bench.decode_server_steps("", after) == {}  # not scraped: nothing claimed


def test_load_repeats_report_each_run_and_their_medians(tmp_path, monkeypatch, capsys) -> None:
    """--load-repeats 3: three runs with prompts of their own, each with the decode
    instance's own ITL, and the medians on the line plot_results.py reads."""
    tpots = iter([20.0, 30.0, 22.0])
    seeds = []

    class Runner:
        def run(self, argv, stdout_path, timeout):
            load_point = argv[argv.index("--max-concurrency") + 1] != "1"
            if load_point:
                seeds.append(argv[argv.index("--seed") + 1])
            out = Path(argv[argv.index("--result-dir") + 1])
            tpot = next(tpots) if load_point else 1.0
            (out / argv[argv.index("--result-filename") + 1]).write_text(json.dumps({
                "mean_ttft_ms": 5 * tpot, "median_ttft_ms": 5 * tpot, "p90_ttft_ms": 6 * tpot,
                "mean_tpot_ms": tpot, "median_tpot_ms": tpot, "mean_itl_ms": tpot,
                "mean_e2el_ms": 7 * tpot, "request_throughput": 100 / tpot,
                "completed": 2, "failed": 0}))

    class Decoder:  # D's /metrics: 10 more tokens per scrape pair, at 10 ms each
        served_model_name = "m"

        def __init__(self):
            self.scrapes = 0

        def metrics(self) -> str:
            self.scrapes += 1
            n = self.scrapes // 2 * 10
            return decode_metrics(n * 0.010, n, n)

    monkeypatch.setattr(ttft_bench, "cold_start", lambda *a: {"cold_ttft_ms": 1.0,
                                                              "warm_ttft_ms": 1.0})
    monkeypatch.setattr(ttft_bench, "warm_up", lambda *a: None)
    args = argparse.Namespace(tokenizer=None, model="m", bench_timeout=60, prompt_lens=[16],
                              output_len=8, num_prompts=1, max_model_len=2048,
                              load=[(2, 16, 3, 2)], load_repeats=3,
                              out=tmp_path, identity=0)
    identity = ttft_bench.IdentityCheck(0, args, tmp_path / "ref.json")
    res: dict = {}
    ttft_bench.measure(ttft_bench.parse_config("layerkv"), "http://x", Decoder(), args,
                       Runner(), identity, res, lambda: None)
    point = res["c2_in16_out3"]
    assert [r["mean_tpot_ms"] for r in point["repeats"]] == [20.0, 30.0, 22.0]
    assert point["mean_tpot_ms"] == 20.0  # the first run, as without repeats
    assert point["median_of_repeats"] == {
        "mean_ttft_ms": 110.0, "median_ttft_ms": 110.0, "p90_ttft_ms": 132.0,
        "mean_tpot_ms": 22.0, "median_tpot_ms": 22.0, "mean_e2el_ms": 154.0,
        "request_throughput": 100 / 22, "decode_server_mean_itl_ms": 10.0, "runs": 3}
    assert len(set(seeds)) == 3
    assert sorted(p.name for p in tmp_path.glob("layerkv_c2_*.json")) == [
        "layerkv_c2_in16_out3.json", "layerkv_c2_in16_out3_r2.json",
        "layerkv_c2_in16_out3_r3.json"]
    plot_results = load("plot_results")
    lines = [line for line in capsys.readouterr().out.splitlines() + [""]
             if plot_results.LOAD.search(line)]
    assert len(lines) == 1 and ("mean TPOT 22.00 ms, mean E2E 154.0 ms, 4.55 requests/s "
                                "(median of 3 runs)") in lines[0], lines
    row = plot_results.LOAD.search(lines[0])
    assert row is not None and (row[5], row[6]) == ("154.0", "4.55")


@pytest.mark.parametrize("config,mode", [("layerkv-router", "mooncake"),
                                         ("layerkv-router-nixl", "nixl")])
def test_layerkv_router_puts_vllm_router_in_front_of_prefill_and_decode(
        config: str, mode: str, tmp_path) -> None:
    """vllm-router (the venv's, P/D mode) instead of the proxy; in mooncake mode it names P's
    bootstrap port, which P serves (its extra config); bring_up appends --port."""
    import sys

    deployed = ttft_bench.deploy(ttft_bench.parse_config(config), deploy_args(), tmp_path)
    p, d = deployed.servers
    cmd = deployed.proxy_cmd
    assert cmd is not None and cmd[0] == str(Path(sys.executable).parent / "vllm-router")
    assert deployed.proxy_log == tmp_path / config / "router.log"
    assert cmd[cmd.index("--kv-connector") + 1] == mode
    assert "--vllm-pd-disaggregation" in cmd and "--port" not in cmd
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert cmd[cmd.index("--decode") + 1] == d.url
    assert cmd[cmd.index("--prometheus-port") + 1].isdigit()  # never the shared default
    p_extra = p.kv_transfer_config["kv_connector_extra_config"]
    prefill = cmd[cmd.index("--prefill") + 1:cmd.index("--decode")]
    if mode == "mooncake":
        assert prefill == [p.url, str(p_extra["bootstrap_port"])]
    else:
        assert prefill == [p.url] and "bootstrap_port" not in p_extra
    assert ttft_bench.parse_config(f"{config}-tp2-tp1").family == config


# ----------------------------------------------------------------- open-loop rate points

open_loop = load("open_loop")
ideal_ttft = load("ideal_ttft")


def test_rates_parse_as_requests_per_second_or_fractions_of_capacity() -> None:
    rates = open_loop.parse_rates("0.5x,0.7x, 2.5")
    assert [(r.value, r.of_capacity, r.label) for r in rates] == [
        (0.5, True, "0.5x"), (0.7, True, "0.7x"), (2.5, False, "2.5rps")]
    assert rates[0].per_second(8.0) == 4.0 and rates[2].per_second(None) == 2.5
    with pytest.raises(ValueError, match="not known: run 'single' first or give --capacity"):
        rates[1].per_second(None)
    for bad in ("0x", "-1", "fast", "1.5y", "", "nanx"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number"):
            open_loop.parse_rates(bad)
    assert open_loop.rate_shape("4096:128:200") == (4096, 128, 200)
    with pytest.raises(argparse.ArgumentTypeError, match="IN:OUT:N"):
        open_loop.rate_shape("4096:128")


def test_capacity_from_an_earlier_run_s_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"capacity": {"requests_per_s": 9.74, "prompt_len": 4096}}))
    got = ttft_bench.earlier_capacity(summary)
    assert got["requests_per_s"] == 9.74 and got["prompt_len"] == 4096
    assert got["measured_on"] == f"--capacity-from {summary}"
    summary.write_text(json.dumps({"results": {}}))  # that run measured none
    with pytest.raises(SystemExit, match="no measured capacity there.*give --capacity"):
        ttft_bench.earlier_capacity(summary)
    with pytest.raises(SystemExit, match="no measured capacity there"):
        ttft_bench.earlier_capacity(tmp_path / "missing.json")


def test_percentiles_are_numpy_s() -> None:
    values = [float(v) for v in np.random.default_rng(3).exponential(100, 57)]
    for p in (0, 1, 50, 90, 99, 100):
        assert open_loop.percentile(values, p) == pytest.approx(np.percentile(values, p))


def detailed(ttfts: list[float], latencies: list[float], output_lens: list[int],
             errors: list[str], duration: float) -> dict:
    """What vllm bench serve --save-detailed writes: every request in ttfts, latencies and
    errors, the successful ones only in output_lens."""
    return {"ttfts": ttfts, "latencies": latencies, "output_lens": output_lens,
            "errors": errors, "duration": duration,
            "start_times": [0.5 * i for i in range(len(ttfts))]}


def test_goodput_counts_requests_that_meet_both_objectives_from_per_request_data() -> None:
    """TPOT per request is (latency - TTFT) / (output tokens - 1); a failed request is listed
    in ttfts but not in output_lens, so the lists are aligned on the successful ones."""
    result = detailed(
        ttfts=[0.2, 0.0, 0.9, 1.5, 0.3, 0.1],
        latencies=[1.2, 0.0, 1.9, 2.5, 5.3, 0.1],
        output_lens=[101, 101, 101, 101, 1],  # the second request failed
        errors=["", "connection reset", "", "", "", ""], duration=4.0)
    # TPOTs: 10, 10, 10, 50 ms; the last has one token (judged by its TTFT only)
    served = open_loop.per_request(result)
    assert [(r.ttft_s, r.tpot_s) for r in served] == [
        (0.2, pytest.approx(0.01)), (0.9, pytest.approx(0.01)), (1.5, pytest.approx(0.01)),
        (0.3, pytest.approx(0.05)), (0.1, None)]
    # TTFT <= 1000 ms and TPOT <= 25 ms: the first, second and fifth
    assert open_loop.goodput(served, 4.0, 1000, 25) == (3, 0.75)
    point = open_loop.summarize_rate(result, 1.5, 1000, 25)
    assert point["completed"] == 5 and point["failed"] == 1 and point["good"] == 3
    assert point["goodput"] == 0.75 and point["achieved_rate"] == 1.25
    assert point["offered_rate"] == 2.0  # six arrivals 0.5 s apart
    assert point["ttft_ms"]["p50"] == 300.0 and point["ttft_ms"]["p99"] == pytest.approx(1476.0)
    assert point["tpot_ms"]["p50"] == 10.0 and point["tpot_ms"]["p99"] == pytest.approx(48.8)
    # the mean of the TTFTs would hide what goodput counts: the slowest three are over 0.3 s
    assert point["ttft_ms"]["mean"] == pytest.approx(600.0)


def test_per_request_data_is_required_and_must_line_up() -> None:
    with pytest.raises(ValueError, match="--save-detailed"):
        open_loop.per_request({"ttfts": [0.1], "duration": 1.0})
    # a result without latencies: TTFT plus the gaps between its tokens
    gaps_only = {"ttfts": [0.1, 0.2], "itls": [[0.01] * 10, []], "output_lens": [11, 1],
                 "errors": ["", ""]}
    served = open_loop.per_request(gaps_only)
    assert served[0].tpot_s == pytest.approx(0.01) and served[1].tpot_s is None
    with pytest.raises(ValueError, match="2 output lengths for 1 successful"):
        open_loop.per_request(detailed([0.1, 0.2], [1, 1], [5, 5], ["", "boom"], 1.0))


def test_the_rate_log_line_is_what_plot_results_reads(tmp_path) -> None:
    result = detailed([0.2, 0.4], [1.2, 1.4], [11, 11], ["", ""], 2.0)
    point = open_loop.summarize_rate(result, 1.0, 1000, 150)
    line = "[bench 12:00:00] layerkv " + open_loop.one_line("0.5x", point)
    (tmp_path / "bench.log").write_text(line + "\n")
    plot_results = load("plot_results")
    table = plot_results.collect([tmp_path])
    assert table["rates"] == {"layerkv": {"0.5x": {
        "request_rate": 1.0, "offered_rate": 2.0, "ttft_p50_ms": 300.0, "ttft_p90_ms": 380.0,
        "ttft_p99_ms": 398.0, "tpot_p50_ms": 100.0, "tpot_p99_ms": 100.0,
        "achieved_rate": 1.0, "goodput": 1.0}}}
    assert "| layerkv | 0.5x | 1.00 | 300.0 / 380.0 / 398.0 | 100.00 / 100.00 | 1.00 | 1.00 |" \
        in plot_results.markdown(table)


# ----------------------------------------------------------------- ideal TTFT


def test_ideal_ttft_is_the_single_instance_until_the_link_is_slower_than_the_prefill() -> None:
    # 8K tokens of Llama-3.1-8B KV: 1.07 GB; single 254 ms, of which 20 ms fixed overhead
    kv = 8192 * 131072
    fast = ideal_ttft.ideal_ttft_ms(254.0, 20.0, kv, 100.0)  # 10.7 ms on the link
    assert fast == 254.0
    slow = ideal_ttft.ideal_ttft_ms(254.0, 20.0, kv, 1.25)  # 10 Gb/s: 859 ms on the link
    assert slow == pytest.approx(20.0 + kv / 1.25e9 * 1e3)


def test_the_link_of_a_configuration_is_its_probed_transport_capped_by_its_pacing() -> None:
    probe = [{"transport": "tcp", "ok": True, "gbps": 4.0, "ucx_tls": None},
             {"transport": "nixl", "ok": True, "gbps": 20.0, "ucx_tls": None},
             {"transport": "nixl", "ok": True, "gbps": 2.5, "ucx_tls": "tcp,cuda_copy,self"},
             {"transport": "cuda_ipc", "ok": False, "error": "x", "ucx_tls": None}]
    assert ideal_ttft.link_rate("tcp", None, 0.0, probe) == (4.0, "tcp, probed")
    assert ideal_ttft.link_rate("tcp", None, 10.0, probe) == (1.25, "tcp paced to 10 Gb/s")
    assert ideal_ttft.link_rate("tcp", None, 100.0, probe)[0] == 4.0  # the link is slower
    assert ideal_ttft.link_rate("nixl", "tcp,cuda_copy,self", 0.0, probe)[0] == 2.5
    assert ideal_ttft.link_rate("nixl", None, 0.0, probe)[0] == 20.0
    assert ideal_ttft.link_rate("cuda_ipc", None, 0.0, probe) == (None, "cuda_ipc, not probed")


def summary_for_ideal(tmp_path: Path) -> tuple[dict, argparse.Namespace]:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32,
        "hidden_size": 4096}))
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"results": [
        {"transport": "tcp", "ok": True, "gbps": 4.0, "ucx_tls": None},
        {"transport": "cuda_ipc", "ok": True, "gbps": 150.0, "ucx_tls": None}]}))
    results = {
        "single": {"c1_in8192": {"median_ttft_ms": 254.0}, "c1_in16000": {"median_ttft_ms": 544.0},
                   "overhead": {"median_ttft_ms": 20.0}},
        "layerkv": {"c1_in8192": {"median_ttft_ms": 260.0}, "c1_in16000": {"median_ttft_ms": 560.0},
                    "transport_used": "cuda_ipc"},
        "layerkv-tcp-10g": {"c1_in8192": {"median_ttft_ms": 1000.0},
                            "transport_used": "tcp"},
        "single-x2": {"c1_in8192": {"median_ttft_ms": 250.0}}}
    args = argparse.Namespace(prompt_lens=[8192, 16000], model=str(model), dtype="bfloat16",
                              kv_cache_dtype=None, link_probe=[probe], device="cuda")
    return {"results": results}, args


def test_ideal_report_per_configuration_and_prompt_length(tmp_path) -> None:
    summary, args = summary_for_ideal(tmp_path)
    configs = [ttft_bench.parse_config(n) for n in summary["results"]]
    report = ttft_bench.ideal_report(summary["results"], configs, args)
    assert report["kv_token_bytes"] == 131072 and report["overhead_ms"] == 20.0
    assert set(report["configs"]) == {"layerkv", "layerkv-tcp-10g"}  # P/D ones only
    ipc = report["configs"]["layerkv"]
    assert ipc["link_gbps"] == 150.0
    assert ipc["points"][8192]["ideal_ttft_ms"] == 254.0  # the link hides behind the prefill
    assert ipc["points"][16000]["ratio"] == round(560 / 544, 3)
    paced = report["configs"]["layerkv-tcp-10g"]
    assert paced["link_gbps"] == 1.25 and paced["paced_gbps"] == 10.0
    row = paced["points"][8192]
    assert row["kv_bytes"] == 8192 * 131072
    assert row["ideal_ttft_ms"] == pytest.approx(20.0 + 8192 * 131072 / 1.25e6, abs=0.01)
    assert row["ratio"] == pytest.approx(1000.0 / row["ideal_ttft_ms"], abs=0.001)
    assert 16000 not in paced["points"]  # not measured


def test_the_engine_prefill_ideal_and_p_s_prefill_beside_the_single_instance_s(
        tmp_path) -> None:
    """With the engines' own prefill times (vLLM's request_prefill_time), the report adds the
    ideal that counts only the single instance's engine prefill as what a transfer can hide
    behind, and P's prefill against the single instance's."""
    summary, args = summary_for_ideal(tmp_path)
    results = summary["results"]
    results["single"]["c1_in8192"]["engine"] = {
        "single": {"requests": 5, "mean_queue_ms": 0.2, "mean_prefill_ms": 200.0}}
    results["layerkv-tcp-10g"]["c1_in8192"]["engine"] = {
        "prefill": {"requests": 5, "mean_queue_ms": 0.3, "mean_prefill_ms": 210.0},
        "decode": {"requests": 5, "mean_queue_ms": 850.0, "mean_prefill_ms": 9.0}}
    configs = [ttft_bench.parse_config(n) for n in results]
    report = ttft_bench.ideal_report(summary["results"], configs, args)
    paced = report["configs"]["layerkv-tcp-10g"]
    row = paced["points"][8192]
    transfer = 8192 * 131072 / 1.25e6
    assert row["ideal_ttft_ms"] == pytest.approx(20.0 + transfer, abs=0.01)
    # 54 ms of the single instance's TTFT is not its engine's prefill: no transfer hides it
    assert row["single_engine_prefill_ms"] == 200.0
    assert row["engine_ideal_ttft_ms"] == pytest.approx(54.0 + transfer, abs=0.01)
    assert row["engine_ratio"] == pytest.approx(1000.0 / (54.0 + transfer), abs=0.001)
    assert paced["p_prefill"] == {8192: {"p_engine_prefill_ms": 210.0,
                                         "single_engine_prefill_ms": 200.0, "ratio": 1.05}}
    # where the link hides behind the prefill, both ideals are the single instance's TTFT
    ipc = report["configs"]["layerkv"]["points"][8192]
    assert ipc["ideal_ttft_ms"] == ipc["engine_ideal_ttft_ms"] == 254.0
    assert ipc["engine_ratio"] == ipc["ratio"] == round(260 / 254, 3)
    assert "engine_ideal_ttft_ms" not in report["configs"]["layerkv"]["points"][16000]


def test_a_configuration_s_own_probes_before_and_after_it_give_its_link_rate(tmp_path) -> None:
    """--probe-around: the mean of the probes around the configuration, not the run's file
    (4.0 GB/s there); a failed probe does not count."""
    summary, args = summary_for_ideal(tmp_path)
    summary["results"]["layerkv-tcp"] = {
        "c1_in8192": {"median_ttft_ms": 300.0}, "transport_used": "tcp",
        "link_probes": [
            {"transport": "tcp", "ok": True, "gbps": 3.0, "ucx_tls": None, "when": "before"},
            {"transport": "tcp", "ok": True, "gbps": 3.5, "ucx_tls": None, "when": "after"},
            {"transport": "tcp", "when": "after", "error": "x"}]}
    configs = [ttft_bench.parse_config(n) for n in summary["results"]]
    report = ttft_bench.ideal_report(summary["results"], configs, args)
    assert report["configs"]["layerkv-tcp"]["link_gbps"] == pytest.approx(3.25)
    row = report["configs"]["layerkv-tcp"]["points"][8192]
    assert row["ideal_ttft_ms"] == pytest.approx(20.0 + 8192 * 131072 / 3.25e6, abs=0.01)
    assert report["configs"]["layerkv"]["link_gbps"] == 150.0  # no probes of its own


@pytest.mark.parametrize("name, transport, ucx_tls", [
    ("layerkv-nixl-tcp", "nixl", "tcp,cuda_copy,self"),
    ("nixl-tcp", "nixl", "tcp,cuda_copy,self"),
    ("layerkv-tcp", "tcp", None),
    ("layerkv", "cuda_ipc", None),
])
def test_probe_around_probes_the_configuration_s_transport_on_its_gpus(
        tmp_path, monkeypatch, name, transport, ucx_tls) -> None:
    config = ttft_bench.parse_config(name)
    args = argparse.Namespace(device="cuda", model="/m", dtype="bfloat16", kv_cache_dtype=None,
                              num_gpus=4, decode_first_gpu=2, out=tmp_path)
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["cmd"], seen["env"] = cmd, env
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({"results": [
            {"transport": transport, "ok": True, "gbps": 3.7, "ucx_tls": ucx_tls}]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ttft_bench.subprocess, "run", fake_run)
    case = ttft_bench.probe_link(config, args, "before")
    assert case["gbps"] == 3.7 and case["when"] == "before"
    cmd = seen["cmd"]
    assert cmd[cmd.index("--transports") + 1] == transport
    assert (cmd[cmd.index("--p-gpu") + 1], cmd[cmd.index("--d-gpu") + 1]) == ("0", "2")
    assert seen["env"].get("UCX_TLS") == ucx_tls
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize("name, settings", [
    ("layerkv-nixl-tcp-1w", {"LAYERKV_NIXL_NUM_THREADS": "0", "LAYERKV_WRITES_IN_FLIGHT": "2",
                             "LAYERKV_STAGING_BUFFERS": "2"}),
    ("layerkv-nixl-tcp-mt-deep", {"LAYERKV_NIXL_NUM_THREADS": "4",
                                  "LAYERKV_WRITES_IN_FLIGHT": "4"}),
    ("layerkv-nixl-tcp-serial", {"LAYERKV_WRITES_IN_FLIGHT": "1"}),
    ("layerkv-nixl-tcp-direct", {"LAYERKV_HOST_BOUNCE": "off"}),
    ("layerkv-nixl-tcp-gil", {"LAYERKV_GIL_SWITCH_INTERVAL_MS": "0.5"}),
])
def test_a_configuration_s_transport_settings_reach_its_link_probes(name, settings) -> None:
    """The link probe reads LayerKV's settings from its environment, so a configuration that
    changes the transport's path sets them there (P and D get the same environment)."""
    env = ttft_bench.config_env(ttft_bench.parse_config(name), "cuda")
    assert {k: env.get(k) for k in settings} == settings
    assert env["UCX_TLS"] == "tcp,cuda_copy,self"
    kv_extra = ttft_bench.LAYERKV_CONFIGS[name][0]
    assert set(kv_extra) == {"transport"}


def test_probe_around_on_cpu_is_refused_with_what_to_use_instead(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        ttft_bench.parse_args(["--device", "cpu", "--model", "/m", "--configs", "layerkv",
                               "--probe-around", "--out", str(tmp_path)])
    assert "use it with --device cuda" in capsys.readouterr().err


def test_a_failed_probe_is_recorded_with_its_error(tmp_path, monkeypatch) -> None:
    args = argparse.Namespace(device="cuda", model="/m", dtype=None, kv_cache_dtype=None,
                              num_gpus=2, decode_first_gpu=None, out=tmp_path)
    monkeypatch.setattr(ttft_bench.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "no GPU here"))
    case = ttft_bench.probe_link(ttft_bench.parse_config("layerkv-tcp"), args, "after")
    assert case == {"when": "after", "transport": "tcp", "error": "no GPU here"}


def test_engine_phases_are_the_means_over_the_requests_between_two_scrapes() -> None:
    def exposition(count: float, prefill_s: float, queue_s: float) -> str:
        return "\n".join([
            "# TYPE vllm:request_prefill_time_seconds histogram",
            f'vllm:request_prefill_time_seconds_sum{{model_name="m"}} {prefill_s}',
            f'vllm:request_prefill_time_seconds_count{{model_name="m"}} {count}',
            f'vllm:request_queue_time_seconds_sum{{model_name="m"}} {queue_s}',
            f'vllm:request_queue_time_seconds_count{{model_name="m"}} {count}'])

    before, after = exposition(3, 0.5, 0.01), exposition(7, 1.3, 0.05)
    assert ttft_bench.engine_phases(before, after) == {
        "requests": 4, "mean_queue_ms": 10.0, "mean_prefill_ms": 200.0}
    assert ttft_bench.engine_phases(after, after) == {"requests": 0}
    assert ttft_bench.engine_phases("", "") == {}  # not exposed, or /metrics not read


def test_no_ideal_without_a_single_instance_or_a_model_shape(tmp_path) -> None:
    summary, args = summary_for_ideal(tmp_path)
    del summary["results"]["single"]
    configs = [ttft_bench.parse_config("layerkv")]
    report = ttft_bench.ideal_report(summary["results"], configs, args)
    assert report["configs"]["layerkv"]["points"] == {}
    summary, args = summary_for_ideal(tmp_path / "again")
    args.model = str(tmp_path / "nowhere")
    report = ttft_bench.ideal_report(summary["results"], configs, args)
    assert report["kv_token_bytes"] is None and "no KV size per token" in report["note"]


# ----------------------------------------------------------------- configurations and layouts


def test_new_configuration_names_parse() -> None:
    paced = ttft_bench.parse_config("layerkv-tcp-10g")
    assert (paced.family, paced.pacing_gbps, paced.pd) == ("layerkv-tcp", 10.0, True)
    assert ttft_bench.parse_config("layerkv-tcp-2.5g").pacing_gbps == 2.5
    two = ttft_bench.parse_config("layerkv-router-2p-tp1-tp2")
    assert (two.family, two.prefills, two.p_tp, two.d_tp) == ("layerkv-router", 2, 1, 2)
    assert ttft_bench.parse_config("nixl-2p").prefills == 2
    agg = ttft_bench.parse_config("single-x2")
    assert (agg.family, agg.instances, agg.pd) == ("aggregated", 2, False)
    assert ttft_bench.parse_config("layerkv-tcp-auth").family == "layerkv-tcp-auth"
    for bad, why in [("layerkv-10g", "use it on layerkv-tcp"), ("nixl-tcp-10g", "layerkv-tcp"),
                     ("single-x1", "N >= 2"), ("single-2p", "unknown configuration"),
                     ("layerkv-0p", "at least one"), ("layerkv-unstaged", "TP suffix"),
                     ("layerkv-tcp-0g", "positive rate"), ("layerkv-tp0-tp1", "1 or more")]:
        with pytest.raises(SystemExit, match=why):
            ttft_bench.parse_config(bad)


def gpus_of(name: str, num_gpus: int = 4, decode_first: int | None = 2) -> list:
    return [(i.label, i.visible, i.shared) for i in ttft_bench.layout(
        ttft_bench.parse_config(name), num_gpus, decode_first)]


def test_four_gpu_layouts_put_d_on_gpus_of_its_own() -> None:
    """--decode-first-gpu 2 on four GPUs: the mismatched-TP layouts and the scale-out ones."""
    assert gpus_of("layerkv-tp2-tp1") == [("prefill", "0,1", False), ("decode", "2", False)]
    assert gpus_of("layerkv-tp1-tp2") == [("prefill", "0", False), ("decode", "2,3", False)]
    assert gpus_of("nixl-tp2-tp2") == [("prefill", "0,1", False), ("decode", "2,3", False)]
    assert gpus_of("layerkv-tp4-tp2") == [("prefill", "0,1,2,3", True), ("decode", "2,3", True)]
    assert gpus_of("layerkv-2p-tp1-tp2") == [("prefill", "0", False), ("prefill-1", "1", False),
                                             ("decode", "2,3", False)]
    assert gpus_of("layerkv-router-2p-tp1-tp2") == gpus_of("layerkv-2p-tp1-tp2")
    assert gpus_of("single-x4") == [("single", "0", False), ("single-1", "1", False),
                                    ("single-2", "2", False), ("single-3", "3", False)]
    assert gpus_of("single") == [("single", "0", False)]
    # without --decode-first-gpu: D after the prefill instances' GPUs, as before
    assert gpus_of("layerkv-tp1-tp2", decode_first=None) == [("prefill", "0", False),
                                                            ("decode", "1,2", False)]
    assert gpus_of("layerkv-2p-tp1-tp2", decode_first=None)[-1] == ("decode", "2,3", False)
    assert gpus_of("layerkv", 2, None) == [("prefill", "0", False), ("decode", "1", False)]
    assert gpus_of("layerkv", 1, None) == [("prefill", "0", True), ("decode", "0", True)]


def test_layouts_the_machine_cannot_hold_are_refused() -> None:
    for name, gpus, first, why in [
            ("single-x4", 2, None, "4 instances need 4 GPUs"),
            ("layerkv-3p-tp1-tp1", 2, None, "3 prefill instances of TP 1 need 3 GPUs"),
            ("layerkv-tp1-tp2", 4, 3, "--decode-first-gpu 3"),
            ("layerkv-tp4-tp2", 2, None, "TP 4 needs 4 GPUs")]:
        with pytest.raises(SystemExit, match=why):
            ttft_bench.layout(ttft_bench.parse_config(name), gpus, first)


def test_cpu_binds_of_several_instances() -> None:
    assert ttft_bench.cpu_bind("single", 1) == "0-1"
    assert [ttft_bench.cpu_bind("single", 1, i, 2) for i in range(2)] == ["0", "1"]
    assert [ttft_bench.cpu_bind("prefill", 1, i, 2) for i in range(2)] == ["0", "1"]
    assert ttft_bench.cpu_bind("decode", 2) == "0|1"


def test_pacing_auth_and_flags_reach_the_servers(tmp_path) -> None:
    args = deploy_args(vllm_args="--block-size 32", tp_vllm_args="--disable-custom-all-reduce")
    paced = ttft_bench.deploy(ttft_bench.parse_config("layerkv-tcp-10g-tp2-tp1"), args, tmp_path)
    p, d = paced.servers
    for s in (p, d):
        extra = s.kv_transfer_config["kv_connector_extra_config"]
        assert extra["tcp_pacing_gbps"] == 10.0 and extra["transport"] == "tcp"
        assert "--block-size" in s.command()
    assert p.command()[-1] == "--disable-custom-all-reduce"  # P has TP2
    assert "--disable-custom-all-reduce" not in d.command()  # D has TP1
    auth = ttft_bench.deploy(ttft_bench.parse_config("layerkv-auth"),
                             deploy_args(dtype="float32"), tmp_path)
    secrets_seen = {s.extra_env["LAYERKV_AUTH_SECRET"] for s in auth.servers}
    assert len(secrets_seen) == 1 and len(secrets_seen.pop()) >= 32
    plain = ttft_bench.deploy(ttft_bench.parse_config("layerkv"), deploy_args(), tmp_path)
    assert not any("LAYERKV_AUTH_SECRET" in s.extra_env for s in plain.servers)
    described = json.dumps(auth.describe("cpu"))  # what the log and summary.json keep
    assert ttft_bench.AUTH_SECRET not in described and "--kv-transfer-config" in described


def test_the_aggregated_baseline_is_vllm_router_round_robin_over_single_instances(
        tmp_path) -> None:
    deployed = ttft_bench.deploy(ttft_bench.parse_config("single-x2"), deploy_args(), tmp_path)
    a, b = deployed.servers
    assert (a.cpu_bind, b.cpu_bind) == ("0", "1") and a.kv_transfer_config is None
    cmd = deployed.proxy_cmd
    assert cmd is not None and cmd[0].endswith("vllm-router")
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == [a.url, b.url]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert "--vllm-pd-disaggregation" not in cmd and "--port" not in cmd
    assert deployed.roles == ["single", "single"]
    assert [s.log_path.name for s in deployed.servers] == ["single.log", "single-1.log"]


def test_several_prefill_instances_behind_the_proxy_and_the_router(tmp_path) -> None:
    proxied = ttft_bench.deploy(ttft_bench.parse_config("layerkv-2p-tp1-tp2"),
                                deploy_args(trace=True), tmp_path)
    p0, p1, d = proxied.servers
    cmd = proxied.proxy_cmd
    assert cmd[cmd.index("--prefill") + 1:cmd.index("--decode")] == [p0.url, p1.url]
    assert proxied.roles == ["prefill", "prefill", "decode"]
    extra = [s.kv_transfer_config["kv_connector_extra_config"] for s in proxied.servers]
    assert "trace_path" in extra[0] and "trace_path" not in extra[1] and "trace_path" in extra[2]
    routed = ttft_bench.deploy(ttft_bench.parse_config("layerkv-router-2p-tp1-tp2"),
                               deploy_args(), tmp_path)
    p0, p1, d = routed.servers
    cmd = routed.proxy_cmd
    ports = [s.kv_transfer_config["kv_connector_extra_config"]["bootstrap_port"]
             for s in (p0, p1)]
    assert ports[0] != ports[1]
    assert cmd[cmd.index("--prefill") + 1:cmd.index("--decode")] == [
        p0.url, str(ports[0]), "--prefill", p1.url, str(ports[1])]


def test_gpu_placement_reaches_each_server(tmp_path) -> None:
    args = deploy_args(device="cuda", num_gpus=4, decode_first_gpu=2, dtype="bfloat16")
    shared = ttft_bench.deploy(ttft_bench.parse_config("layerkv-tp4-tp2"), args, tmp_path)
    p, d = shared.servers
    assert (p.gpus, d.gpus) == ("0,1,2,3", "2,3")
    for s in (p, d):  # sharing GPUs 2-3: each takes half
        cmd = s.command()
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.425"
    own = ttft_bench.deploy(ttft_bench.parse_config("nixl-tp1-tp2"), args, tmp_path)
    p, d = own.servers
    assert (p.gpus, d.gpus) == ("0", "2,3")
    assert d.command()[d.command().index("--gpu-memory-utilization") + 1] == "0.850"
    described = own.describe("cuda")
    assert [(x["instance"], x["gpus"], x["shared"]) for x in described] == [
        ("prefill", "0", False), ("decode", "2,3", False)]


def test_a_single_instance_of_tp_n_runs_on_the_first_n_gpus(tmp_path) -> None:
    single_tp2 = ttft_bench.parse_config("single-tp2")
    assert (single_tp2.family, single_tp2.p_tp, single_tp2.pd) == ("single", 2, False)
    assert gpus_of("single-tp2") == [("single", "0,1", False)]
    with pytest.raises(SystemExit, match="TP 4 needs 4 GPUs"):
        ttft_bench.layout(ttft_bench.parse_config("single-tp4"), 2)
    args = deploy_args(device="cuda", num_gpus=4, dtype="bfloat16")
    (server,) = ttft_bench.deploy(single_tp2, args, tmp_path).servers
    cmd = server.command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


def test_the_benchmark_s_gpus_are_those_visible_to_it(monkeypatch) -> None:
    """Two runs share a four-GPU host: the one started with CUDA_VISIBLE_DEVICES=2,3 places its
    GPU 0 on the host's GPU 2."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus_of("layerkv", 2, None) == [("prefill", "2", False), ("decode", "3", False)]
    assert gpus_of("single-x2", 2, None) == [("single", "2", False), ("single-1", "3", False)]
    with pytest.raises(SystemExit, match="CUDA_VISIBLE_DEVICES=2,3 lists 2"):
        gpus_of("layerkv-tp2-tp2", 4, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpus_of("layerkv", 2, None) == [("prefill", "0", False), ("decode", "1", False)]


def test_each_decode_is_compared_with_a_single_instance_of_its_own_tp(
        tmp_path, monkeypatch) -> None:
    """A TP2 decode sums in another order than one GPU: with single-tp2 in the run, the D TP2
    configurations are compared with it and the D TP1 ones with single; the references stay
    on disk for a later run without those single instances."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    answers: dict[str, list[list[int]]] = {}
    monkeypatch.setattr(ttft_bench, "greedy_ids", lambda url, prompts, n: answers[url])
    names = ["single", "single-tp2", "layerkv-tp2-tp1", "layerkv-tp1-tp2"]
    args = argparse.Namespace(model=str(model), max_model_len=4096, configs=names)
    ref = tmp_path / "identity_single.json"
    check = ttft_bench.IdentityCheck(2, args, ref)
    answers.update({"single": [[1], [2]], "single-tp2": [[1], [3]],
                    "layerkv-tp2-tp1": [[1], [2]], "layerkv-tp1-tp2": [[1], [3]]})
    assert all(check.check(ttft_bench.parse_config(n), n) for n in names)
    assert check.results == {"prompts": 2, "single_vs_single": 2, "single-tp2_vs_single-tp2": 2,
                             "layerkv-tp2-tp1_vs_single": 2, "layerkv-tp1-tp2_vs_single-tp2": 2}
    assert ref.exists() and (tmp_path / "identity_single-tp2.json").exists()
    later = ttft_bench.IdentityCheck(
        2, argparse.Namespace(model=str(model), max_model_len=4096, configs=["layerkv-tp2-tp2"]),
        ref)
    answers["layerkv-tp2-tp2"] = [[1], [2]]  # matches the TP1 reference, not TP2's
    assert not later.check(ttft_bench.parse_config("layerkv-tp2-tp2"), "layerkv-tp2-tp2")
    assert later.results["layerkv-tp2-tp2_vs_single-tp2"] == 1


def test_an_open_loop_point_has_a_rate_and_no_concurrency_cap(tmp_path) -> None:
    calls = []

    class Runner:
        def run(self, argv, stdout_path, timeout):
            calls.append(argv)
            out = Path(argv[argv.index("--result-dir") + 1])
            (out / argv[argv.index("--result-filename") + 1]).write_text("{}")

    args = argparse.Namespace(tokenizer=None, model="m", bench_timeout=60)
    ttft_bench.bench(Runner(), "http://x", args, tmp_path, "a", 64, 8, 10, None,
                     request_rate=2.5, seed=7)
    ttft_bench.bench(Runner(), "http://x", args, tmp_path, "b", 64, 1, 10, None,
                     request_rate=float("inf"))
    rate, burst = calls
    assert "--max-concurrency" not in rate and "--max-concurrency" not in burst
    assert rate[rate.index("--request-rate") + 1] == "2.5"
    assert rate[rate.index("--burstiness") + 1] == "1.0"  # Poisson arrivals
    assert rate[rate.index("--seed") + 1] == "7"
    assert burst[burst.index("--request-rate") + 1] == "inf"
    seeds = {ttft_bench.open_loop_seed(p, 4096, 128) for p in ("rate0.5x", "rate0.5x:warm-up",
                                                                 "rate0.7x", "capacity")}
    assert len(seeds) == 4 and all(0 <= s < 2**32 for s in seeds)


class RateRunner:
    """Stands in for BenchServe: answers every point with per-request data, and records each
    point's tag and argv."""

    def __init__(self) -> None:
        self.points: dict[str, list[str]] = {}

    def run(self, argv, stdout_path, timeout):
        tag = argv[argv.index("--result-filename") + 1][:-len(".json")]
        self.points[tag] = argv
        n = int(argv[argv.index("--num-prompts") + 1])
        out_len = int(argv[argv.index("--random-output-len") + 1])
        result = {"median_ttft_ms": 30.0, "completed": n, "failed": 0, "duration": n / 4.0,
                  "ttfts": [0.03] * n, "latencies": [0.03 + 0.01 * (out_len - 1)] * n,
                  "output_lens": [out_len] * n, "errors": [""] * n,
                  "start_times": [i / 4.0 for i in range(n)]}
        out = Path(argv[argv.index("--result-dir") + 1])
        (out / f"{tag}.json").write_text(json.dumps(result))


def rate_args(tmp_path: Path, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{
        "tokenizer": None, "model": "m", "bench_timeout": 60, "prompt_lens": [64],
        "output_len": 8, "num_prompts": 2, "max_model_len": 2048, "load": [], "load_repeats": 1,
        "out": tmp_path, "identity": 0, "rates": open_loop.parse_rates("0.5x,3"),
        "rate_shape": (128, 6, 8), "rate_warmup": 2, "capacity_prompts": 4,
        "slo_ttft_ms": 1000.0, "slo_tpot_ms": 25.0, **changes})


def test_single_measures_capacity_then_every_rate_with_a_warm_up_of_its_own(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft_bench, "cold_start", lambda *a: {"cold_ttft_ms": 1.0,
                                                              "warm_ttft_ms": 1.0})
    warmed = []
    monkeypatch.setattr(ttft_bench, "warm_up",
                        lambda url, model, lengths, rounds: warmed.append((lengths, rounds)))
    args = rate_args(tmp_path)
    identity = ttft_bench.IdentityCheck(0, args, tmp_path / "ref.json")
    capacity: dict = {}
    runner = RateRunner()
    res: dict = {}
    ttft_bench.measure(ttft_bench.parse_config("single"), "http://x", None, args, runner,
                       identity, res, lambda: None, capacity=capacity)
    assert warmed == [([64, 128], 1)]  # the rate points' length too
    assert list(runner.points) == [
        "single_c1_in64", "single_overhead_in16", "single_capacity_in128",
        "single_rate0.5x_in128_out6_warmup", "single_rate0.5x_in128_out6",
        "single_rate3rps_in128_out6_warmup", "single_rate3rps_in128_out6"]
    burst = runner.points["single_capacity_in128"]
    assert burst[burst.index("--random-output-len") + 1] == "1"
    assert burst[burst.index("--num-prompts") + 1] == "4"
    assert capacity["requests_per_s"] == 4.0 and capacity["prefill_tokens_per_s"] == 512
    warm = runner.points["single_rate0.5x_in128_out6_warmup"]
    assert warm[warm.index("--num-prompts") + 1] == "2"
    assert warm[warm.index("--seed") + 1] != runner.points["single_rate0.5x_in128_out6"][
        warm.index("--seed") + 1]
    point = res["rate0.5x_in128_out6"]
    assert point["request_rate"] == 2.0  # 0.5 x 4 requests/s
    assert point["goodput"] == 4.0 and point["good"] == 8  # TPOT 10 ms, TTFT 30 ms
    assert res["rate3rps_in128_out6"]["request_rate"] == 3.0
    assert res["overhead"] == {"prompt_len": 16, "median_ttft_ms": 30.0}
    # a P/D configuration after it: the same absolute rates, no capacity burst, no overhead
    runner = RateRunner()
    res = {}
    ttft_bench.measure(ttft_bench.parse_config("layerkv-2p"), "http://x", None, args, runner,
                       identity, res, lambda: None, capacity=capacity)
    assert warmed[-1] == ([64, 128], 2)  # each prefill instance warmed
    assert "layerkv-2p_capacity_in128" not in runner.points and "overhead" not in res
    argv = runner.points["layerkv-2p_rate0.5x_in128_out6"]
    assert argv[argv.index("--request-rate") + 1] == "2"


def test_fractional_rates_need_the_single_instance_which_then_runs_first(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    ran = []

    def run_config(config, args, runner, identity, res, save, capacity):
        ran.append(config.name)
        return True

    monkeypatch.setattr(ttft_bench, "BenchServe", NoWorker)
    monkeypatch.setattr(ttft_bench, "run_config", run_config)
    base = ["ttft_bench.py", "--device", "cpu", "--model", "m", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", [*base, "--configs", "layerkv", "--rates", "0.7x"])
    with pytest.raises(SystemExit, match="add 'single' to --configs"):
        ttft_bench.main()
    monkeypatch.setattr(sys, "argv", [*base, "--configs", "layerkv", "single-x2", "single",
                                      "--rates", "0.5x,0.9x", "2"])
    assert ttft_bench.main() == 0
    assert ran == ["single", "layerkv", "single-x2"]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["rate_points"]["rates"] == ["0.5x", "0.9x", "2rps"]
    ran.clear()  # a capacity given: the order stays
    monkeypatch.setattr(sys, "argv", [*base, "--configs", "layerkv", "single", "--rates",
                                      "0.5x", "--capacity", "8"])
    assert ttft_bench.main() == 0 and ran == ["layerkv", "single"]


def test_counters_of_several_prefill_instances_add_up_with_bytes_per_request() -> None:
    one = "\n".join(['vllm:layerkv_groups_sent_total{engine="0"} 40.0',
                     'vllm:layerkv_transfers_sent_total{engine="0"} 8.0',
                     'vllm:layerkv_bytes_sent_total{engine="0"} 8000.0'])
    both = ttft_bench.one_or_all([FakePrefill(one), FakePrefill(one)])
    counters = ttft_bench.transfer_counters(both, p_tp=1)
    assert counters["requests"] == 16 and counters["bytes_per_request"] == 1000
    single = ttft_bench.one_or_all([FakePrefill(one)])
    assert isinstance(single, FakePrefill)


def test_a_consumer_configuration_is_one_instance_with_the_connector_in_d_s_role(
        tmp_path) -> None:
    for connector, name in (("layerkv", "LayerKV"), ("nixl", "NixlConnector")):
        config = ttft_bench.parse_config(f"consumer-{connector}")
        assert (config.family, config.connector, config.pd) == ("consumer", connector, False)
        assert gpus_of(f"consumer-{connector}") == [("decode", "0", False)]
        deployed = ttft_bench.deploy(config, deploy_args(), tmp_path)
        (server,) = deployed.servers
        assert deployed.proxy_cmd is None and deployed.roles == ["decode"]
        kv = server.kv_transfer_config
        assert (kv["kv_connector"], kv["kv_role"]) == (name, "kv_consumer")
        assert server.log_path.name == "decode.log"
    with pytest.raises(SystemExit, match="one of nixl, layerkv"):
        ttft_bench.parse_config("consumer-mooncake")


class ScrapedDecoder:
    """Stands in for D: each /metrics scrape shows 100 more tokens over 10 more steps, at
    20 ms per token."""

    def __init__(self) -> None:
        self.scrapes = 0

    def metrics(self) -> str:
        self.scrapes += 1
        return decode_metrics(2.0 * self.scrapes, 100 * self.scrapes, 10 * self.scrapes)


def test_each_rate_point_records_the_decode_instance_s_own_itl(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ttft_bench, "cold_start", lambda *a: {"cold_ttft_ms": 1.0,
                                                              "warm_ttft_ms": 1.0})
    monkeypatch.setattr(ttft_bench, "warm_up", lambda *a: None)
    args = rate_args(tmp_path, rates=open_loop.parse_rates("3"))
    identity = ttft_bench.IdentityCheck(0, args, tmp_path / "ref.json")
    decoder = ScrapedDecoder()
    res: dict = {}
    ttft_bench.measure(ttft_bench.parse_config("layerkv"), "http://x", decoder, args,
                       RateRunner(), identity, res, lambda: None, capacity={})
    point = res["rate3rps_in128_out6"]
    assert point["decode_server"] == {"mean_itl_ms": 20.0, "itl_tokens": 100,
                                      "engine_steps": 10}
    assert decoder.scrapes == 2  # once before the measured run, once after; not the warm-up
    assert "cpu" in point


def test_starts_run_the_configurations_in_turn_and_report_the_median_over_starts(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--starts 3``: single, layerkv, single, layerkv, ...; later starts measure the c=1
    points only, into OUT/start<k>/; the report is each start's median and their median."""
    import sys

    ran = []
    medians = {"single": [100.0, 120.0, 110.0], "layerkv": [115.0, 114.0, 116.0]}

    def run_config(config, args, runner, identity, res, save, capacity):
        ran.append((config.name, args.out.name, args.identity, list(args.load)))
        start = sum(name == config.name for name, *_ in ran)
        res["c1_in4096"] = {"median_ttft_ms": medians[config.name][start - 1]}
        return True

    monkeypatch.setattr(ttft_bench, "BenchServe", NoWorker)
    monkeypatch.setattr(ttft_bench, "run_config", run_config)
    out = tmp_path / "o"
    monkeypatch.setattr(sys, "argv", [
        "ttft_bench.py", "--device", "cpu", "--model", "m", "--out", str(out), "--configs",
        "single", "layerkv", "--prompt-lens", "4096", "--load", "2:64:4:4", "--starts", "3"])
    assert ttft_bench.main() == 0
    assert ran == [("single", "o", 0, [(2, 64, 4, 4)]), ("layerkv", "o", 0, [(2, 64, 4, 4)]),
                   ("single", "start2", 0, []), ("layerkv", "start2", 0, []),
                   ("single", "start3", 0, []), ("layerkv", "start3", 0, [])]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["single"]["c1_in4096"]["median_ttft_ms"] == 100.0  # first start
    assert summary["starts"]["3"]["layerkv"]["c1_in4096"]["median_ttft_ms"] == 116.0
    over = summary["c1_over_starts"]
    assert over["single"]["4096"] == {"medians": [100.0, 120.0, 110.0], "median_ttft_ms": 110.0}
    assert over["layerkv"]["4096"] == {"medians": [115.0, 114.0, 116.0], "median_ttft_ms": 115.0,
                                       "ratio_to_single": 1.045}
    with pytest.raises(SystemExit):
        ttft_bench.parse_args(["--model", "m", "--out", str(out), "--starts", "0"])


def test_with_probe_around_every_start_has_its_own_ideal_and_the_median_ratio_is_reported(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--starts 3 --probe-around``: each start probes the link around each P/D configuration
    into its own folder, gets its ideal TTFT from its own single instance and probes, and the
    report over the starts holds each start's ratio to its ideal and their median."""
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(ttft_bench.link_probe.LLAMA_8B))
    token_bytes = 131072
    rates = {"2": (2.0, 2.0), "3": (4.0, 4.0)}  # GB/s before / after, per start; start 1: 3.0
    layerkv_ttft = [400.0, 560.0, 300.0]
    probed: list[tuple[str, str]] = []

    def probe_link(config, args, when):
        start = args.out.name.removeprefix("start") if args.out.name != "o" else "1"
        probed.append((start, when))
        gbps = rates.get(start, (3.0, 3.0))[when == "after"]
        return {"transport": "tcp", "ok": True, "gbps": gbps, "when": when}

    def run_config(config, args, runner, identity, res, save, capacity):
        start = 1 if args.out.name == "o" else int(args.out.name.removeprefix("start"))
        if config.name == "single":
            res["c1_in8192"] = {"median_ttft_ms": 250.0}
            res["overhead"] = {"prompt_len": 16, "median_ttft_ms": 20.0}
        else:
            res["c1_in8192"] = {"median_ttft_ms": layerkv_ttft[start - 1]}
            res["transport_used"] = "tcp"
        return True

    monkeypatch.setattr(ttft_bench, "BenchServe", NoWorker)
    monkeypatch.setattr(ttft_bench, "run_config", run_config)
    monkeypatch.setattr(ttft_bench, "probe_link", probe_link)
    out = tmp_path / "o"
    monkeypatch.setattr(sys, "argv", [
        "ttft_bench.py", "--device", "cuda", "--model", str(model), "--out", str(out),
        "--configs", "single", "layerkv-tcp", "--prompt-lens", "8192", "--starts", "3",
        "--probe-around", "--num-gpus", "2"])
    assert ttft_bench.main() == 0
    assert probed == [(s, w) for s in "123" for w in ("before", "after")]
    summary = json.loads((out / "summary.json").read_text())
    ideals = [20.0 + 8192 * token_bytes / (gbps * 1e6) for gbps in (3.0, 2.0, 4.0)]
    ratios = [round(t / i, 3) for t, i in zip(layerkv_ttft, ideals)]
    assert summary["ideal"]["configs"]["layerkv-tcp"]["points"]["8192"]["ratio"] == ratios[0]
    assert summary["ideal_starts"]["3"]["configs"]["layerkv-tcp"]["link_gbps"] == 4.0
    point = summary["c1_over_starts"]["layerkv-tcp"]["8192"]
    assert point["ideal_ratios"] == ratios
    assert point["median_ideal_ratio"] == round(sorted(ratios)[1], 3)
