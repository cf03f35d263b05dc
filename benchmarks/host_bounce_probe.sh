#!/bin/bash
# On a lent GPU machine (bundle staged and installed, NIXL and Mooncake included): host_bounce
# against direct writes of GPU memory, two processes (tests/gpu/test_cuda_ipc.py cases, 2 GiB
# each, every byte checked): the bounce with 1, 2 (default) and 3 writes in flight (after a
# warm-up run that compiles the Triton gather / scatter kernels), direct writes, Mooncake; then
# raw NIXL WRITE rates of pinned host and GPU memory over UCX tcp (benchmarks/nixl_host_bw.py).
# Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:$HOME/site:$PWD/tests/gpu PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
( cd tests/gpu && LAYERKV_GPU_RESULTS=$OUT/host_bounce.json timeout 400 python3 -c "
import test_cuda_ipc as t
bounce = t.test_nixl_over_ucx_tcp_through_host_memory
one = t.test_nixl_over_ucx_tcp_through_host_memory_one_write_at_a_time
three = t.test_nixl_over_ucx_tcp_through_host_memory_three_writes_in_flight
cases = [bounce, one, bounce, three, one, bounce, three,
         t.test_nixl_over_ucx_tcp_one_worker, t.test_mooncake_tcp_2gib,
         t.test_mooncake_tcp_through_host_memory]
for f in cases:
    n = len(t.RESULTS)
    try:
        f(); print('PASSED', f.__name__, flush=True)
    except Exception as e:
        print('FAILED', f.__name__, repr(e)[:300], flush=True)
    for r in t.RESULTS[n:]:
        print(r['transport'], r['env'], r['config'], 'GB/s %.2f' % r['p']['gbps'],
              's %.2f' % r['p']['seconds'], 'bounces', r['p'].get('bounces'), flush=True)
" ) 2>&1 | tee "$OUT/host_bounce.log" | grep -E "^(PASSED|FAILED|nixl|mooncake)"
UCX_TLS=tcp,cuda_copy,self timeout 90 python3 benchmarks/nixl_host_bw.py --mb 256 --pieces 4 \
  --mem pinned vram 2>&1 | grep "^{" | tee "$OUT/nixl_host_bw.jsonl"
