#!/bin/bash
# D's decode steps under each way the KV reaches it, in one call, on a host with two GPUs,
# from the project root:
#   MODEL=/path/to/llama8b OUT=/tmp/out SWEEP_TIMEOUT=900 bash benchmarks/sweep_decode_graphs.sh
# Why: LayerKV's D with P writing into its memory took about 0.17 ms longer per decode step than
# NixlConnector's. It ran the same kernels in the same time, but with longer gaps between them
# inside its CUDA graph
# (benchmarks/results/2026-11-27-x4-h200-decode-graphs). The short gaps go with D's CUDA context
# mapping P's KV, as NixlConnector's D does over UCX's cuda_ipc: without that mapping
# (nixl-tcp, layerkv-writes, layerkv-tcp) D has the long ones
# (benchmarks/results/2026-11-27-x2-h200-decode-mapping). layerkv is LayerKV's default, where D
# maps P's KV and copies each group itself (cuda_ipc_reads); layerkv-writes has P write
# instead. GPUs differ from each other by about as much as the effect, so every configuration
# runs on the same pair, one after the other:
#   1. CONFIGS (default: nixl layerkv layerkv-writes) with CUDA graphs, each with a c=1 decode
#      point (6 requests of 4,096 + 512 tokens) whose decoding instance the torch profiler
#      records for TORCH_PROFILE_SECONDS (1.5) from TORCH_PROFILE_DELAY (5) seconds in;
#   2. decode_profile.py over every trace: $OUT/decode_profile.json and its table, with the
#      per-launch view (idle inside each graph against idle before it);
#   3. CONFIGS at open-loop RATES (default 0.5x,0.9x of P's capacity on 2 x H200) on a KV pool
#      that has gone round: every instance gets POOL_BLOCKS (6000) blocks, and each rate's
#      warm-up (30 requests) takes them more than once. A fresh engine hands out its blocks in
#      order, so a prompt's blocks are one run and copied as one span; one that has gone round
#      reuses freed blocks last first, and a prompt's blocks are 10-30 runs
#      (results/2026-11-27-x2-h200-decode-reads/block_order_model.py), as in a long-running
#      server. Until this step, open-loop runs measured mostly the fresh state.
# The steady-step medians (client side) are in $OUT/01_c1_graphs/bench.log and summary.json.
# STEPS (default "graphs rates") picks the steps: "graphs" is 1 and 2, "rates" is 3; the two
# together take about 12 minutes.
set -uo pipefail
source "$(dirname "$0")/sweep_common.sh"
read -r -a configs <<<"${CONFIGS:-nixl layerkv layerkv-writes}"
asked=${STEPS:-graphs rates}
RATES=${RATES:-0.5x,0.9x}
POOL_BLOCKS=${POOL_BLOCKS:-6000}
for step in $asked; do
  if [ "$step" != graphs ] && [ "$step" != rates ]; then
    echo "$(basename "$0"): STEPS='$asked' names '$step'; use graphs, rates or both" >&2
    exit 2
  fi
done
STEPS=" $asked "
if ! [[ $POOL_BLOCKS =~ ^[1-9][0-9]*$ ]]; then
  echo "$(basename "$0"): POOL_BLOCKS='$POOL_BLOCKS' is not a block count (e.g. 6000)" >&2
  exit 2
fi
CAPACITY=benchmarks/results/2026-11-26-x4-h200-tp-rates/summary_rates_cuda_ipc.json
LOAD=${LOAD:-1:4096:512:6}
point="c${LOAD%%:*}_in$(cut -d: -f2 <<<"$LOAD")_out$(cut -d: -f3 <<<"$LOAD")"
points=()
for c in "${configs[@]}"; do points+=("${c}_$point"); done
export TORCH_PROFILE_POINTS="${points[*]}"
export TORCH_PROFILE_SECONDS=${TORCH_PROFILE_SECONDS:-1.5}
export TORCH_PROFILE_DELAY=${TORCH_PROFILE_DELAY:-5}
note "decode-graph sweep into $OUT, ${SWEEP_TIMEOUT} s in all: ${configs[*]}; steps:${STEPS}"

if [[ $STEPS == *" graphs "* ]]; then
  bench_step 01_c1_graphs 240 "${configs[@]}" -- --cuda-graphs --prompt-lens 4096 \
    --num-prompts 2 --identity 0 --load "$LOAD" --start-timeout 200

  traces=()
  for p in "${points[@]}"; do
    for t in "$OUT/01_c1_graphs/torch_profile_$p"/*.pt.trace.json*; do
      [ -e "$t" ] && traces+=("$t")
    done
  done
  if [ "$DRY_RUN" = 1 ] || [ ${#traces[@]} -gt 0 ]; then
    [ ${#traces[@]} -eq 0 ] && traces=("$OUT/01_c1_graphs/torch_profile_<point>/<trace>")
    plain_step 02_decode_profile 10 300 python3 benchmarks/decode_profile.py "${traces[@]}" \
      --json "$OUT/decode_profile.json"
  else
    note "02_decode_profile: skipped, no trace was recorded (see $OUT/01_c1_graphs.gpu_bench.log)"
  fi
fi

if [[ $STEPS == *" rates "* ]]; then
  TORCH_PROFILE_POINTS="" TORCH_PROFILE_SECONDS="" TORCH_PROFILE_DELAY="" \
    VLLM_ARGS="${VLLM_ARGS:+$VLLM_ARGS }--num-gpu-blocks-override $POOL_BLOCKS" \
    bench_step 03_rates_pool_round 300 "${configs[@]}" -- --cuda-graphs --prompt-lens 4096 \
    --num-prompts 1 --rates "$RATES" --rate-shape 4096:128:80 --rate-warmup 30 \
    --start-timeout 200 --capacity-from "$CAPACITY"
fi
note "done"
