#!/bin/bash
# Records a torch-profiler trace of the instance that generates the tokens (D, or the single
# instance) while one benchmark point runs: started in the background next to gpu_bench.sh, it
# waits until bench.log names the point, waits DELAY seconds into it, then calls the instance's
# /start_profile and, SECONDS later, /stop_profile (vLLM writes the trace before answering), and
# moves what vLLM wrote into OUT_DIR.
#   bash benchmarks/torch_profile_probe.sh BENCH_RUN_DIR TAG DELAY SECONDS PROFILE_DIR OUT_DIR &
# e.g. TAG=layerkv_rate0.5x_in4096_out128 (configuration, underscore, point). The servers must run
# with --profiler-config '{"profiler": "torch", "torch_profiler_dir": PROFILE_DIR, ...}'
# (gpu_bench.sh adds it with TORCH_PROFILE_POINTS). Output: OUT_DIR/*.pt.trace.json.gz (Chrome
# trace format: CPU ops, CUDA runtime calls, GPU kernels) and vLLM's kernel table
# (profiler_out_0.txt; rank0.profiler_out.txt in later vLLM); benchmarks/decode_profile.py
# summarises the traces. HTTP goes through bash's /dev/tcp: the probe needs neither curl nor
# a Python of its own.
set -u
DIR=$1 TAG=$2 DELAY=$3 SECS=$4 RAW=$5 OUT=$6
mkdir -p "$OUT"
config=${TAG%%_*}
for _ in $(seq 1 900); do
  grep -q -- "--result-filename $TAG.json" "$DIR/bench.log" 2>/dev/null && break
  sleep 1
done
# the generating instance's port, from the line that logs its command
line=$(grep -E "\] $config (decode|single) on " "$DIR/bench.log" | head -1)
port=$(grep -o -- "--port [0-9]*" <<<"$line" | head -1 | cut -d' ' -f2)
if [ -z "$port" ]; then
  echo "no decode or single instance of $config in $DIR/bench.log" > "$OUT/error.txt"
  exit 1
fi

post() {  # POST $1 to the instance; prints its status line
  local reply
  if ! exec 3<>"/dev/tcp/127.0.0.1/$port"; then
    echo "$1: cannot connect to port $port"
    return 1
  fi
  printf 'POST %s HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n' "$1" >&3
  reply=$(head -1 <&3)
  exec 3>&-
  echo "$1: ${reply%$'\r'}"
}

mkdir -p "$RAW"
marker="$OUT/.started"
sleep "$DELAY"
touch "$marker"
{ date -u +%FT%T; post /start_profile; sleep "$SECS"; post /stop_profile; date -u +%FT%T; } \
  > "$OUT/probe.log" 2>&1
# vLLM has written the trace when /stop_profile answers; allow a slow disk a moment
for _ in $(seq 1 30); do
  [ -n "$(find "$RAW" -maxdepth 2 -newer "$marker" -name '*.pt.trace.json*' 2>/dev/null)" ] && break
  sleep 1
done
find "$RAW" -maxdepth 2 -newer "$marker" \( -name '*.pt.trace.json*' -o -name '*profiler_out*.txt' \) \
  -exec mv {} "$OUT/" \;
rm -f "$marker"
