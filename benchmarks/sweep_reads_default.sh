#!/bin/bash
# Whether cuda_ipc_reads can be LayerKV's default over CUDA IPC: each model family LayerKV serves,
# with greedy identity, on a host with two GPUs, from the project root:
#   MODEL=/path/to/llama8b OUT=/tmp/out SWEEP_TIMEOUT=1800 bash benchmarks/sweep_reads_default.sh
# With cuda_ipc_reads, D maps P's KV and copies each layer group itself. Open loop, it meets the
# CUDA IPC targets against NixlConnector where P writing misses TPOT
# (benchmarks/results/2026-11-27-x2-h200-decode-reads), but only the Llama-3.1-8B shape has run
# with it. The steps, most important first (each one's configurations one after the other; each
# step's own single instance is its identity reference, so models never mix):
#   1. llama: single, layerkv, layerkv-reads at c=1, 4K / 8K / 16K, CUDA graphs, identity on 4
#      prompts: the NVLink target (<= 1.05x single) beside P writing;
#   2. hybrid: benchmarks/gpu_models/nemotronh8b (Mamba2 + attention: the Mamba state goes once,
#      at the end), single, layerkv and layerkv-reads at 8K (eager, no prefix caching); layerkv
#      too, as vLLM 0.26 registers Mamba layers in a form the CPU tests' vLLM does not;
#   3. mla-fp8: benchmarks/gpu_models/deepseek-v2-lite (MLA) with an fp8 KV cache, single and
#      layerkv-reads at 1K / 4K, CUDA graphs;
#   4. llama-fp8: the Llama-3.1-8B shape with an fp8 KV cache, single and layerkv-reads at 4K /
#      16K, CUDA graphs.
# STEPS (default "llama hybrid mla-fp8 llama-fp8") picks the steps. On 2 x H100 (2026-11-28) the
# llama step took 6 minutes; mla-fp8 and llama-fp8 need 5-6, hybrid about 7: each configuration
# starts its own servers, and with CUDA graphs a start takes 1.5-2.5 minutes. Under a 10-minute
# limit per call, run one step per call. Each step is skipped when less than its minimum is left of
# SWEEP_TIMEOUT (sweep_common.sh).
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
note "cuda_ipc_reads sweep into $OUT, ${SWEEP_TIMEOUT} s in all; steps:${STEPS}"

if [[ $STEPS == *" llama "* ]]; then
  bench_step 01_llama_c1 360 single layerkv layerkv-reads -- --cuda-graphs \
    --prompt-lens 4096 8192 16000 --num-prompts 5 --identity 4 --start-timeout 200
fi
if [[ $STEPS == *" hybrid "* ]]; then
  MODEL_CONFIG=benchmarks/gpu_models/nemotronh8b \
    bench_step 02_hybrid 420 single layerkv layerkv-reads -- --no-prefix-caching \
    --prompt-lens 8192 --num-prompts 3 --identity 4 --start-timeout 200
fi
if [[ $STEPS == *" mla-fp8 "* ]]; then
  MODEL_CONFIG=benchmarks/gpu_models/deepseek-v2-lite \
    bench_step 03_mla_fp8 360 single layerkv-reads -- --cuda-graphs --kv-cache-dtype fp8 \
    --prompt-lens 1024 4096 --num-prompts 3 --identity 4 --max-model-len 8192 \
    --start-timeout 200
fi
if [[ $STEPS == *" llama-fp8 "* ]]; then
  bench_step 04_llama_fp8 330 single layerkv-reads -- --cuda-graphs --kv-cache-dtype fp8 \
    --prompt-lens 4096 16000 --num-prompts 3 --identity 4 --start-timeout 200
fi
note "done"
