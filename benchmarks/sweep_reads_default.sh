#!/bin/bash
# LayerKV's default over CUDA IPC (cuda_ipc_reads: D maps P's KV and copies each layer group
# itself) on each model family LayerKV serves, with greedy identity, on a host with two GPUs,
# from the project root:
#   MODEL=/path/to/llama8b OUT=/tmp/out SWEEP_TIMEOUT=1800 bash benchmarks/sweep_reads_default.sh
# Open loop, D reading meets the CUDA IPC targets against NixlConnector where P writing misses
# TPOT (benchmarks/results/2026-11-27-x2-h200-decode-reads). The steps, most important first
# (each one's configurations one after the other; each step's own single instance is its
# identity reference, so models never mix):
#   1. llama: single, layerkv, layerkv-writes (P writes into D) at c=1, 4K / 8K / 16K, CUDA
#      graphs, identity on 4 prompts: the NVLink target (<= 1.05x single), both directions;
#   2. hybrid: benchmarks/gpu_models/nemotronh8b (Mamba2 + attention: the Mamba state goes once,
#      at the end), single, layerkv and layerkv-writes at 8K (eager, no prefix caching): vLLM
#      0.26 registers Mamba layers in a form the CPU tests' vLLM does not. The first server on a
#      fresh host compiles Mamba2's Triton kernels: 127 s to over 200 s on 2 x H200;
#   3. mla-fp8: benchmarks/gpu_models/deepseek-v2-lite (MLA) with an fp8 KV cache, single and
#      layerkv at 1K / 4K, eager: capturing this MoE model's CUDA graphs took each server over
#      3 minutes, and D's reads run before its step, outside any graph;
#   4. llama-fp8: the Llama-3.1-8B shape with an fp8 KV cache, single and layerkv at 4K / 16K,
#      CUDA graphs.
# STEPS (default "llama hybrid mla-fp8 llama-fp8") picks the steps. Measured (2026-11-28): llama
# 6 minutes on 2 x H100; hybrid 5-7, mla-fp8 5 and llama-fp8 4.5 on 2 x H200. Each
# configuration starts its own servers; with CUDA graphs a start takes 1.5-2.5 minutes. Under
# a 10-minute limit per call, run one step per call. Each step is skipped when less than its
# minimum is left of SWEEP_TIMEOUT (sweep_common.sh).
set -uo pipefail
source "$(dirname "$0")/sweep_common.sh"
ALL_STEPS="llama hybrid mla-fp8 llama-fp8"
asked=${STEPS:-$ALL_STEPS}
for step in $asked; do
  if [[ " $ALL_STEPS " != *" $step "* ]]; then
    echo "$(basename "$0"): STEPS='$asked' names '$step'; use some of: $ALL_STEPS" >&2
    exit 2
  fi
done
STEPS=" $asked "
note "model-family sweep into $OUT, ${SWEEP_TIMEOUT} s in all; steps:${STEPS}"

if [[ $STEPS == *" llama "* ]]; then
  bench_step 01_llama_c1 360 single layerkv layerkv-writes -- --cuda-graphs \
    --prompt-lens 4096 8192 16000 --num-prompts 5 --identity 4 --start-timeout 200
fi
if [[ $STEPS == *" hybrid "* ]]; then
  MODEL_CONFIG=benchmarks/gpu_models/nemotronh8b \
    bench_step 02_hybrid 480 single layerkv layerkv-writes -- --no-prefix-caching \
    --prompt-lens 8192 --num-prompts 3 --identity 4 --start-timeout 400
fi
if [[ $STEPS == *" mla-fp8 "* ]]; then
  MODEL_CONFIG=benchmarks/gpu_models/deepseek-v2-lite \
    bench_step 03_mla_fp8 330 single layerkv -- --kv-cache-dtype fp8 \
    --prompt-lens 1024 4096 --num-prompts 3 --identity 4 --max-model-len 8192 \
    --start-timeout 200
fi
if [[ $STEPS == *" llama-fp8 "* ]]; then
  bench_step 04_llama_fp8 330 single layerkv -- --cuda-graphs --kv-cache-dtype fp8 \
    --prompt-lens 4096 16000 --num-prompts 3 --identity 4 --start-timeout 200
fi
note "done"
