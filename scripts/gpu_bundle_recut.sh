#!/usr/bin/env bash
# Re-cut the GPU bundle (../shared/gpu/build_bundle.sh: .gpu/p0..p2 core, p3 NIXL, p4 Mooncake;
# or the four-part core of scripts/gpu_bundle_split4.sh, which adds p5) into as few device calls
# as the carry limit allows: one tar of the parts asked for, cut into equal pieces .gpu/q0,
# .gpu/q1, ... each small enough to travel beside this repository's tracked files (a call carries
# 64 MiB in all). Writes .gpu/bin/stage_parts.sh, which each call runs: it keeps its piece and,
# once all are there, joins them and lays the parts out in $HOME/stage as stage.sh would have,
# so install.sh runs unchanged. Core + NIXL takes five calls this way, where p0, p1, p5, NIXL in
# two halves and p2 took six.
#
#   bash scripts/gpu_bundle_recut.sh [PART ...]     (default: every core part, and p3 if built)
#
# Stage with, back to back, one call a piece (the last one then runs install.sh):
#   run(command="bash .gpu/bin/stage_parts.sh", carry=[".gpu/q0", ".gpu/bin"], kind=...)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GPU=${LAYERKV_GPU_DIR:-$ROOT/.gpu}
LIMIT=${LAYERKV_CARRY_LIMIT:-$((64 * 1024 * 1024))}  # bytes one device call carries
MARGIN=$((2 * 1024 * 1024))  # the call's own files beside the tree (.gpu/bin), and slack

parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  for p in p0 p1 p2 p5 p3; do [ -d "$GPU/$p" ] && parts+=("$p"); done
fi
[ ${#parts[@]} -gt 0 ] || { echo "no bundle parts in $GPU: run ../shared/gpu/build_bundle.sh first" >&2; exit 1; }
for p in "${parts[@]}"; do
  [ -d "$GPU/$p" ] || { echo "$GPU/$p does not exist (parts there: $(ls "$GPU" | tr '\n' ' '))" >&2; exit 1; }
done
[ -d "$GPU/bin" ] || { echo "$GPU/bin does not exist: run ../shared/gpu/build_bundle.sh first" >&2; exit 1; }

# what travels with every call: tracked files and untracked ones git does not ignore
# (summed over every file: xargs may run stat several times on a long list)
tree=$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s + 0}')
room=$((LIMIT - tree - MARGIN))
[ "$room" -gt $((1024 * 1024)) ] || { echo "the tree that travels ($tree bytes) leaves too little room beside it" >&2; exit 1; }

rm -rf "$GPU"/q[0-9]*
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -cf "$tmp/all.tar" -C "$GPU" "${parts[@]}"
size=$(stat -c %s "$tmp/all.tar")
n=$(((size + room - 1) / room))
[ "$n" -le 10 ] || { echo "$n pieces: more than stage_parts.sh's ten" >&2; exit 1; }
(cd "$tmp" && split -n "$n" -d all.tar piece.)
for i in $(seq 0 $((n - 1))); do
  mkdir -p "$GPU/q$i"
  mv "$tmp/piece.0$i" "$GPU/q$i/"
done

cat > "$GPU/bin/stage_parts.sh" <<EOF
#!/bin/bash
# On the device: keep this call's piece of the bundle (.gpu/qN) in \$HOME/stage_parts; once all
# $n are there, join them and copy the parts (${parts[*]}) into \$HOME/stage, as stage.sh does.
set -e
mkdir -p \$HOME/stage_parts \$HOME/stage
for d in .gpu/q[0-9]*; do [ -d "\$d" ] && cp "\$d"/piece.* \$HOME/stage_parts/; done
have=\$(ls \$HOME/stage_parts | grep -c '^piece\.' || true)
echo "pieces staged: \$have of $n"
if [ "\$have" = $n ]; then
  cat \$HOME/stage_parts/piece.* | tar -x -C \$HOME/stage_parts
  for p in ${parts[*]}; do cp -r \$HOME/stage_parts/\$p/. \$HOME/stage/; rm -rf \$HOME/stage_parts/\$p; done
  rm -f \$HOME/stage_parts/piece.*
  ls \$HOME/stage
fi
EOF
chmod +x "$GPU/bin/stage_parts.sh"
echo "${parts[*]} -> $n pieces of at most $(( (size + n - 1) / n / 1024 / 1024 + 1 )) MiB beside a $((tree / 1024 / 1024)) MiB tree:"
du -sh "$GPU"/q[0-9]* | sed 's/^/  /'
