#!/bin/bash
# Samples where P's and D's engine-core processes spend their time (and who holds the GIL) while
# one benchmark point runs: started in the background next to gpu_bench.sh, it waits until
# bench.log names the point, then runs py-spy on every child of each vLLM server for SECONDS
# (make it cover vllm bench serve's own start, ~15 s for 64 random 4K prompts, and the point).
#   bash benchmarks/pyspy_probe.sh PY_SPY BENCH_RUN_DIR TAG SECONDS OUT_DIR &
# e.g. TAG=layerkv_c16_in4096_out128. Output: OUT_DIR/pyspy_<role>_<pid>.{gil,all}.txt
# (py-spy's raw format: one line per stack with its sample count; "gil" only counts samples whose
# thread held the GIL). Needs ptrace permission; a failure is written next to the output.
set -u
PYSPY=$1 DIR=$2 TAG=$3 SECS=$4 OUT=$5
mkdir -p "$OUT"
for _ in $(seq 1 600); do
  grep -q -- "--result-filename $TAG.json" "$DIR/bench.log" 2>/dev/null && break
  sleep 1
done
for role in producer consumer; do
  # the API server of that role (bracket: do not match this script's own command line)
  api=$(pgrep -f "kv_[${role:0:1}]${role:1}" | head -1)
  [ -z "$api" ] && { echo "no $role server" > "$OUT/pyspy_$role.err"; continue; }
  for pid in $(pgrep -P "$api"); do
    "$PYSPY" record --gil --nonblocking -d "$SECS" -r 200 -f raw \
      -o "$OUT/pyspy_${role}_$pid.gil.txt" --pid "$pid" > "$OUT/pyspy_${role}_$pid.gil.log" 2>&1 &
    "$PYSPY" record --idle --nonblocking -d "$SECS" -r 200 -f raw \
      -o "$OUT/pyspy_${role}_$pid.all.txt" --pid "$pid" > "$OUT/pyspy_${role}_$pid.all.log" 2>&1 &
  done
done
wait
