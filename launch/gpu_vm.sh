#!/usr/bin/env bash
# Compute Engine GPU VMs for blockspec_jax: create one VM (or --hosts N VMs NAME-0 … NAME-(N-1) for a multi-host
# run), copy the repository to each and install it, run one job command on every host at once (several hosts: each
# gets BLOCKSPEC_JAX_MULTIHOST=1, JAX_COORDINATOR_ADDRESS=NAME-0:PORT, JAX_NUM_PROCESSES=N and its JAX_PROCESS_ID),
# fetch the results from host 0, ssh in, delete. Every step is a gcloud command; --dry-run prints those commands,
# shell-quoted, one a line, and runs nothing. Walkthrough: docs/LAUNCH.md.
# shellcheck disable=SC2154  # OPT_* variables are set by launch_parse (launch/common.sh)
set -euo pipefail

usage() {  # builtins only: --help works without anything on PATH
  local text
  IFS= read -r -d '' text <<'EOF' || true
Usage: launch/gpu_vm.sh SUBCOMMAND --name NAME --zone ZONE [options] [-- JOB COMMAND...]

Subcommands:
  create   gcloud compute instances create: one VM NAME, or NAME-0 … NAME-(N-1) with --hosts N
  setup    copy the committed tree (git archive HEAD) to every host and install it there:
           PYTHON -m venv ~/blockspec_jax/.venv; pip install -e . "jax[cuda12]>=0.10,<0.11"
  run      run the job command (after --) on every host at once, in ~/blockspec_jax with its .venv active; with
           --hosts N > 1 each host gets BLOCKSPEC_JAX_MULTIHOST=1, JAX_COORDINATOR_ADDRESS=NAME-0:PORT,
           JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=<its index>
  fetch    copy ~/blockspec_jax/PATH from host 0 into DEST here
  ssh      open a shell on one host (--worker)
  delete   gcloud compute instances delete (asks before deleting)

Options:
  --name NAME               VM name, or prefix of the VM names with --hosts > 1 (required)
  --zone ZONE               zone, e.g. us-central1-a (required)
  --project PROJECT         Google Cloud project (default: gcloud's configured project)
  --hosts N                 number of VMs (default 1); give the same N to every subcommand
  --machine-type TYPE       default a3-highgpu-8g (8 H100 80GB GPUs come with A3 machine types)
  --accelerator SPEC        passed to create as --accelerator SPEC, for machine types that take GPUs separately,
                            e.g. --machine-type n1-standard-8 --accelerator type=nvidia-tesla-t4,count=1
  --image-family FAMILY     default common-cu128-ubuntu-2204-nvidia-570 (a Deep Learning VM image with the driver)
  --image-project PROJECT   default deeplearning-platform-release
  --boot-disk-size SIZE     default 200GB
  --spot                    create Spot VMs
  --port PORT               multi-host run: the coordinator's port on host 0 (default 8476)
  --python PYTHON           setup: interpreter of the venv (default python3.11; apt-get installs it when missing)
  --path PATH               fetch: directory (relative: under ~/blockspec_jax) on host 0 (default results)
  --dest DIR                fetch: local directory (default results/NAME); PATH lands in DIR/<basename of PATH>
  --worker N                ssh: host index (default 0)
  --dry-run                 print the commands (to paste in the repository root) and run nothing
  -h, --help                this help

Example:
  launch/gpu_vm.sh run --name g --zone us-central1-a --hosts 2 -- \
      python -m blockspec_jax.eval.suite --gin_file gin/eval/block_vs_token.gin
EOF
  printf '%s' "$text"
}

LAUNCH_DIR=${BASH_SOURCE[0]%/*}
if [[ $LAUNCH_DIR == "${BASH_SOURCE[0]}" ]]; then LAUNCH_DIR=.; fi
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

launch_parse "create setup run fetch ssh delete" \
  "name zone project hosts machine-type accelerator image-family image-project boot-disk-size port python path dest worker" \
  "spot dry-run" "$@"
launch_require name zone
if [[ $SUBCOMMAND == run ]]; then launch_require_job; else launch_no_job; fi
launch_positive_int hosts
launch_positive_int port
: "${OPT_hosts:=1}" "${OPT_machine_type:=a3-highgpu-8g}" "${OPT_image_family:=common-cu128-ubuntu-2204-nvidia-570}"
: "${OPT_image_project:=deeplearning-platform-release}" "${OPT_boot_disk_size:=200GB}" "${OPT_port:=8476}"
: "${OPT_python:=python3.11}" "${OPT_path:=results}" "${OPT_dest:=results/$OPT_name}" "${OPT_worker:=0}"
launch_check_python
((OPT_port <= 65535)) || launch_die "--port must be at most 65535, got '$OPT_port'"
if ! [[ $OPT_worker =~ ^(0|[1-9][0-9]*)$ ]] || ((OPT_worker >= OPT_hosts)); then
  launch_die "--worker must be a host index below --hosts ($OPT_hosts), got '$OPT_worker'"
fi

# The VM names: NAME alone, or NAME-0 … NAME-(N-1).
HOSTS=("$OPT_name")
if ((OPT_hosts > 1)); then
  HOSTS=()
  for ((i = 0; i < OPT_hosts; i++)); do HOSTS+=("$OPT_name-$i"); done
fi

GCE=(gcloud compute)
WHERE=(--zone "$OPT_zone")
if [[ -n $OPT_project ]]; then WHERE+=(--project "$OPT_project"); fi
if [[ $SUBCOMMAND == setup ]]; then
  launch_install_command "jax[cuda12]>=0.10,<0.11"
  install=$REPLY
fi
launch_cd_root
launch_need gcloud

case $SUBCOMMAND in
  create)
    extra=()
    if [[ -n $OPT_accelerator ]]; then extra+=(--accelerator "$OPT_accelerator"); fi
    if [[ -n $OPT_spot ]]; then extra+=(--provisioning-model SPOT); fi
    launch_cmd "${GCE[@]}" instances create "${HOSTS[@]}" "${WHERE[@]}" --machine-type "$OPT_machine_type" \
      "${extra[@]}" --maintenance-policy TERMINATE --image-family "$OPT_image_family" \
      --image-project "$OPT_image_project" --boot-disk-size "$OPT_boot_disk_size" \
      --metadata install-nvidia-driver=True
    ;;
  setup)
    launch_build_archive
    for host in "${HOSTS[@]}"; do
      launch_cmd "${GCE[@]}" scp "$LAUNCH_ARCHIVE" "$host:${LAUNCH_ARCHIVE##*/}" "${WHERE[@]}"
      launch_cmd "${GCE[@]}" ssh "$host" "${WHERE[@]}" --command "$install"
    done
    ;;
  run)
    if ((OPT_hosts == 1)); then
      launch_job_command
      launch_cmd "${GCE[@]}" ssh "${HOSTS[0]}" "${WHERE[@]}" --command "$REPLY"
    else
      launch_note "$OPT_hosts hosts join one multi-host run, coordinator ${HOSTS[0]}:$OPT_port"
      for ((i = 0; i < OPT_hosts; i++)); do
        launch_job_command BLOCKSPEC_JAX_MULTIHOST=1 "JAX_COORDINATOR_ADDRESS=${HOSTS[0]}:$OPT_port" \
          "JAX_NUM_PROCESSES=$OPT_hosts" "JAX_PROCESS_ID=$i"
        launch_cmd_bg "${GCE[@]}" ssh "${HOSTS[i]}" "${WHERE[@]}" --command "$REPLY"
      done
      launch_wait
    fi
    ;;
  fetch)
    launch_remote_path "$OPT_path"
    source_path=$REPLY
    launch_cmd mkdir -p "$OPT_dest"
    launch_cmd "${GCE[@]}" scp "${HOSTS[0]}:$source_path" "$OPT_dest" "${WHERE[@]}" --recurse
    ;;
  ssh)
    launch_cmd "${GCE[@]}" ssh "${HOSTS[OPT_worker]}" "${WHERE[@]}"
    ;;
  delete)
    launch_cmd "${GCE[@]}" instances delete "${HOSTS[@]}" "${WHERE[@]}"
    ;;
esac
