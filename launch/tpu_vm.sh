#!/usr/bin/env bash
# Cloud TPU VMs for blockspec_jax: create a TPU VM (one host or a multi-host slice), copy the repository to every
# worker and install it, run one job command on all workers at once (multi-host slices join one jax.distributed run
# through BLOCKSPEC_JAX_MULTIHOST=1), fetch the results from worker 0, ssh in, delete. Every step is a gcloud
# command; --dry-run prints those commands, shell-quoted, one a line, and runs nothing. Walkthrough: docs/LAUNCH.md.
# shellcheck disable=SC2154  # OPT_* variables are set by launch_parse (launch/common.sh)
set -euo pipefail

usage() {  # builtins only: --help works without anything on PATH
  local text
  IFS= read -r -d '' text <<'EOF' || true
Usage: launch/tpu_vm.sh SUBCOMMAND --name NAME --zone ZONE [options] [-- JOB COMMAND...]

Subcommands:
  create   gcloud compute tpus tpu-vm create NAME (needs --accelerator-type; --version, --spot)
  setup    copy the committed tree (git archive HEAD) to every worker and install it there:
           PYTHON -m venv ~/blockspec_jax/.venv; pip install -e . "jax[tpu]>=0.10,<0.11"
  run      run the job command (after --) on ALL workers, in ~/blockspec_jax with its .venv active; on a slice of
           several hosts with BLOCKSPEC_JAX_MULTIHOST=1 exported (needs --accelerator-type, or --multihost /
           --single-host)
  fetch    copy ~/blockspec_jax/PATH from worker 0 into DEST here
  ssh      open a shell on one worker (--worker)
  delete   gcloud compute tpus tpu-vm delete NAME (asks before deleting)

Options:
  --name NAME               TPU VM name (required)
  --zone ZONE               zone, e.g. us-central2-b (required)
  --project PROJECT         Google Cloud project (default: gcloud's configured project)
  --accelerator-type TYPE   e.g. v5litepod-8, v4-8, v4-32, v5p-16, v6e-16
  --version VERSION         TPU runtime image (default from the type: v2/v3/v4: tpu-ubuntu2204-base,
                            v5litepod: v2-alpha-tpuv5-lite, v5p: v2-alpha-tpuv5, v6e: v2-alpha-tpuv6e)
  --spot                    create a Spot TPU VM
  --multihost               run: export BLOCKSPEC_JAX_MULTIHOST=1 whatever the type says
  --single-host             run: do not export it, whatever the type says
  --python PYTHON           setup: interpreter of the venv (default python3.11; apt-get installs it when missing)
  --path PATH               fetch: directory (relative: under ~/blockspec_jax) on worker 0 (default results)
  --dest DIR                fetch: local directory (default results/NAME); PATH lands in DIR/<basename of PATH>
  --worker N                ssh: worker index (default 0)
  --dry-run                 print the commands (to paste in the repository root) and run nothing
  -h, --help                this help

Hosts of a slice, from --accelerator-type: v2/v3/v4/v5p-N: N counts TensorCores, 8 per host (v4-8: 1 host,
v4-32: 4 hosts); v5litepod/v6e-N: N counts chips, up to 8 on one host, else 4 per host (v5litepod-16: 4 hosts).

Example:
  launch/tpu_vm.sh run --name t --zone us-central2-b --accelerator-type v4-32 -- \
      python -m blockspec_jax.eval.suite --gin_file gin/eval/block_vs_token.gin
EOF
  printf '%s' "$text"
}

LAUNCH_DIR=${BASH_SOURCE[0]%/*}
if [[ $LAUNCH_DIR == "${BASH_SOURCE[0]}" ]]; then LAUNCH_DIR=.; fi
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

# tpu_hosts TYPE: REPLY = the number of hosts (VMs) of a slice of accelerator type TYPE; returns 1 if unknown.
tpu_hosts() {
  local generation=${1%-*} n=${1##*-}
  [[ $1 == *-* && $n =~ ^[1-9][0-9]*$ ]] || return 1
  case $generation in
    v2 | v3 | v4 | v5p) REPLY=$((n <= 8 ? 1 : n / 8)) ;;  # N TensorCores (2 a chip on v4/v5p), 8 a host
    v5litepod | v6e) REPLY=$((n <= 8 ? 1 : n / 4)) ;;     # N chips: up to 8 on one host, else 4 a host
    *) return 1 ;;
  esac
}

# tpu_default_version TYPE: REPLY = the runtime image Google recommends for JAX on TYPE; returns 1 if unknown.
tpu_default_version() {
  case ${1%-*} in
    v2 | v3 | v4) REPLY=tpu-ubuntu2204-base ;;
    v5litepod) REPLY=v2-alpha-tpuv5-lite ;;
    v5p) REPLY=v2-alpha-tpuv5 ;;
    v6e) REPLY=v2-alpha-tpuv6e ;;
    *) return 1 ;;
  esac
}

launch_parse "create setup run fetch ssh delete" \
  "name zone project accelerator-type version python path dest worker" \
  "spot multihost single-host dry-run" "$@"
launch_require name zone
if [[ $SUBCOMMAND == run ]]; then launch_require_job; else launch_no_job; fi
: "${OPT_python:=python3.11}" "${OPT_path:=results}" "${OPT_dest:=results/$OPT_name}" "${OPT_worker:=0}"
launch_check_python
[[ $OPT_worker =~ ^(0|[1-9][0-9]*)$ ]] || launch_die "--worker must be a worker index (0, 1, …), got '$OPT_worker'"
if [[ -n $OPT_multihost && -n $OPT_single_host ]]; then
  launch_die "--multihost and --single-host exclude each other"
fi

# Settings each subcommand needs, checked before anything runs.
case $SUBCOMMAND in
  create)
    launch_require accelerator-type
    if [[ -z $OPT_version ]]; then
      tpu_default_version "$OPT_accelerator_type" ||
        launch_die "no default --version for accelerator type '$OPT_accelerator_type': pass --version"
      OPT_version=$REPLY
    fi
    ;;
  setup)
    launch_install_command "jax[tpu]>=0.10,<0.11"
    install=$REPLY
    ;;
  run)
    multihost=$OPT_multihost
    if [[ -z $OPT_multihost && -z $OPT_single_host ]]; then
      [[ -n $OPT_accelerator_type ]] ||
        launch_die "missing --accelerator-type for 'run' (it tells whether the slice has several hosts), or pass --multihost or --single-host"
      tpu_hosts "$OPT_accelerator_type" ||
        launch_die "cannot tell how many hosts a '$OPT_accelerator_type' slice has: pass --multihost or --single-host"
      launch_note "a $OPT_accelerator_type slice has $REPLY host(s)"
      if ((REPLY > 1)); then multihost=1; fi
    fi
    if [[ -n $multihost ]]; then
      launch_note "every worker joins one multi-host run (BLOCKSPEC_JAX_MULTIHOST=1)"
      launch_job_command BLOCKSPEC_JAX_MULTIHOST=1
    else
      launch_job_command
    fi
    remote=$REPLY
    ;;
esac

TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$OPT_zone")
if [[ -n $OPT_project ]]; then WHERE+=(--project "$OPT_project"); fi
launch_cd_root
launch_need gcloud

case $SUBCOMMAND in
  create)
    spot=()
    if [[ -n $OPT_spot ]]; then spot=(--spot); fi
    launch_cmd "${TPU[@]}" create "$OPT_name" "${WHERE[@]}" --accelerator-type "$OPT_accelerator_type" \
      --version "$OPT_version" "${spot[@]}"
    ;;
  setup)
    launch_build_archive
    launch_cmd "${TPU[@]}" scp "$LAUNCH_ARCHIVE" "$OPT_name:${LAUNCH_ARCHIVE##*/}" "${WHERE[@]}" --worker=all
    launch_cmd "${TPU[@]}" ssh "$OPT_name" "${WHERE[@]}" --worker=all --command "$install"
    ;;
  run)
    launch_cmd "${TPU[@]}" ssh "$OPT_name" "${WHERE[@]}" --worker=all --command "$remote"
    ;;
  fetch)
    launch_remote_path "$OPT_path"
    source_path=$REPLY
    launch_cmd mkdir -p "$OPT_dest"
    launch_cmd "${TPU[@]}" scp "$OPT_name:$source_path" "$OPT_dest" "${WHERE[@]}" --worker=0 --recurse
    ;;
  ssh)
    launch_cmd "${TPU[@]}" ssh "$OPT_name" "${WHERE[@]}" "--worker=$OPT_worker"
    ;;
  delete)
    launch_cmd "${TPU[@]}" delete "$OPT_name" "${WHERE[@]}"
    ;;
esac
