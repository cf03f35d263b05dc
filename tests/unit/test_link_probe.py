"""benchmarks/link_probe.py (the rate of a transport's exact path, between two processes) and
benchmarks/plot_link_rates.py (TTFT against link rate, with the ideal)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import BENCHMARKS, load

link_probe = load("link_probe")
plot_link_rates = load("plot_link_rates")
ROOT = BENCHMARKS.parent
GPU_MODELS = BENCHMARKS / "gpu_models"
TINY = {"num_hidden_layers": 8, "num_key_value_heads": 2, "num_attention_heads": 4,
        "hidden_size": 256, "head_dim": 64}
"""The KV shape of the tests' tiny Llama: 8 KiB per token in float32."""


def test_kv_bytes_per_token_of_attention_mla_and_fp8() -> None:
    llama = link_probe.LLAMA_8B  # 32 layers x (K, V) x 8 heads x 128 x bfloat16
    assert link_probe.kv_token_bytes(llama, "bfloat16") == 131072
    assert link_probe.kv_token_bytes(llama, "bfloat16", "fp8_e4m3") == 65536
    assert link_probe.kv_token_bytes(TINY, "float32") == 8 * 2 * 2 * 64 * 4
    no_head_dim = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert link_probe.kv_geometry(no_head_dim) == (2, 2 * 4 * 64)  # MHA, hidden / heads
    mla = json.loads((GPU_MODELS / "deepseek-v2-lite" / "config.json").read_text())
    assert link_probe.kv_geometry(mla) == (27, 512 + 64)  # one latent per token and layer
    hybrid = json.loads((GPU_MODELS / "nemotronh8b" / "config.json").read_text())
    with pytest.raises(ValueError, match="hybrid"):
        link_probe.kv_geometry(hybrid)
    with pytest.raises(ValueError, match="use one of"):
        link_probe.dtype_bytes("int3")


def test_a_probe_rate_is_found_by_transport_and_for_nixl_by_ucx_tls(tmp_path: Path) -> None:
    f1, f2 = tmp_path / "a.json", tmp_path / "b.json"
    f1.write_text(json.dumps({"results": [
        {"transport": "tcp", "ok": True, "gbps": 3.0, "ucx_tls": "tcp,cuda_copy,self"},
        {"transport": "nixl", "ok": False, "error": "not installed", "ucx_tls": None}]}))
    f2.write_text(json.dumps({"results": [
        {"transport": "nixl", "ok": True, "gbps": 2.2, "ucx_tls": "tcp,cuda_copy,self"}]}))
    cases = link_probe.load_results([f1, f2])
    assert link_probe.probe_gbps(cases, "tcp", None) == 3.0  # TCP does not use UCX
    assert link_probe.probe_gbps(cases, "nixl", None) is None  # failed: no rate
    assert link_probe.probe_gbps(cases, "nixl", "tcp,cuda_copy,self") == 2.2
    assert link_probe.probe_gbps(cases, "cuda_ipc", None) is None


def test_the_probe_measures_layerkv_s_tcp_path_between_two_processes(tmp_path: Path) -> None:
    """On CPU, with the TCP transport paced to 0.4 Gb/s through the environment (as an
    instance reads its settings): the probe's rate is the pacing's, the bytes D checked are
    P's, and a transport that cannot run here is recorded with the reason."""
    out = tmp_path / "probe.json"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    env = {**os.environ, "LAYERKV_TCP_PACING_GBPS": "0.4"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), "--device", "cpu",
                        "--model", str(model), "--tokens", "2048", "--repeats", "2",
                        "--transports", "tcp", "cuda_ipc", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    assert record["command"].endswith(f"--out {out}")
    tcp, ipc = record["results"]
    assert tcp["ok"] and tcp["used"] == "tcp" and not tcp["direct"], tcp
    assert tcp["streams"] == 4  # tcp_streams' default: the pacing covers all four
    assert tcp["checked"] == {"finished": 3, "failed": [], "mismatched": 0}
    assert tcp["nbytes"] == 2048 * link_probe.kv_token_bytes(TINY, "float32")
    # 0.05 GB/s paced; the acknowledgement's round trip makes it come out a little under
    assert 0.8 * 0.05 < tcp["gbps"] <= 1.02 * 0.05, tcp
    assert not ipc["ok"] and "--device cuda" in ipc["error"]
    assert "[probe] tcp (tcp, 4 TCP streams, UCX_TLS=-)" in r.stdout


def test_busy_threads_hold_the_gil_in_both_peers_while_the_bytes_still_arrive(
        tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), "--device", "cpu",
                        "--model", str(model), "--tokens", "512", "--repeats", "2",
                        "--transports", "tcp", "--busy-threads", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    assert record["spec"]["busy_threads"] == 1
    (tcp,) = record["results"]
    assert tcp["ok"] and tcp["checked"] == {"finished": 3, "failed": [], "mismatched": 0}, tcp


def test_bad_probe_options_are_refused(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), "--device", "cpu",
                        "--tokens", "8", "--out", str(tmp_path / "p.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tokens must be >= 16" in r.stderr
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), "--device", "cpu",
                        "--busy-threads", "-1", "--out", str(tmp_path / "p.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--busy-threads >= 0" in r.stderr
    r = subprocess.run([sys.executable, str(BENCHMARKS / "link_probe.py"), "--device", "cpu",
                        "--model", str(GPU_MODELS / "nemotronh8b"), "--out",
                        str(tmp_path / "p.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "hybrid" in r.stderr


def link_summary() -> dict:
    """What ttft_bench.py writes for single, a paced LayerKV configuration and NixlConnector."""
    return {
        "results": {
            "single": {"c1_in8192": {"median_ttft_ms": 254.0},
                       "c1_in16000": {"median_ttft_ms": 544.0}},
            "layerkv-tcp-10g": {"c1_in8192": {"median_ttft_ms": 900.0},
                                "c1_in16000": {"median_ttft_ms": 1700.0}},
            "layerkv-tcp-100g": {"c1_in8192": {"median_ttft_ms": 260.0}},
            "nixl-tcp": {"c1_in8192": {"median_ttft_ms": 2472.0}},
            "layerkv-nixl-tcp": {"c1_in8192": {"median_ttft_ms": 421.9}}},
        "ideal": {"overhead_ms": 20.0, "kv_token_bytes": 131072, "configs": {
            "layerkv-tcp-10g": {"link": "tcp paced to 10 Gb/s", "link_gbps": 1.25},
            "layerkv-tcp-100g": {"link": "tcp paced to 100 Gb/s", "link_gbps": 12.5},
            "nixl-tcp": {"link": "nixl UCX_TLS=tcp,cuda_copy,self, probed", "link_gbps": 2.4},
            "layerkv-nixl-tcp": {"link": "nixl UCX_TLS=tcp,cuda_copy,self, probed",
                                 "link_gbps": 2.4},
            "layerkv": {"link": "cuda_ipc, not probed", "link_gbps": None}}}}


def test_link_rate_table_has_each_configuration_at_its_link_rate_with_the_ideal() -> None:
    table = plot_link_rates.collect([link_summary()], [8192, 16000])
    eight = table["8192"]
    assert eight["single_ttft_ms"] == 254.0 and eight["kv_bytes"] == 8192 * 131072
    paced = eight["configs"]["layerkv-tcp-10g"]
    assert paced["series"] == "layerkv-tcp (paced)" and paced["link_gbit_s"] == 10.0
    ideal = 20.0 + 8192 * 131072 / 1.25e9 * 1e3  # the link is slower than the prefill
    assert paced["ideal_ttft_ms"] == pytest.approx(ideal, abs=0.01)
    assert paced["ratio"] == pytest.approx(900.0 / ideal, abs=0.001)
    assert eight["configs"]["layerkv-tcp-100g"]["ideal_ttft_ms"] == 254.0  # hidden
    assert eight["configs"]["nixl-tcp"]["series"] == "nixl-tcp"
    assert "layerkv" not in eight["configs"]  # no known link rate
    assert list(table["16000"]["configs"]) == ["layerkv-tcp-10g"]
    md = plot_link_rates.markdown(table)
    assert "| 8192 | layerkv-tcp-10g | tcp paced to 10 Gb/s | 10 | 900.0 |" in md
    assert plot_link_rates.collect([link_summary()], [4096]) == {}


def test_plot_link_rates_writes_its_table_and_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(link_summary()))
    r = subprocess.run([sys.executable, str(BENCHMARKS / "plot_link_rates.py"), str(run),
                        "--out", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plots" / "link_rates.png").stat().st_size > 0
    else:  # the table is written all the same, and the output says why there is no plot
        assert "matplotlib is not installed" in r.stdout
    assert json.loads((tmp_path / "plots" / "link_rates.json").read_text()).keys() == {
        "8192", "16000"}
