#!/bin/bash
# The four-GPU layouts in one call, on a host with four GPUs, from the project root:
#   MODEL=/path/to/llama8b OUT=/tmp/out SWEEP_TIMEOUT=3600 bash benchmarks/sweep_four_gpus.sh
# D always starts at GPU 2 (--decode-first-gpu 2). In order of importance:
#   1. different TP on GPUs of their own, c=1 at 4K / 8K / 16K with greedy identity (against
#      single, or single-tp2 where D runs TP2: the reference of D's own TP): P TP2 ->
#      D TP1 (P on 0-1, D on 2), P TP1 -> D TP2 (P on 0, D on 2-3), P TP2 -> D TP2 (0-1, 2-3),
#      for LayerKV then NixlConnector, and last P TP4 -> D TP2 sharing GPUs 2-3 (logged shared);
#   2. scale-out at open-loop RATES of P's prefill capacity (measured on single): 2P1D (P on GPU
#      0 and GPU 1, D TP2 on GPUs 2-3) and 1P1D (P on GPU 0, D TP2 on 2-3) behind LayerKV's
#      proxy, four single instances behind vllm-router round_robin (the same four GPUs without
#      P/D), then 2P1D and 1P1D behind vllm-router (--kv-connector mooncake);
#   3. the tables and plots (plot_results.py) under $OUT/plots.
# TP > 1 instances get TP_VLLM_ARGS (default --disable-custom-all-reduce; every instance runs
# eager unless CUDA_GRAPHS=1: on a host with NVLink multicast off, vLLM 0.26's compiled
# all-reduce + RMSNorm fusion picks FlashInfer's mnnvl backend, which needs multicast, and a TP2
# instance with CUDA graphs fails in its memory profiling; without that fusion it hangs after
# capturing its graphs; docs/benchmarks.md, "Four GPUs"). The router rows need the
# vllm-router binary in the Python environment that runs the benchmark (pip install
# vllm-router==0.1.17).
# bench.log names each server's flags.
set -uo pipefail
source "$(dirname "$0")/sweep_common.sh"
RATES=${RATES:-0.5x,0.9x,1.3x,1.7x}
RATE_SHAPE=${RATE_SHAPE:-4096:128:200}
NUM_PROMPTS=${NUM_PROMPTS:-5}
export TP_VLLM_ARGS=${TP_VLLM_ARGS:---disable-custom-all-reduce}
graphs=(); [ "${CUDA_GRAPHS:-0}" = 1 ] && graphs=(--cuda-graphs)
if [ "$DRY_RUN" != 1 ] && [ "$(nvidia-smi -L | wc -l)" -lt 4 ]; then
  echo "sweep_four_gpus.sh: needs four GPUs; nvidia-smi lists $(nvidia-smi -L | wc -l)" >&2
  exit 2
fi
note "four-GPU sweep into $OUT, ${SWEEP_TIMEOUT} s in all; TP > 1 flags: $TP_VLLM_ARGS"

bench_step 01_tp_layouts 600 single single-tp2 layerkv-tp2-tp1 layerkv-tp1-tp2 layerkv-tp2-tp2 \
  nixl-tp2-tp1 nixl-tp1-tp2 nixl-tp2-tp2 layerkv-tp4-tp2 nixl-tp4-tp2 -- "${graphs[@]}" \
  --decode-first-gpu 2 --prompt-lens 4096 8192 16000 --num-prompts "$NUM_PROMPTS" --identity 4

bench_step 02_scale_out 900 single layerkv-2p-tp1-tp2 layerkv-tp1-tp2 single-x4 \
  layerkv-router-2p-tp1-tp2 layerkv-router-tp1-tp2 -- "${graphs[@]}" --decode-first-gpu 2 \
  --prompt-lens "${RATE_SHAPE%%:*}" --num-prompts "$NUM_PROMPTS" --rates "$RATES" \
  --rate-shape "$RATE_SHAPE"

plain_step 03_plot_results 10 300 python3 benchmarks/plot_results.py "$OUT/01_tp_layouts" \
  "$OUT/02_scale_out" --out "$OUT/plots"
note "done"
