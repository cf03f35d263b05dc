"""One-off check, run from the repository root on a staged GPU machine: does the bench client's mode (fresh `vllm bench serve` process
per point, or the bench_serve worker) change the TTFT it measures? Same single instance,
alternating modes, a fresh random seed per point (no prefix-cache hits)."""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
from bench_serve import BenchServe
from vllm_layerkv.testing.servers import VllmServer, free_port, start_all, stop_all
import ttft_bench as tb

out = Path(os.environ["OUT"]) / "client_mode"; out.mkdir(parents=True, exist_ok=True)
model = os.path.expanduser("~/stage/core/models/llama8b")
s = VllmServer(model, free_port(), served_model_name="m", cpu_bind="", gpus="0",
               enforce_eager=False, extra_args=["--seed", "0", "--gpu-memory-utilization", "0.85",
               "--load-format", "dummy"], log_path=out / "single.log", dtype="bfloat16",
               max_model_len=17000, max_num_seqs=64)
runner = BenchServe(out / "worker.log"); runner.start()
start_all([s], timeout=400)
tb.warm_up(s.url, model, [1024, 4096])
rows = []
try:
    for rep in range(3):
        for mode in ("worker", "cli"):
            for n in (1024, 4096):
                seed = 5000 + rep * 10 + (mode == "cli") * 5 + (n == 4096)
                tag = f"{mode}_r{rep}_in{n}"
                argv = ["--backend", "vllm", "--base-url", s.url, "--endpoint", "/v1/completions",
                        "--model", "m", "--tokenizer", model, "--dataset-name", "random",
                        "--random-input-len", str(n), "--random-output-len", "8", "--num-prompts", "5",
                        "--max-concurrency", "1", "--ignore-eos", "--seed", str(seed),
                        "--ready-check-timeout-sec", "0", "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out),
                        "--result-filename", tag + ".json"]
                t0 = time.monotonic()
                if mode == "worker":
                    runner.run(argv, out / f"{tag}.stdout", 300)
                else:
                    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv],
                                       capture_output=True, text=True, timeout=300)
                    (out / f"{tag}.stdout").write_text(r.stdout[-5000:] + r.stderr[-5000:])
                d = json.loads((out / f"{tag}.json").read_text())
                row = {"mode": mode, "rep": rep, "len": n, "median": round(d["median_ttft_ms"], 1),
                       "mean": round(d["mean_ttft_ms"], 1), "p90": round(d["p90_ttft_ms"], 1),
                       "wall_s": round(time.monotonic() - t0, 1)}
                rows.append(row); print(row, flush=True)
finally:
    runner.close(); stop_all([s])
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
