#!/usr/bin/env bash
# Local runner: the main command, then the verification benchmark. Run from the repository root after installing
# (pip install -r requirements.txt -e .). Extra arguments go to the main command.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m blockspec_jax "$@"
python -m blockspec_jax.eval.bench_verify --config configs/verify_bench.py
