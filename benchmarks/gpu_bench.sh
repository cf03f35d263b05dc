#!/bin/bash
# On a GPU host with vLLM and this package installed, from the project root. MODEL (required): a
# model directory with Llama-3.1-8B's config.json and tokenizer files, e.g. a Hugging Face
# download of meta-llama/Llama-3.1-8B-Instruct (the weights are not read: the benchmark serves
# --load-format dummy, random weights of the config's shape):
#   MODEL=/path/to/llama8b bash benchmarks/gpu_bench.sh [--ipc-test] [--tp-test] CONFIG... -- \
#       [extra ttft_bench.py args]
#   MODEL=/path/to/llama8b MODEL_CONFIG=benchmarks/gpu_models/nemotronh8b \
#       bash benchmarks/gpu_bench.sh CONFIG... -- --no-prefix-caching
#       (hybrid: attention + Mamba2, dummy weights, MODEL's tokenizer; vLLM 0.26's NixlConnector
#       needs VLLM_SSM_CONV_STATE_LAYOUT=DS exported for it, so export it for every configuration)
# VLLM_ARGS / TP_VLLM_ARGS: extra vLLM flags for every instance / every instance with TP > 1
# (ttft_bench.py --vllm-args / --tp-vllm-args); bench.log names each server's whole command.
# --ipc-test first runs tests/gpu/test_cuda_ipc.py (two processes, P on GPU 0, D on GPU 1: CUDA
# IPC byte-exact + copy rates); --tp-test runs tests/gpu/test_tp_gpu.py (prefill TP != decode
# TP: one process per rank, staging + receive ring, every byte checked, fused copy vs torch).
# Then benchmarks/ttft_bench.py on the Llama-3.1-8B-shaped dummy model. Each run writes straight into $OUT/$RUN, so a run stopped by an outer time limit still
# leaves what it measured (summary.json is rewritten after every measurement). BENCH_TIMEOUT=S
# stops the benchmark after S seconds (it stops its servers on SIGTERM) and still packs what
# it has: keep S about 30 s under any outer limit. Wrapping this whole script in `timeout`
# instead also kills the packing, and the server logs are lost. $BENCH keeps the single
# instance's greedy reference and a copy of each run on the host, so configurations can run
# one after the other; each run also packs $BENCH into $OUT/bench.tar.gz.
set -uo pipefail
# Everything this run starts inherits this tag; the clean-up at the end stops only processes
# that carry it, never another run's (or a test cluster's) servers on the same machine.
export LAYERKV_BENCH_TAG="gpu_bench.$$.$(date +%s%N)"
# the working tree first, so the run uses this checkout's code over an installed copy
export PYTHONPATH=$PWD:$HOME/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1
MODEL=${MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL/config.json" ]; then
  echo "gpu_bench.sh: set MODEL to a model directory with Llama-3.1-8B's config.json and" \
    "tokenizer files (e.g. a Hugging Face download of meta-llama/Llama-3.1-8B-Instruct; the" \
    "weights are not needed). MODEL='$MODEL' has no config.json." >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-$HOME/bench}
# MODEL_CONFIG=benchmarks/gpu_models/NAME: a config.json from the working tree (e.g. a hybrid),
# served with MODEL's tokenizer and dummy weights from $BENCH/models/NAME
if [ -n "${MODEL_CONFIG:-}" ]; then
  built=$BENCH/models/$(basename "$MODEL_CONFIG"); mkdir -p "$built"
  cp "$MODEL_CONFIG/config.json" "$built/"
  for f in "$MODEL"/tokenizer* "$MODEL"/special_tokens_map.json; do
    [ -f "$f" ] && cp "$f" "$built/"
  done
  MODEL=$built
fi
RUN=${RUN:-run$(date +%H%M%S)}
mkdir -p "$OUT/$RUN" "$BENCH"
ipc=0; [ "${1:-}" = "--ipc-test" ] && { ipc=1; shift; }
tptest=0; [ "${1:-}" = "--tp-test" ] && { tptest=1; shift; }
configs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done; shift || true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ $ipc = 1 ]; then
  LAYERKV_GPU_RESULTS=$BENCH/ipc_test.json timeout 240 python3 tests/gpu/test_cuda_ipc.py \
    > "$BENCH/ipc_test.log" 2>&1; echo "ipc test exit $?"
  grep -E "^(PASSED|FAILED|SKIPPED)" "$BENCH/ipc_test.log"
  python3 -c "import json,sys; [print(r['transport'], r['gpus'], r['env'], r['config'], 'GB/s %.2f' % r['p']['gbps'], 'direct', r['p']['direct'], 'bounces', r['p'].get('bounces')) for r in json.load(open(sys.argv[1]))]" "$BENCH/ipc_test.json" 2>/dev/null
fi
if [ $tptest = 1 ]; then
  LAYERKV_GPU_RESULTS=$BENCH/tp_test.json timeout 300 python3 tests/gpu/test_tp_gpu.py \
    > "$BENCH/tp_test.log" 2>&1; echo "tp test exit $?"
  grep -E "^(PASSED|FAILED|SKIPPED|\{)" "$BENCH/tp_test.log"
fi
# PYSPY=path/to/py-spy PYSPY_POINTS="nixl_c16_in4096_out128 ...": sample P's and D's engine
# processes over those benchmark points (benchmarks/pyspy_probe.sh, PYSPY_SECONDS each, 45 by
# default) into $OUT/$RUN/pyspy_<point>/. A probe whose point never ran (its configuration did
# not start) is stopped when the benchmark ends rather than left waiting for it.
probes=()
probe_points=()  # the point each probe waits for
if [ -n "${PYSPY:-}" ] && [ ${#configs[@]} -gt 0 ]; then
  for point in ${PYSPY_POINTS:-}; do
    setsid bash benchmarks/pyspy_probe.sh "$PYSPY" "$OUT/$RUN" "$point" "${PYSPY_SECONDS:-45}" \
      "$OUT/$RUN/pyspy_$point" > /dev/null 2>&1 &
    probes+=($!)
    probe_points+=("$point")
  done
fi
# TORCH_PROFILE_POINTS="nixl_rate0.5x_in4096_out128 ...": every server runs with vLLM's torch
# profiler configured (--profiler-config, traces to $OUT/$RUN/torch_profile_raw), and during each
# of those points the instance that generates the tokens records TORCH_PROFILE_SECONDS (3) from
# TORCH_PROFILE_DELAY (5) seconds into the point (benchmarks/torch_profile_probe.sh) into
# $OUT/$RUN/torch_profile_<point>/; benchmarks/decode_profile.py summarises them.
if [ -n "${TORCH_PROFILE_POINTS:-}" ] && [ ${#configs[@]} -gt 0 ]; then
  raw="$OUT/$RUN/torch_profile_raw"
  profiler="--profiler-config '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$raw\", \"torch_profiler_with_stack\": false, \"ignore_frontend\": true}'"
  VLLM_ARGS="${VLLM_ARGS:+$VLLM_ARGS }$profiler"
  for point in $TORCH_PROFILE_POINTS; do
    setsid bash benchmarks/torch_profile_probe.sh "$OUT/$RUN" "$point" "${TORCH_PROFILE_DELAY:-5}" \
      "${TORCH_PROFILE_SECONDS:-3}" "$raw" "$OUT/$RUN/torch_profile_$point" > /dev/null 2>&1 &
    probes+=($!)
    probe_points+=("$point")
  done
fi
if [ ${#configs[@]} -gt 0 ]; then
  limit=(); [ -n "${BENCH_TIMEOUT:-}" ] && limit=(timeout -k 30 "$BENCH_TIMEOUT")
  # CUDA_VISIBLE_DEVICES=2,3 runs the benchmark on those GPUs alone (its GPU 0 is the host's 2)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    num_gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    num_gpus=$(nvidia-smi -L | wc -l)
  fi
  flags=()
  [ -n "${VLLM_ARGS:-}" ] && flags+=("--vllm-args=$VLLM_ARGS")
  [ -n "${TP_VLLM_ARGS:-}" ] && flags+=("--tp-vllm-args=$TP_VLLM_ARGS")
  cmd=(python3 benchmarks/ttft_bench.py --device cuda --model "$MODEL" --load-format dummy
    --configs "${configs[@]}" --out "$OUT/$RUN" --identity-ref "$BENCH/identity_single.json"
    --num-gpus "$num_gpus" "${flags[@]}" "$@")
  printf '%q ' "${limit[@]}" "${cmd[@]}" > "$OUT/$RUN/command.txt"; echo >> "$OUT/$RUN/command.txt"
  "${limit[@]}" "${cmd[@]}" > "$OUT/$RUN/bench.log" 2>&1
  echo "ttft_bench exit $?"
  grep -E "^\[bench|median|identity|\||failed|Error" "$OUT/$RUN/bench.log" | grep -v "bench serve --backend" | tail -60
  # a probe whose point ran may still be writing its profile (its servers are stopped by now):
  # give those a few seconds, then stop whatever is left, with the probes whose point never ran
  for _ in $(seq 1 5); do
    live=0
    for i in "${!probes[@]}"; do
      grep -q -- "--result-filename ${probe_points[$i]}.json" "$OUT/$RUN/bench.log" 2>/dev/null \
        && kill -0 "${probes[$i]}" 2>/dev/null && live=1
    done
    [ $live = 0 ] && break
    sleep 1
  done
  for p in "${probes[@]}"; do kill -- -"$p" 2>/dev/null; done
  cp -r "$OUT/$RUN" "$BENCH/"
fi
# Never leave this run's servers holding the GPUs for the next run: each runs under setsid,
# apart from this script, so a benchmark killed past its deadline leaves them up. Only processes
# that carry this run's tag are stopped (a blanket pkill would also stop a test cluster running
# beside it).
for pid in $(pgrep -f "[v]llm.entrypoints.cli.main serve|[v]llm_layerkv.cli proxy|[b]ench_serve.py --worker|[v]llm-router|[n]ixl_proxy.py"); do
  tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "LAYERKV_BENCH_TAG=$LAYERKV_BENCH_TAG" \
    && kill "$pid" 2>/dev/null
done
tar -czf "$OUT/bench.tar.gz" -C "$BENCH" . 2>/dev/null
cp "$OUT/$RUN/summary.json" "$OUT/summary_$RUN.json" 2>/dev/null
ls -la "$OUT"
