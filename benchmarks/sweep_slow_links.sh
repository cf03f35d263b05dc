#!/bin/bash
# The slow-link sweep in one call, on a host with two GPUs, from the project root:
#   MODEL=/path/to/llama8b OUT=/tmp/out SWEEP_TIMEOUT=3600 bash benchmarks/sweep_slow_links.sh
# In order of importance (a sweep cut by SWEEP_TIMEOUT keeps the first):
#   1. the link probe (link_probe.py): tcp, nixl and cuda_ipc with UCX's defaults, then nixl
#      with UCX_TLS=tcp,cuda_copy,self (host_bounce as LayerKV chooses it);
#   2. c=1 at 8K and 16K: single, layerkv-tcp, layerkv-tcp paced to 100 / 50 / 25 / 10 Gb/s,
#      layerkv-nixl-tcp and nixl-tcp, with the ideal TTFT over each link (--link-probe);
#   3. c=1 at 4K / 8K / 16K: layerkv, layerkv-auth, layerkv-tcp, layerkv-tcp-auth (the cost of
#      authentication, side by side);
#   4. open-loop rates over CUDA IPC: single (which measures P's prefill capacity), single-x2
#      (two single instances behind vllm-router round_robin), nixl, layerkv (D reads P's KV) and
#      layerkv-writes (P writes into D's) at RATES of it;
#      then nixl-tcp and layerkv-nixl-tcp (UCX tcp) at the same rates, UCX_RATE_SHAPE
#      (4096:128:30) with 5 warm-up requests per rate: NixlConnector over UCX tcp completes
#      about 0.8 requests/s, so a point of 200 would take it 4 minutes;
#   5. the tables and plots (plot_link_rates.py, plot_results.py) under $OUT/plots.
# Each benchmark run is a gpu_bench.sh run in $OUT/<step>; $OUT/commands.txt has every command.
# CUDA_GRAPHS=0 runs every instance eager (default 1: --cuda-graphs, as the headline results).
set -uo pipefail
source "$(dirname "$0")/sweep_common.sh"
RATES=${RATES:-0.5x,0.7x,0.9x}
RATE_SHAPE=${RATE_SHAPE:-4096:128:200}
UCX_RATE_SHAPE=${UCX_RATE_SHAPE:-4096:128:30}
NUM_PROMPTS=${NUM_PROMPTS:-5}
graphs=(--cuda-graphs); [ "${CUDA_GRAPHS:-1}" = 0 ] && graphs=()
probes=("$OUT/01_probe/probe.json" "$OUT/01_probe/probe_ucx_tcp.json")
mkdir -p "$OUT/01_probe"
note "slow-link sweep into $OUT, ${SWEEP_TIMEOUT} s in all"

plain_step 01_probe_defaults 120 900 python3 benchmarks/link_probe.py --device cuda \
  --model "$MODEL" --transports tcp nixl cuda_ipc --out "${probes[0]}"
plain_step 01_probe_ucx_tcp 120 600 env UCX_TLS=tcp,cuda_copy,self \
  python3 benchmarks/link_probe.py --device cuda --model "$MODEL" --transports nixl \
  --out "${probes[1]}"

bench_step 02_c1_links 600 single layerkv-tcp layerkv-tcp-100g layerkv-tcp-50g \
  layerkv-tcp-25g layerkv-tcp-10g layerkv-nixl-tcp nixl-tcp -- "${graphs[@]}" \
  --prompt-lens 8192 16000 --num-prompts "$NUM_PROMPTS" --link-probe "${probes[@]}"

bench_step 03_c1_auth 400 layerkv layerkv-auth layerkv-tcp layerkv-tcp-auth -- "${graphs[@]}" \
  --prompt-lens 4096 8192 16000 --num-prompts "$NUM_PROMPTS" --link-probe "${probes[@]}"

bench_step 04_rates_cuda_ipc 600 single single-x2 nixl layerkv layerkv-writes -- "${graphs[@]}" \
  --prompt-lens "${RATE_SHAPE%%:*}" --num-prompts "$NUM_PROMPTS" --rates "$RATES" \
  --rate-shape "$RATE_SHAPE" --link-probe "${probes[@]}"

# the same rates over UCX tcp, at the capacity step 04 measured on the single instance
bench_step 04_rates_ucx_tcp 600 nixl-tcp layerkv-nixl-tcp -- "${graphs[@]}" \
  --prompt-lens "${UCX_RATE_SHAPE%%:*}" --num-prompts "$NUM_PROMPTS" --rates "$RATES" \
  --rate-shape "$UCX_RATE_SHAPE" --rate-warmup 5 \
  --capacity-from "$OUT/04_rates_cuda_ipc/summary.json" --link-probe "${probes[@]}"

plain_step 05_plot_link_rates 10 300 python3 benchmarks/plot_link_rates.py "$OUT/02_c1_links" \
  --prompt-lens 8192 16000 --out "$OUT/plots"
plain_step 05_plot_results 10 300 python3 benchmarks/plot_results.py "$OUT/02_c1_links" \
  "$OUT/03_c1_auth" "$OUT/04_rates_cuda_ipc" "$OUT/04_rates_ucx_tcp" --out "$OUT/plots"
note "done"
