#!/bin/bash
# What the sweeps (benchmarks/sweep_slow_links.sh, sweep_four_gpus.sh, sweep_decode_graphs.sh,
# sweep_reads_default.sh) share (sourced by each, from the project root): the settings, the time
# limit, and running one step. Each step gets the time left to the sweep (less SWEEP_MARGIN for
# the plots and packing at the end) as its own limit, and is skipped when less than the minimum
# it names is left: the steps run in order of importance, so a sweep that runs out of time
# still has its most important results. Every command is written, exactly as run (environment
# included), to $OUT/commands.txt before it runs; gpu_bench.sh also keeps each run's
# ttft_bench.py command in $OUT/<run>/command.txt, and ttft_bench.py's summary.json and
# link_probe.py's output name their command too.
# DRY_RUN=1 writes the commands without running any.
set -uo pipefail
MODEL=${MODEL:-}
if [ -z "$MODEL" ] || [ ! -f "$MODEL/config.json" ]; then
  echo "$(basename "$0"): set MODEL to a model directory with Llama-3.1-8B's config.json and" \
    "tokenizer files (e.g. a Hugging Face download of meta-llama/Llama-3.1-8B-Instruct; the" \
    "weights are not needed). MODEL='$MODEL' has no config.json." >&2
  exit 2
fi
export MODEL
OUT=${OUT:-/tmp/out}
export OUT
SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-3600}
SWEEP_MARGIN=${SWEEP_MARGIN:-120}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
deadline=$(( $(date +%s) + SWEEP_TIMEOUT - SWEEP_MARGIN ))

note() {
  echo "[sweep $(date +%H:%M:%S)] $*" | tee -a "$OUT/sweep.log"
}

seconds_left() {
  echo $(( deadline - $(date +%s) ))
}

# record STEP CMD...: write the command, exactly, to commands.txt (and say it)
record() {
  local step=$1; shift
  { echo "# $step"; printf '%q ' "$@"; echo; } >> "$OUT/commands.txt"
  note "$step: $(printf '%q ' "$@")"
}

# bench_step RUN MIN_SECONDS CONFIGS -- TTFT_BENCH_ARGS: one gpu_bench.sh run into $OUT/RUN
bench_step() {
  local run=$1 min=$2; shift 2
  local left; left=$(seconds_left)
  if [ "$DRY_RUN" != 1 ] && [ "$left" -lt "$min" ]; then
    note "$run: skipped, ${left} s left of the sweep (it needs ${min} s)"
    return 0
  fi
  local flags=() var  # what gpu_bench.sh reads from its environment, named in the command
  for var in MODEL_CONFIG VLLM_ARGS TP_VLLM_ARGS TORCH_PROFILE_POINTS TORCH_PROFILE_SECONDS \
      TORCH_PROFILE_DELAY; do
    [ -n "${!var:-}" ] && flags+=("$var=${!var}")
  done
  local cmd=(env RUN="$run" BENCH_TIMEOUT="$left" "${flags[@]}" bash benchmarks/gpu_bench.sh "$@")
  record "$run (${left} s left)" "${cmd[@]}"
  [ "$DRY_RUN" = 1 ] && return 0
  "${cmd[@]}" > "$OUT/$run.gpu_bench.log" 2>&1
  note "$run: gpu_bench.sh exit $? (its output: $OUT/$run.gpu_bench.log)"
}

# plain_step NAME MIN_SECONDS MAX_SECONDS CMD...: any other command, under the time left or
# MAX_SECONDS, whichever is less
plain_step() {
  local name=$1 min=$2 max=$3; shift 3
  local left; left=$(seconds_left)
  if [ "$DRY_RUN" != 1 ] && [ "$left" -lt "$min" ]; then
    note "$name: skipped, ${left} s left of the sweep (it needs ${min} s)"
    return 0
  fi
  [ "$left" -gt "$max" ] && left=$max
  local cmd=(timeout -k 10 "$left" "$@")
  record "$name (${left} s left)" "${cmd[@]}"
  [ "$DRY_RUN" = 1 ] && return 0
  "${cmd[@]}" 2>&1 | tee -a "$OUT/$name.log"
  note "$name: exit ${PIPESTATUS[0]}"
}
