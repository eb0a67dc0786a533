# Shared helpers of the launch scripts (launch/tpu_vm.sh, launch/gpu_vm.sh, launch/local.sh); sourced, never run.
#
# * launch_parse: one option parser for all three scripts (options before or after the subcommand, `--opt value` or
#   `--opt=value`, everything after `--` is the job command);
# * launch_die (bad input: one line on stderr, exit status 2) and launch_fail (a runtime problem: exit status 1);
# * launch_quote: shell quoting in the style of Python's shlex.quote, so every printed command can be pasted back;
# * launch_cmd / launch_cmd_bg / launch_wait: print a command (--dry-run) or print it on stderr and run it;
# * the remote side shared by the TPU and GPU scripts: the archive of the repository that `setup` copies, the
#   install command, and the job command line that `run` sends.
#
# Commands run in the repository root (launch_cd_root), so relative paths in them (build/, results/) are relative
# to it, and a --dry-run listing is meant to be pasted there.

# shellcheck shell=bash disable=SC2154  # OPT_* variables are set by launch_parse

# The directory the repository is unpacked into on every remote host (relative to the login user's home).
LAUNCH_REMOTE_DIR=blockspec_jax
# The archive `setup` builds here (build/ is ignored by git) and copies to every host.
LAUNCH_ARCHIVE=build/blockspec_jax.tar.gz

LAUNCH_PROG=${0##*/}
LAUNCH_PIDS=()

launch_die() {  # bad input: one line, exit status 2
  printf '%s: error: %s; try --help\n' "$LAUNCH_PROG" "$*" >&2
  exit 2
}

launch_fail() {  # a problem that is not the user's input: one line, exit status 1
  printf '%s: error: %s\n' "$LAUNCH_PROG" "$*" >&2
  exit 1
}

launch_note() {  # information for the user, on stderr (stdout of --dry-run holds only commands)
  printf '%s: %s\n' "$LAUNCH_PROG" "$*" >&2
}

launch_cd_root() {
  local here
  here=${BASH_SOURCE[0]%/*}
  [[ $here == "${BASH_SOURCE[0]}" ]] && here=.
  cd "$here/.." || launch_fail "cannot change to the repository root ($here/..)"
}

# launch_parse SUBCOMMANDS VALUE_OPTIONS FLAG_OPTIONS "$@"
#   SUBCOMMANDS, VALUE_OPTIONS, FLAG_OPTIONS: space-separated words (option names without the leading --; an empty
#   SUBCOMMANDS means the script takes none). Sets OPT_<name> (dashes become underscores; "" when not given, "1" for
#   a given flag), SUBCOMMAND, JOB (the words after --, an array) and DRY_RUN. Calls `usage` and exits 0 on -h/--help.
launch_parse() {
  local subcommands=$1 values=$2 flags=$3
  shift 3
  local opt value
  for opt in $values $flags; do
    printf -v "OPT_${opt//-/_}" '%s' ''
  done
  SUBCOMMAND=''
  JOB=()
  HAVE_JOB=''
  while (($#)); do
    case $1 in
      -h | --help)
        usage
        exit 0
        ;;
      --)
        shift
        JOB=("$@")
        HAVE_JOB=1
        break
        ;;
      --*=*)
        opt=${1%%=*}
        opt=${opt#--}
        value=${1#*=}
        if [[ " $values " == *" $opt "* ]]; then
          printf -v "OPT_${opt//-/_}" '%s' "$value"
        elif [[ " $flags " == *" $opt "* ]]; then
          launch_die "option --$opt takes no value"
        else
          launch_die "unknown option --$opt"
        fi
        ;;
      --?*)
        opt=${1#--}
        if [[ " $values " == *" $opt "* ]]; then
          if (($# < 2)) || [[ $2 == --* ]]; then
            launch_die "option --$opt needs a value"
          fi
          printf -v "OPT_${opt//-/_}" '%s' "$2"
          shift
        elif [[ " $flags " == *" $opt "* ]]; then
          printf -v "OPT_${opt//-/_}" '%s' 1
        else
          launch_die "unknown option $1"
        fi
        ;;
      -*)
        launch_die "unknown option $1"
        ;;
      *)
        if [[ -z $subcommands ]]; then
          launch_die "unexpected argument '$1' (put the job command after --)"
        elif [[ -n $SUBCOMMAND ]]; then
          launch_die "unexpected argument '$1' after subcommand '$SUBCOMMAND' (put the job command after --)"
        elif [[ " $subcommands " != *" $1 "* ]]; then
          launch_die "unknown subcommand '$1' (expected one of: ${subcommands// /, })"
        fi
        SUBCOMMAND=$1
        ;;
    esac
    shift
  done
  if [[ -n $subcommands && -z $SUBCOMMAND ]]; then
    launch_die "missing subcommand (one of: ${subcommands// /, })"
  fi
  DRY_RUN=${OPT_dry_run:-}
}

launch_require() {  # launch_require OPTION...: each --OPTION must have been given a non-empty value
  local opt var
  for opt in "$@"; do
    var=OPT_${opt//-/_}
    # shellcheck disable=SC2016  # the quotes are text, the expansion happens
    [[ -n ${!var} ]] || launch_die "missing --$opt${SUBCOMMAND:+ for '$SUBCOMMAND'}"
  done
}

launch_positive_int() {  # launch_positive_int OPTION: --OPTION (if given) must be an integer >= 1
  local var=OPT_${1//-/_}
  [[ -z ${!var} || ${!var} =~ ^[1-9][0-9]*$ ]] || launch_die "--$1 must be an integer >= 1, got '${!var}'"
}

launch_require_job() {
  ((${#JOB[@]})) || launch_die "missing job command for '$SUBCOMMAND': put it after --, e.g. -- python -m blockspec_jax.run"
}

launch_no_job() {
  [[ -z $HAVE_JOB ]] || launch_die "'$SUBCOMMAND' takes no job command after --"
}

launch_check_python() {  # --python: a python3 interpreter name, put into remote commands as it is
  [[ $OPT_python =~ ^python3(\.[0-9]+)?$ ]] || launch_die "--python must look like python3.11 or python3, got '$OPT_python'"
}

# launch_quote WORD...: REPLY = the words shell-quoted like Python's shlex.quote (safe words bare, others in single
# quotes with each ' written '"'"'), joined by single spaces.
launch_quote() {
  local LC_ALL=C IFS=' ' word safe='^[A-Za-z0-9_@%+=:,./-]+$'
  local -a out=()
  for word in "$@"; do
    if [[ $word =~ $safe ]]; then
      out+=("$word")
    else
      out+=("'${word//\'/\'\"\'\"\'}'")
    fi
  done
  REPLY="${out[*]}"
}

launch_need() {  # launch_need PROGRAM: without --dry-run, PROGRAM must be on PATH
  [[ -n $DRY_RUN ]] && return 0
  command -v "$1" >/dev/null 2>&1 && return 0
  if [[ $1 == gcloud ]]; then
    launch_fail "gcloud not found on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install), run 'gcloud init', or add --dry-run to print the commands without running them"
  fi
  launch_fail "$1 not found on PATH"
}

launch_cmd() {  # launch_cmd COMMAND...: --dry-run prints it; otherwise it is echoed on stderr ("+ ...") and run
  launch_quote "$@"
  if [[ -n $DRY_RUN ]]; then
    printf '%s\n' "$REPLY"
  else
    printf '+ %s\n' "$REPLY" >&2
    "$@"
  fi
}

launch_cmd_bg() {  # launch_cmd_bg COMMAND...: the same, in the background ("... &"); launch_wait waits for all
  launch_quote "$@"
  if [[ -n $DRY_RUN ]]; then
    printf '%s &\n' "$REPLY"
  else
    printf '+ %s &\n' "$REPLY" >&2
    trap launch_kill_bg INT TERM
    "$@" &
    LAUNCH_PIDS+=("$!")
  fi
}

launch_kill_bg() {
  ((${#LAUNCH_PIDS[@]})) && kill "${LAUNCH_PIDS[@]}" 2>/dev/null
  exit 130
}

launch_wait() {
  if [[ -n $DRY_RUN ]]; then
    printf '%s\n' wait
    return 0
  fi
  local pid failed=0
  for pid in "${LAUNCH_PIDS[@]}"; do
    wait "$pid" || failed=$((failed + 1))
  done
  LAUNCH_PIDS=()
  trap - INT TERM
  ((failed == 0)) || launch_fail "$failed of the background commands failed (see their output above)"
}

# The local half of `setup`: an archive of the committed tree (HEAD) in $LAUNCH_ARCHIVE. Uncommitted changes are not
# in it (a note says so when the work tree has any).
launch_build_archive() {
  if [[ -z $DRY_RUN ]]; then
    launch_need git
    if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
      launch_note "note: setup copies the committed tree (HEAD); uncommitted changes are not copied"
    fi
  fi
  launch_cmd mkdir -p "${LAUNCH_ARCHIVE%/*}"
  launch_cmd git archive --format=tar.gz "--prefix=$LAUNCH_REMOTE_DIR/" "--output=$LAUNCH_ARCHIVE" HEAD
}

# launch_install_command JAX_REQUIREMENT: REPLY = the remote install command: unpack the archive over
# ~/$LAUNCH_REMOTE_DIR (results/ and .venv/ there are kept), get $OPT_python (apt-get, when it or its venv module is
# missing), a virtual environment .venv, and `pip install -e . JAX_REQUIREMENT` in it.
launch_install_command() {
  local py=$OPT_python archive=${LAUNCH_ARCHIVE##*/}
  REPLY="set -e; tar -xzf $archive; rm $archive; cd $LAUNCH_REMOTE_DIR; "
  REPLY+="$py -c \"import ensurepip\" 2>/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q $py $py-venv; }; "
  REPLY+="$py -m venv .venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -e . \"$1\""
}

launch_remote_path() {  # launch_remote_path PATH: REPLY = PATH on a remote host (relative: under ~/$LAUNCH_REMOTE_DIR)
  if [[ $1 == /* ]]; then REPLY=$1; else REPLY=$LAUNCH_REMOTE_DIR/$1; fi
}

# launch_job_command [NAME=VALUE...]: REPLY = the remote command that runs the job ("${JOB[@]}") in
# ~/$LAUNCH_REMOTE_DIR with its virtual environment active and the given variables exported.
launch_job_command() {
  local job exports=''
  launch_quote "${JOB[@]}"
  job=$REPLY
  if (($#)); then
    launch_quote "$@"
    exports="export $REPLY && "
  fi
  REPLY="cd $LAUNCH_REMOTE_DIR && . .venv/bin/activate && $exports$job"
}
