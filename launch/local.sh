#!/usr/bin/env bash
# Run one blockspec_jax job on this machine, from the repository root (install first: pip install -r
# requirements.txt -e ".[test]"). Default job: the main job, python -m blockspec_jax.run; another job goes after --.
# --fake-devices N runs it on N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, JAX_PLATFORMS=cpu),
# to try a (data, model) mesh without accelerators. --dry-run prints the command, shell-quoted, and runs nothing.
# Walkthrough: docs/LAUNCH.md.
# shellcheck disable=SC2154  # OPT_* variables are set by launch_parse (launch/common.sh)
set -euo pipefail

usage() {  # builtins only: --help works without anything on PATH
  local text
  IFS= read -r -d '' text <<'EOF' || true
Usage: launch/local.sh [--fake-devices N] [--dry-run] [-- JOB COMMAND...]

Runs the job command (default: python -m blockspec_jax.run) in the repository root.

Options:
  --fake-devices N   N CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=N (appended to any XLA_FLAGS
                     already set) and JAX_PLATFORMS=cpu
  --dry-run          print the command (to paste in the repository root) and run nothing
  -h, --help         this help

Examples:
  launch/local.sh
  launch/local.sh -- python -m blockspec_jax.run --gin_file gin/runs/smollm2_self.gin --gin_param "run_job.gamma = 6"
  launch/local.sh -- python -m blockspec_jax.eval.bench_verify --config configs/verify_bench.py
  launch/local.sh --fake-devices 8 -- python -m blockspec_jax.eval.suite --gin_file gin/eval/smoke.gin
EOF
  printf '%s' "$text"
}

LAUNCH_DIR=${BASH_SOURCE[0]%/*}
if [[ $LAUNCH_DIR == "${BASH_SOURCE[0]}" ]]; then LAUNCH_DIR=.; fi
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

launch_parse "" "fake-devices" "dry-run" "$@"
launch_positive_int fake-devices
if ((${#JOB[@]} == 0)); then
  JOB=(python -m blockspec_jax.run)
fi
launch_cd_root

if [[ -n $OPT_fake_devices ]]; then
  flags="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$OPT_fake_devices"
  launch_cmd env "XLA_FLAGS=$flags" JAX_PLATFORMS=cpu "${JOB[@]}"
else
  launch_cmd "${JOB[@]}"
fi
