#!/usr/bin/env bash
# The main job: set up (idempotent), then run single instance vs LayerKV P/D on CPU with SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/cpu_demo.py "$@"
