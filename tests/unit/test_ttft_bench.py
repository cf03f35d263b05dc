"""benchmarks/ttft_bench.py: the pieces that do not need a server."""

from __future__ import annotations

import argparse
import json
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

    class NoWorker:
        def __init__(self, *args) -> None:
            pass

        def start(self) -> None:
            pass

        def close(self) -> None:
            pass

    def bring_up(deployment, config, args):
        if config.name == "single":
            raise ServerError("single exited with rc=1 during start-up")
        return "http://127.0.0.1:1", []

    def measure(config, url, decoder, args, runner, identity, res, save, groups):
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
        "trace": False, "kv_cache_dtype": None, **changes})


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
                              output_len=8, num_prompts=1, max_model_len=2048, load=[(2, 16, 3, 2)], load_repeats=3,
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
