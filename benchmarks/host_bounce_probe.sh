#!/bin/bash
# On a GPU host with vLLM, NIXL and this package installed: host_bounce over UCX tcp
# between two processes (tests/gpu/test_cuda_ipc.py, 2 GiB after an untimed warm-up transfer,
# every byte checked) with 1, 2 (default) and 3 writes in flight, after a first run that
# compiles the Triton gather / scatter kernels; direct writes of GPU memory for comparison;
# then raw NIXL WRITE rates of pinned host and GPU memory over UCX tcp
# (benchmarks/nixl_host_bw.py). Each case keeps P's trace (trace_N.p.0): per piece, the time
# from taking a staging buffer to the write posted (grant, gather, copy to host, post) and the
# time the sender then waited for the write. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD:$HOME/site:$PWD/tests/gpu PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
( cd tests/gpu && LAYERKV_GPU_RESULTS=$OUT/host_bounce.json OUT=$OUT timeout 420 python3 -c "
import json, os, statistics
import test_cuda_ipc as t
bounce = t.test_nixl_over_ucx_tcp_through_host_memory
one = t.test_nixl_over_ucx_tcp_through_host_memory_one_write_at_a_time
three = t.test_nixl_over_ucx_tcp_through_host_memory_three_writes_in_flight
cases = [bounce, one, bounce, three, one, bounce, three, t.test_nixl_over_ucx_tcp_one_worker]
for i, f in enumerate(cases):
    trace = os.path.join(os.environ['OUT'], f'trace_{i}')
    os.environ['LAYERKV_GPU_TRACE'] = trace
    n = len(t.RESULTS)
    try:
        f(); print('PASSED', f.__name__, flush=True)
    except Exception as e:
        print('FAILED', f.__name__, repr(e)[:300], flush=True)
    for r in t.RESULTS[n:]:
        print(i, r['transport'], r['config'], 'GB/s %.2f' % r['p']['gbps'],
              's %.2f' % r['p']['seconds'], 'warmup s', r['p'].get('warmup_seconds'),
              'bounces', r['p'].get('bounces'), flush=True)
    try:
        evs = [json.loads(l) for l in open(trace + '.p.0')]
    except OSError:
        continue
    timed = [e for e in evs if e.get('transfer_id') == 'tid-1']
    posted = [e['seconds'] * 1e3 for e in timed if e['ev'] == 'piece_posted']
    landed = [e for e in timed if e['ev'] == 'piece_landed']
    if posted and landed:
        print(i, 'pieces', len(landed), 'median ms: posting %.1f, waited %.1f, buffer-to-landed %.1f'
              % (statistics.median(posted), statistics.median(e['waited'] * 1e3 for e in landed),
                 statistics.median(e['seconds'] * 1e3 for e in landed)), flush=True)
" ) 2>&1 | tee "$OUT/host_bounce.log" | grep -E "^(PASSED|FAILED|[0-9])"
UCX_TLS=tcp,cuda_copy,self timeout 90 python3 benchmarks/nixl_host_bw.py --mb 64 --pieces 1 \
  --mem pinned vram 2>&1 | grep "^{" | tee "$OUT/nixl_host_bw.jsonl"
