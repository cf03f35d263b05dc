#!/usr/bin/env bash
# All tests: set up (idempotent), then unit tests and the end-to-end tests that drive real
# `vllm serve` processes on CPU (~12 GiB RAM). Extra arguments go to pytest instead of the
# default path (e.g. a file, or -k: over tests/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec .venv/bin/python -m pytest -v -p no:cacheprovider --durations=40 "${@:-tests}"
