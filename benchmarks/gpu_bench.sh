#!/usr/bin/env bash
# On a lent GPU machine, after the bundle is staged and installed (../shared/gpu/README.md):
#   bash benchmarks/gpu_bench.sh CONFIG... -- [extra ttft_bench.py args]
# Runs a CUDA sanity check of LayerKV's staged block I/O, then benchmarks/ttft_bench.py on the
# Llama-3.1-8B-shaped dummy model, writing results under $OUT.
set -uo pipefail
export PYTHONPATH=$HOME/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1
MODEL=${MODEL:-$HOME/stage/core/models/llama8b}
OUT=${OUT:-/tmp/out}
configs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done; shift || true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'PY' 2>&1 | tee -a "$OUT/sanity.txt"
import torch
from vllm_layerkv.layout import KVLayout
from vllm_layerkv.blockio import StagedBlockIO
L, B = 4, 64
src = {f"model.layers.{i}.self_attn.attn": torch.randn(B, 8, 16, 256, device="cuda:0", dtype=torch.bfloat16) for i in range(L)}
dst = {k: torch.zeros_like(v) for k, v in src.items()}
a, b = StagedBlockIO(KVLayout.from_kv_caches(src, B)), StagedBlockIO(KVLayout.from_kv_caches(dst, B))
blocks_src, blocks_dst = [3, 4, 5, 9, 1], [10, 11, 2, 40, 63]
for out_buf, in_buf in zip(b.write(range(L), blocks_dst), a.read(range(L), blocks_src)):
    out_buf[:] = in_buf
ok = all(torch.equal(dst[k][blocks_dst], src[k][blocks_src]) for k in src)
untouched = [i for i in range(B) if i not in blocks_dst]
ok &= all(int(dst[k][untouched].abs().sum()) == 0 for k in src)
print("staged block io round trip on cuda:", "OK" if ok else "FAILED")
PY
python3 benchmarks/ttft_bench.py --device cuda --model "$MODEL" --load-format dummy \
  --configs "${configs[@]}" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -E "^\[bench|median|identity|\{|failed|Error" | tail -60
