"""benchmarks/gpu_bench.sh: a benchmark stopped by its own deadline (BENCH_TIMEOUT) still gets
its results packed, so a run that hits its time limit still keeps what it measured, and the
servers it left behind are stopped, but no one else's. Runs the script with stand-ins for
nvidia-smi and python3 (a benchmark that starts a "server" in a session of its own, as vLLM
servers are started, and never ends). Also: MODEL is required, the extra vLLM flags and the
command file, and the sweeps (sweep_slow_links.sh, sweep_four_gpus.sh,
sweep_decode_graphs.sh, sweep_reads_default.sh): their commands, checked against
ttft_bench.py's parser and layouts, and their time limit."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from benchmark_scripts import load

ROOT = Path(__file__).resolve().parents[2]
# a process whose command line looks like a vLLM server's to pgrep -f
SERVER = "bash -c 'exec -a \"python3 -m vllm.entrypoints.cli.main serve stand-in\" sleep 600'"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone too
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def write_scripts(bin_dir: Path, scripts: dict[str, str]) -> None:
    """Stand-in executables: each ``name`` a bash script running ``body``."""
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model directory as MODEL names one: a config.json and tokenizer files."""
    path = tmp_path / "llama8b"
    path.mkdir()
    (path / "config.json").write_text('{"num_hidden_layers": 32}')
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # the benchmark: leaves a partial result and a server, then runs until it is stopped
        "python3": 'echo partial > "$OUT/$RUN/summary.json"\n'
                   f'setsid {SERVER} > /dev/null 2>&1 &\n'
                   'echo $! > "$OUT/server.pid"\n'
                   'exec sleep 600',
    }
    write_scripts(bin_dir, scripts)
    return bin_dir


def test_a_benchmark_past_its_deadline_is_stopped_and_still_packed(tmp_path: Path,
                                                                     fake_bin: Path,
                                                                     model: Path) -> None:
    out, bench = tmp_path / "out", tmp_path / "bench"
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(out),
           "BENCH": str(bench), "RUN": "r1", "BENCH_TIMEOUT": "2", "MODEL": str(model)}
    # someone else's server on the same machine (another run, a test cluster)
    outsider = subprocess.Popen(["bash", "-c", SERVER.split(" ", 2)[2].strip("'")],
                                start_new_session=True)
    try:
        started = time.monotonic()
        r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "single", "--", "--prompt-lens",
                            "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert time.monotonic() - started < 30, "the deadline did not stop the benchmark"
        deadline = time.monotonic() + 5
        ours = int((out / "server.pid").read_text())
        while alive(ours) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ours), "the benchmark's server was left running"
        assert alive(outsider.pid), "the clean-up stopped a server it had not started"
    finally:
        outsider.kill()
        outsider.wait()
        if (out / "server.pid").exists():  # the benchmark's, if the clean-up failed to stop it
            try:
                os.kill(int((out / "server.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "ttft_bench exit 124" in r.stdout, r.stdout + r.stderr
    assert (out / "summary_r1.json").read_text() == "partial\n"
    with tarfile.open(out / "bench.tar.gz") as tar:
        assert "./r1/summary.json" in tar.getnames()


def test_pyspy_probes_sample_their_point_and_do_not_outlive_the_benchmark(tmp_path: Path,
                                                                         model: Path) -> None:
    """PYSPY + PYSPY_POINTS: a probe records over the point that ran (its output comes back in
    the run's folder); a probe whose point never ran is stopped when the benchmark ends instead
    of waiting its 10 minutes for it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # a stand-in D whose command line pyspy_probe.sh finds, with an engine child to sample
        "consumer": 'sleep 600 & wait',
        # the benchmark: names one point in bench.log while its D runs, then ends
        "python3": f'setsid bash {bin_dir}/consumer kv_consumer > /dev/null 2>&1 &\n'
                   'd=$!; sleep 1\n'
                   'echo "vllm bench serve --result-filename pt1.json" >> "$OUT/$RUN/bench.log"\n'
                   'sleep 3; kill -- -$d; echo done > "$OUT/$RUN/summary.json"',
        # py-spy: notes what it sampled, then runs until its process is gone
        "py-spy": 'while [ $# -gt 0 ]; do case $1 in -o) o=$2; shift;; --pid) p=$2; shift;; '
                  'esac; shift; done\n'
                  'echo "sampled $p" > "$o"\n'
                  'while kill -0 "$p" 2>/dev/null; do sleep 0.2; done',
    }
    write_scripts(bin_dir, scripts)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "BENCH": str(tmp_path / "bench"), "RUN": "r1", "MODEL": str(model),
           "PYSPY": str(bin_dir / "py-spy"), "PYSPY_POINTS": "pt1 pt2", "PYSPY_SECONDS": "30"}
    started = time.monotonic()
    r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "layerkv", "--"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 40, f"gpu_bench.sh waited {took:.0f} s for a probe whose point never ran"
    sampled = list((out / "r1" / "pyspy_pt1").glob("pyspy_consumer_*.gil.txt"))
    assert sampled and sampled[0].read_text().startswith("sampled "), r.stdout
    assert not list((out / "r1").glob("pyspy_pt2/*.txt"))
    left = subprocess.run(["pgrep", "-f", f"pyspy_probe.sh {bin_dir}"], capture_output=True,
                          text=True).stdout.split()
    assert not left, f"probes left running: {left}"


def recording_bin(tmp_path: Path, gpus: int = 2) -> Path:
    """Stand-ins that only record: python3 appends its arguments, one per line, then a
    separator, to $CALLS; nvidia-smi lists ``gpus`` GPUs."""
    bin_dir = tmp_path / "rbin"
    bin_dir.mkdir()
    listing = "; ".join(f'echo "GPU {i}: fake"' for i in range(gpus))
    scripts = {
        "nvidia-smi": f'if [ "$1" = -L ]; then {listing}; else echo "fake, 1 MiB"; fi',
        "python3": 'printf "%s\\n" "$@" >> "$CALLS"; echo "----" >> "$CALLS"',
    }
    write_scripts(bin_dir, scripts)
    return bin_dir


def calls(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [c.strip("\n").split("\n") for c in path.read_text().split("----\n") if c.strip()]


def test_model_is_required_and_must_hold_a_config(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MODEL"}
    env.update(OUT=str(tmp_path / "out"), BENCH=str(tmp_path / "bench"))
    for model in (None, str(tmp_path / "nowhere")):
        run_env = env if model is None else {**env, "MODEL": model}
        for script in ("gpu_bench.sh", "sweep_slow_links.sh", "sweep_four_gpus.sh",
                       "sweep_decode_graphs.sh", "sweep_reads_default.sh"):
            r = subprocess.run(["bash", f"benchmarks/{script}", "single", "--"], cwd=ROOT,
                               env=run_env, capture_output=True, text=True, timeout=30)
            assert r.returncode == 2, (script, r.stdout, r.stderr)
            assert "set MODEL to a model directory with Llama-3.1-8B's config.json" in r.stderr
    assert not (tmp_path / "bench").exists()  # nothing was started or written


def test_extra_vllm_flags_reach_ttft_bench_and_the_command_is_kept(tmp_path: Path,
                                                                    model: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{recording_bin(tmp_path)}:{os.environ['PATH']}",
           "OUT": str(out), "BENCH": str(tmp_path / "bench"), "RUN": "r1", "MODEL": str(model),
           "CALLS": str(tmp_path / "calls"), "VLLM_ARGS": "--block-size 32",
           "TP_VLLM_ARGS": "--enforce-eager --disable-custom-all-reduce"}
    r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "single", "layerkv-tp2-tp1", "--",
                        "--prompt-lens", "8192"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (argv,) = calls(tmp_path / "calls")
    assert argv[0] == "benchmarks/ttft_bench.py"
    assert "--vllm-args=--block-size 32" in argv
    assert "--tp-vllm-args=--enforce-eager --disable-custom-all-reduce" in argv
    args = load("ttft_bench").parse_args(argv[1:])
    assert args.num_gpus == 2 and args.model == str(model) and args.prompt_lens == [8192]
    assert args.tp_vllm_args == "--enforce-eager --disable-custom-all-reduce"
    kept = (out / "r1" / "command.txt").read_text()
    assert "--tp-vllm-args=--enforce-eager\\ --disable-custom-all-reduce" in kept
    assert kept.startswith("python3 benchmarks/ttft_bench.py --device cuda")


def test_model_config_is_served_with_model_s_tokenizer(tmp_path: Path, model: Path) -> None:
    bench = tmp_path / "bench"
    env = {**os.environ, "PATH": f"{recording_bin(tmp_path)}:{os.environ['PATH']}",
           "OUT": str(tmp_path / "out"), "BENCH": str(bench), "RUN": "r1", "MODEL": str(model),
           "CALLS": str(tmp_path / "calls"), "MODEL_CONFIG": "benchmarks/gpu_models/nemotronh8b"}
    r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "single", "--"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    built = bench / "models" / "nemotronh8b"
    assert sorted(p.name for p in built.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (built / "config.json").read_text() == (
        ROOT / "benchmarks" / "gpu_models" / "nemotronh8b" / "config.json").read_text()
    (argv,) = calls(tmp_path / "calls")
    assert argv[argv.index("--model") + 1] == str(built)


def sweep_commands(script: str, tmp_path: Path, model: Path,
                   **settings: str) -> list[list[str]]:
    out = tmp_path / script
    env = {**os.environ, "OUT": str(out), "MODEL": str(model), "DRY_RUN": "1", **settings}
    r = subprocess.run(["bash", f"benchmarks/{script}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (out / "commands.txt").read_text().splitlines()
    assert all(line.startswith("# ") for line in lines[::2])
    return [shlex.split(line) for line in lines[1::2]]


def bench_runs(commands: list[list[str]]) -> list[tuple[str, list[str], list[str]]]:
    """(RUN, configurations, ttft_bench.py options) of each gpu_bench.sh command."""
    runs = []
    for cmd in commands:
        if "benchmarks/gpu_bench.sh" not in cmd:
            continue
        env = dict(word.split("=", 1) for word in cmd[1:cmd.index("bash")])
        rest = cmd[cmd.index("benchmarks/gpu_bench.sh") + 1:]
        cut = rest.index("--")
        runs.append((env["RUN"], rest[:cut], rest[cut + 1:]))
    return runs


def check_runs(runs: list[tuple[str, list[str], list[str]]], model: Path, gpus: int) -> None:
    """Every configuration parses and fits the host, and every option is ttft_bench.py's."""
    ttft_bench = load("ttft_bench")
    for _, configs, options in runs:
        args = ttft_bench.parse_args(["--device", "cuda", "--model", str(model), "--configs",
                                      *configs, "--out", "/tmp/x", "--num-gpus", str(gpus),
                                      *options])
        for name in configs:
            ttft_bench.layout(ttft_bench.parse_config(name), gpus, args.decode_first_gpu)
        parsed = [ttft_bench.parse_config(c) for c in configs]
        assert ttft_bench.order_for_capacity(parsed, args) == parsed  # single already first


def test_the_slow_link_sweep_runs_the_probe_first_then_its_benchmarks_in_order(
        tmp_path: Path, model: Path) -> None:
    commands = sweep_commands("sweep_slow_links.sh", tmp_path, model)
    assert [c for c in commands[0] if c.endswith(".py")] == ["benchmarks/link_probe.py"]
    assert "UCX_TLS=tcp,cuda_copy,self" in commands[1]
    runs = bench_runs(commands)
    assert [(run, configs) for run, configs, _ in runs] == [
        ("02_c1_links", ["single", "layerkv-tcp", "layerkv-tcp-100g", "layerkv-tcp-50g",
                         "layerkv-tcp-25g", "layerkv-tcp-10g", "layerkv-nixl-tcp",
                         "nixl-tcp"]),
        ("03_c1_auth", ["layerkv", "layerkv-auth", "layerkv-tcp", "layerkv-tcp-auth"]),
        ("04_rates_cuda_ipc", ["single", "single-x2", "nixl", "layerkv", "layerkv-writes"]),
        ("04_rates_ucx_tcp", ["nixl-tcp", "layerkv-nixl-tcp"])]
    check_runs(runs, model, gpus=2)
    ucx = runs[3][2]
    assert ucx[ucx.index("--capacity-from") + 1].endswith("04_rates_cuda_ipc/summary.json")
    # NixlConnector over UCX tcp completes about 0.8 requests/s: short points
    assert ucx[ucx.index("--rate-shape") + 1] == "4096:128:30"
    assert ucx[ucx.index("--rate-warmup") + 1] == "5"
    c1 = runs[0][2]
    probes = c1[c1.index("--link-probe") + 1:]
    assert probes == [commands[0][commands[0].index("--out") + 1],
                      commands[1][commands[1].index("--out") + 1]]
    rates = runs[2][2]
    assert rates[rates.index("--rates") + 1] == "0.5x,0.7x,0.9x"
    assert [c for c in commands[-2] if c.endswith(".py")] == ["benchmarks/plot_link_rates.py"]


def test_the_four_gpu_sweep_places_d_on_gpus_2_and_3(tmp_path: Path, model: Path) -> None:
    commands = sweep_commands("sweep_four_gpus.sh", tmp_path, model)
    runs = bench_runs(commands)
    assert [run for run, _, _ in runs] == ["01_tp_layouts", "02_scale_out"]
    check_runs(runs, model, gpus=4)
    for cmd in commands[:2]:
        assert "TP_VLLM_ARGS=--disable-custom-all-reduce" in cmd
        assert cmd[cmd.index("--decode-first-gpu") + 1] == "2"
    tp, scale = runs
    # the references first: single for the TP1 decodes, single-tp2 for the TP2 ones
    assert tp[1][:5] == ["single", "single-tp2", "layerkv-tp2-tp1", "layerkv-tp1-tp2",
                         "layerkv-tp2-tp2"]
    assert {"nixl-tp2-tp1", "nixl-tp1-tp2", "nixl-tp2-tp2", "layerkv-tp4-tp2"} <= set(tp[1])
    assert scale[1] == ["single", "layerkv-2p-tp1-tp2", "layerkv-tp1-tp2", "single-x4",
                        "layerkv-router-2p-tp1-tp2", "layerkv-router-tp1-tp2"]


def test_a_sweep_short_of_time_skips_the_steps_that_do_not_fit(tmp_path: Path,
                                                               model: Path) -> None:
    """390 s: both probes and the plots fit, none of the benchmark runs does."""
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{recording_bin(tmp_path)}:{os.environ['PATH']}",
           "OUT": str(out), "MODEL": str(model), "CALLS": str(tmp_path / "calls"),
           "SWEEP_TIMEOUT": "390", "SWEEP_MARGIN": "0", "BENCH": str(tmp_path / "bench")}
    r = subprocess.run(["bash", "benchmarks/sweep_slow_links.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    scripts = [argv[0] for argv in calls(tmp_path / "calls")]
    assert scripts == ["benchmarks/link_probe.py", "benchmarks/link_probe.py",
                       "benchmarks/plot_link_rates.py", "benchmarks/plot_results.py"]
    log = (out / "sweep.log").read_text()
    for run in ("02_c1_links", "03_c1_auth", "04_rates_cuda_ipc", "04_rates_ucx_tcp"):
        assert f"{run}: skipped" in log
    ran = (out / "commands.txt").read_text()
    assert "gpu_bench.sh" not in ran and ran.count("link_probe.py") == 2


def test_torch_profile_probes_record_the_generating_instance_during_their_point(
        tmp_path: Path, model: Path) -> None:
    """TORCH_PROFILE_POINTS: every server gets vLLM's --profiler-config; during the point that
    ran, the probe calls /start_profile then /stop_profile on the instance that generates the
    tokens (found in bench.log) and moves the trace vLLM wrote into the point's folder; a probe
    whose point never ran does not hold the benchmark up."""
    import http.server
    import threading

    out = tmp_path / "out"
    raw = out / "r1" / "torch_profile_raw"
    posts: list[str] = []

    class Instance(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            posts.append(self.path)
            if self.path == "/stop_profile":  # vLLM writes the trace before it answers
                raw.mkdir(parents=True, exist_ok=True)
                (raw / "d.1.pt.trace.json.gz").write_bytes(b"trace")
                (raw / "profiler_out_0.txt").write_text("table")
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Instance)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: fake"; else echo "fake, 1 MiB"; fi',
        # the benchmark: logs its flags, D's command line and one point, then ends
        "python3": 'printf "%s\\n" "$@" > "$OUT/$RUN/args.txt"\n'
                   f'echo "[bench 00:00:00] layerkv decode on GPUs 1: vllm serve m --port {port}"\n'
                   'echo "[bench 00:00:01] vllm bench serve --result-filename layerkv_pt1.json"\n'
                   'sleep 4; echo done > "$OUT/$RUN/summary.json"',
    }
    write_scripts(bin_dir, scripts)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "BENCH": str(tmp_path / "bench"), "RUN": "r1", "MODEL": str(model),
           "TORCH_PROFILE_POINTS": "layerkv_pt1 layerkv_pt2", "TORCH_PROFILE_DELAY": "0",
           "TORCH_PROFILE_SECONDS": "1"}
    try:
        started = time.monotonic()
        r = subprocess.run(["bash", "benchmarks/gpu_bench.sh", "layerkv", "--"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 40, f"gpu_bench.sh waited {took:.0f} s for a probe whose point never ran"
    assert posts == ["/start_profile", "/stop_profile"]
    args = (out / "r1" / "args.txt").read_text().splitlines()
    (flags,) = [a for a in args if a.startswith("--vllm-args=")]
    config = json.loads(shlex.split(flags.split("=", 1)[1])[1])
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == str(raw)
    point = out / "r1" / "torch_profile_layerkv_pt1"
    assert sorted(p.name for p in point.iterdir()) == [
        "d.1.pt.trace.json.gz", "probe.log", "profiler_out_0.txt"]
    assert "/stop_profile: HTTP/1.0 200" in (point / "probe.log").read_text()
    assert not list(raw.iterdir())  # moved, not copied
    assert not (out / "r1" / "torch_profile_layerkv_pt2").exists() or not list(
        (out / "r1" / "torch_profile_layerkv_pt2").glob("*.gz"))


def test_the_decode_graph_sweep_profiles_each_configuration_on_one_gpu_pair(
        tmp_path: Path, model: Path) -> None:
    commands = sweep_commands("sweep_decode_graphs.sh", tmp_path, model)
    runs = bench_runs(commands)
    configs = ["nixl", "layerkv", "layerkv-writes"]
    assert [(run, names) for run, names, _ in runs] == [
        ("01_c1_graphs", configs), ("03_rates_pool_round", configs)]
    check_runs(runs, model, gpus=2)
    options = runs[0][2]
    args = load("ttft_bench").parse_args(["--device", "cuda", "--model", str(model),
                                          "--configs", "nixl", "--out", "/tmp/x", *options])
    assert args.cuda_graphs
    (c, i, o, _), = args.load
    env = dict(word.split("=", 1) for word in commands[0][1:commands[0].index("bash")])
    # the profiled points are the load points as ttft_bench.py names them, one per configuration
    assert env["TORCH_PROFILE_POINTS"].split() == [
        f"{name}_c{c}_in{i}_out{o}" for name in ("nixl", "layerkv", "layerkv-writes")]
    assert env["TORCH_PROFILE_SECONDS"] == "1.5"
    profile = commands[1]
    assert [w for w in profile if w.endswith(".py")] == ["benchmarks/decode_profile.py"]
    assert profile[profile.index("--json") + 1].endswith("decode_profile.json")


def test_the_decode_graph_sweep_measures_open_loop_on_a_pool_that_has_gone_round(
        tmp_path: Path, model: Path) -> None:
    """Step 3: every instance gets a small KV pool, which each rate's warm-up takes more than
    once, and nothing is profiled; STEPS picks the steps."""
    commands = sweep_commands("sweep_decode_graphs.sh", tmp_path, model, STEPS="rates",
                              POOL_BLOCKS="5000")
    (run, configs, options), = bench_runs(commands)
    assert run == "03_rates_pool_round" and configs == ["nixl", "layerkv", "layerkv-writes"]
    (cmd,) = commands
    env = dict(word.split("=", 1) for word in cmd[1:cmd.index("bash")])
    assert env["VLLM_ARGS"] == "--num-gpu-blocks-override 5000"
    assert not any(name.startswith("TORCH_PROFILE") for name in env)
    args = load("ttft_bench").parse_args(["--device", "cuda", "--model", str(model),
                                          "--configs", *configs, "--out", "/tmp/x",
                                          *options])
    assert args.cuda_graphs and [(r.value, r.of_capacity) for r in args.rates] == [
        (0.5, True), (0.9, True)]
    assert args.rate_warmup * 256 > 5000  # each rate's warm-up goes round the pool
    assert Path(ROOT, args.capacity_from).is_file()
    assert [run for run, _, _ in bench_runs(sweep_commands(
        "sweep_decode_graphs.sh", tmp_path / "g", model, STEPS="graphs"))] == ["01_c1_graphs"]


@pytest.mark.parametrize("setting,message", [
    ({"STEPS": "graphs rate"}, "names 'rate'; use graphs, rates or both"),
    ({"POOL_BLOCKS": "6k"}, "POOL_BLOCKS='6k' is not a block count")])
def test_the_decode_graph_sweep_refuses_unknown_settings(tmp_path: Path, model: Path,
                                                         setting: dict, message: str) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODEL": str(model), "DRY_RUN": "1",
           **setting}
    r = subprocess.run(["bash", "benchmarks/sweep_decode_graphs.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out" / "commands.txt").exists()


def test_the_decode_graph_sweep_summarises_the_traces_its_run_recorded(
        tmp_path: Path, model: Path) -> None:
    """The benchmark stand-in leaves a trace for one configuration only: the summary step gets
    exactly that trace; with none, it is skipped and says why."""
    out = tmp_path / "out"
    bin_dir = recording_bin(tmp_path)
    trace_dir = '"$OUT/$RUN/torch_profile_layerkv_c1_in4096_out512"'
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        'printf "%s\\n" "$@" >> "$CALLS"; echo "----" >> "$CALLS"\n'
        f'if [ "$1" = benchmarks/ttft_bench.py ] && [ -n "${{TRACE:-}}" ]; then\n'
        f'  mkdir -p {trace_dir}; touch {trace_dir}/rank0.1.pt.trace.json.gz; fi\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
           "MODEL": str(model), "CALLS": str(tmp_path / "calls"), "SWEEP_TIMEOUT": "600",
           "SWEEP_MARGIN": "0", "BENCH": str(tmp_path / "bench"), "TRACE": "1",
           "STEPS": "graphs"}
    r = subprocess.run(["bash", "benchmarks/sweep_decode_graphs.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    bench, summary = calls(tmp_path / "calls")
    assert bench[0] == "benchmarks/ttft_bench.py"
    assert summary == [
        "benchmarks/decode_profile.py",
        str(out / "01_c1_graphs" / "torch_profile_layerkv_c1_in4096_out512"
            / "rank0.1.pt.trace.json.gz"),
        "--json", str(out / "decode_profile.json")]

    out2 = tmp_path / "out2"
    r = subprocess.run(["bash", "benchmarks/sweep_decode_graphs.sh"], cwd=ROOT,
                       env={**env, "OUT": str(out2), "TRACE": "", "CALLS": str(tmp_path / "c2")},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [argv[0] for argv in calls(tmp_path / "c2")] == ["benchmarks/ttft_bench.py"]
    assert "02_decode_profile: skipped, no trace was recorded" in (out2 / "sweep.log").read_text()


def test_the_reads_sweep_runs_each_model_family_beside_its_own_single_instance(
        tmp_path: Path, model: Path) -> None:
    """Every step has its single instance first (the step's identity reference: the models
    differ), checks identity, and serves the model family it names; STEPS picks steps."""
    commands = sweep_commands("sweep_reads_default.sh", tmp_path, model)
    runs = bench_runs(commands)
    assert [(run, names) for run, names, _ in runs] == [
        ("01_llama_c1", ["single", "layerkv", "layerkv-writes"]),
        ("02_hybrid", ["single", "layerkv", "layerkv-writes"]),
        ("03_mla_fp8", ["single", "layerkv"]),
        ("04_llama_fp8", ["single", "layerkv"])]
    check_runs(runs, model, gpus=2)
    ttft_bench = load("ttft_bench")
    parsed = {run: ttft_bench.parse_args(["--device", "cuda", "--model", str(model),
                                          "--configs", *names, "--out", "/tmp/x", *options])
              for run, names, options in runs}
    assert all(args.identity == 4 for args in parsed.values())
    assert parsed["01_llama_c1"].prompt_lens == [4096, 8192, 16000]
    assert parsed["01_llama_c1"].cuda_graphs and parsed["01_llama_c1"].kv_cache_dtype is None
    assert parsed["02_hybrid"].no_prefix_caching
    assert [run for run, args in parsed.items() if args.cuda_graphs] == [
        "01_llama_c1", "04_llama_fp8"]
    assert [run for run, args in parsed.items() if args.kv_cache_dtype == "fp8"] == [
        "03_mla_fp8", "04_llama_fp8"]
    model_configs = {}
    for cmd in commands:
        env = dict(word.split("=", 1) for word in cmd[1:cmd.index("bash")])
        model_configs[env["RUN"]] = env.get("MODEL_CONFIG")
    assert model_configs == {
        "01_llama_c1": None, "02_hybrid": "benchmarks/gpu_models/nemotronh8b",
        "03_mla_fp8": "benchmarks/gpu_models/deepseek-v2-lite", "04_llama_fp8": None}
    for path in filter(None, model_configs.values()):
        assert (ROOT / path / "config.json").is_file()
    picked = bench_runs(sweep_commands("sweep_reads_default.sh", tmp_path / "some", model,
                                       STEPS="llama-fp8 hybrid"))
    assert [run for run, _, _ in picked] == ["02_hybrid", "04_llama_fp8"]


def test_the_reads_sweep_serves_a_step_s_model_config(tmp_path: Path, model: Path) -> None:
    """Run, not only written: gpu_bench.sh gets the step's MODEL_CONFIG and serves the model
    it builds from it, with MODEL's tokenizer."""
    bench = tmp_path / "bench"
    env = {**os.environ, "PATH": f"{recording_bin(tmp_path)}:{os.environ['PATH']}",
           "OUT": str(tmp_path / "out"), "MODEL": str(model), "BENCH": str(bench),
           "CALLS": str(tmp_path / "calls"), "SWEEP_TIMEOUT": "600", "SWEEP_MARGIN": "0",
           "STEPS": "mla-fp8"}
    r = subprocess.run(["bash", "benchmarks/sweep_reads_default.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (argv,) = calls(tmp_path / "calls")
    built = bench / "models" / "deepseek-v2-lite"
    assert argv[argv.index("--model") + 1] == str(built)
    assert (built / "config.json").read_text() == (
        ROOT / "benchmarks" / "gpu_models" / "deepseek-v2-lite" / "config.json").read_text()
    assert (built / "tokenizer.json").is_file()


def test_the_reads_sweep_refuses_a_step_it_does_not_have(tmp_path: Path, model: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MODEL": str(model), "DRY_RUN": "1",
           "STEPS": "llama mla"}
    r = subprocess.run(["bash", "benchmarks/sweep_reads_default.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "STEPS='llama mla' names 'mla'; use some of: llama hybrid mla-fp8 llama-fp8" \
        in r.stderr
    assert not (tmp_path / "out" / "commands.txt").exists()
