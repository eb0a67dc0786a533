"""The launch scripts (launch/tpu_vm.sh, launch/gpu_vm.sh, launch/local.sh), run with bash and no gcloud on PATH.

``--dry-run`` prints the exact commands, one a line, shell-quoted like Python's ``shlex.quote``: every subcommand's
listing is compared line for line, job commands with spaces and quotes included; the printed lines parse back
(``shlex.split``) into the commands, and a fake gcloud receives exactly those arguments when the scripts run for
real. Multi-host settings appear exactly on slices of several hosts. Bad input is one line on stderr and exit status
2; a missing gcloud is a clear error. Every command shown in docs/LAUNCH.md is accepted by its script, and every gin
file it names exists (except the suites under gin/eval/, written beside this).
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
DOC = REPO / "docs" / "LAUNCH.md"
BASH = shutil.which("bash") or "/bin/bash"
SCRIPTS = ("tpu_vm.sh", "gpu_vm.sh", "local.sh")

SUITE = ["python", "-m", "blockspec_jax.eval.suite", "--gin_file", "gin/eval/block_vs_token.gin"]
GAMMA_JOB = ["python", "-m", "blockspec_jax.run", "--gin_param", "run_job.gamma = 6",
             "--gin_param", "run_job.output_json = 'results/my run.json'"]
TPU = ["--name", "t", "--zone", "us-central2-b"]
GPU = ["--name", "g", "--zone", "us-central1-a"]
ENTER = "cd blockspec_jax && . .venv/bin/activate && "


@pytest.fixture(scope="module")
def empty_bin(tmp_path_factory) -> str:
  """A PATH with nothing on it (no gcloud, no git): the scripts must not need anything for --dry-run."""
  return str(tmp_path_factory.mktemp("empty-bin"))


def launch(script: str, *args: str, path: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
  env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **(extra_env or {})}
  return subprocess.run([BASH, str(LAUNCH / script), *args], capture_output=True, text=True, env=env, timeout=60,
                        cwd=str(REPO))


def with_dry_run(args) -> list[str]:
  """``args`` with --dry-run added before the job command (before ``--``), or at the end."""
  args = list(args)
  cut = args.index("--") if "--" in args else len(args)
  return args[:cut] + ["--dry-run"] + args[cut:]


def dry(script: str, *args: str, path: str) -> list[str]:
  """The lines of a successful --dry-run (stdout); nothing else may be printed there."""
  result = launch(script, *with_dry_run(args), path=path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.endswith("\n")
  return result.stdout.splitlines()


def test_the_documented_tpu_example_prints_one_exact_command(empty_bin):
  lines = dry("tpu_vm.sh", "run", *TPU, "--accelerator-type", "v4-32", "--", *SUITE, path=empty_bin)
  assert lines == [
      "gcloud compute tpus tpu-vm ssh t --zone us-central2-b --worker=all --command 'cd blockspec_jax && "
      ". .venv/bin/activate && export BLOCKSPEC_JAX_MULTIHOST=1 && python -m blockspec_jax.eval.suite "
      "--gin_file gin/eval/block_vs_token.gin'"]


def test_a_job_with_spaces_and_quotes_is_quoted_twice_and_parses_back(empty_bin):
  lines = dry("tpu_vm.sh", "run", *TPU, "--accelerator-type", "v5litepod-8", "--", *GAMMA_JOB, path=empty_bin)
  remote = ENTER + ("python -m blockspec_jax.run --gin_param 'run_job.gamma = 6' "
                    "--gin_param 'run_job.output_json = '\"'\"'results/my run.json'\"'\"''")
  assert lines == [
      "gcloud compute tpus tpu-vm ssh t --zone us-central2-b --worker=all --command 'cd blockspec_jax && "
      ". .venv/bin/activate && python -m blockspec_jax.run --gin_param '\"'\"'run_job.gamma = 6'\"'\"' "
      "--gin_param '\"'\"'run_job.output_json = '\"'\"'\"'\"'\"'\"'\"'\"'results/my run.json'\"'\"'\"'\"'\"'\"'"
      "\"'\"''\"'\"''"]
  argv = shlex.split(lines[0])
  assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t", "--zone", "us-central2-b", "--worker=all",
                  "--command", remote]
  assert shlex.split(remote.removeprefix(ENTER)) == GAMMA_JOB


@pytest.mark.parametrize("accelerator,hosts", [
    ("v2-8", 1), ("v3-32", 4), ("v4-8", 1), ("v4-16", 2), ("v4-32", 4), ("v5p-8", 1), ("v5p-16", 2),
    ("v5litepod-1", 1), ("v5litepod-8", 1), ("v5litepod-16", 4), ("v6e-8", 1), ("v6e-256", 64)])
def test_tpu_multihost_follows_the_number_of_hosts_of_the_slice(empty_bin, accelerator, hosts):
  result = launch("tpu_vm.sh", "run", *TPU, "--accelerator-type", accelerator, "--dry-run", "--", *SUITE,
                  path=empty_bin)
  assert result.returncode == 0, result.stderr
  exports = "export BLOCKSPEC_JAX_MULTIHOST=1 && " if hosts > 1 else ""
  assert result.stdout == shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t", "--zone", "us-central2-b",
                                      "--worker=all", "--command", ENTER + exports + shlex.join(SUITE)]) + "\n"
  assert f"a {accelerator} slice has {hosts} host(s)" in result.stderr


@pytest.mark.parametrize("flag,accelerator,multihost", [
    ("--multihost", "v4-8", True), ("--single-host", "v4-32", False), ("--multihost", None, True),
    ("--single-host", "tpu7x-128", False)])
def test_tpu_multihost_flags_override_the_accelerator_type(empty_bin, flag, accelerator, multihost):
  extra = ["--accelerator-type", accelerator] if accelerator else []
  lines = dry("tpu_vm.sh", "run", *TPU, *extra, flag, "--", *SUITE, path=empty_bin)
  assert len(lines) == 1 and ("BLOCKSPEC_JAX_MULTIHOST=1" in lines[0]) == multihost


def test_tpu_subcommands_print_their_exact_commands(empty_bin):
  assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type", "v4-32", path=empty_bin) == [
      "gcloud compute tpus tpu-vm create t --zone us-central2-b --accelerator-type v4-32 --version tpu-ubuntu2204-base"]
  assert dry("tpu_vm.sh", "create", "--name", "t", "--zone", "us-west4-a", "--project", "my-proj", "--accelerator-type",
             "v5litepod-8", "--spot", path=empty_bin) == [
      "gcloud compute tpus tpu-vm create t --zone us-west4-a --project my-proj --accelerator-type v5litepod-8 "
      "--version v2-alpha-tpuv5-lite --spot"]
  for accelerator, version in (("v5p-16", "v2-alpha-tpuv5"), ("v6e-16", "v2-alpha-tpuv6e"), ("v2-8", "tpu-ubuntu2204-base")):
    assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type", accelerator, path=empty_bin)[0].endswith(
        f" --accelerator-type {accelerator} --version {version}")
  assert dry("tpu_vm.sh", "create", *TPU, "--accelerator-type=v4-8", "--version=my-image", path=empty_bin)[0].endswith(
      " --accelerator-type v4-8 --version my-image")
  assert dry("tpu_vm.sh", "setup", *TPU, path=empty_bin) == [
      "mkdir -p build",
      "git archive --format=tar.gz --prefix=blockspec_jax/ --output=build/blockspec_jax.tar.gz HEAD",
      "gcloud compute tpus tpu-vm scp build/blockspec_jax.tar.gz t:blockspec_jax.tar.gz --zone us-central2-b "
      "--worker=all",
      "gcloud compute tpus tpu-vm ssh t --zone us-central2-b --worker=all --command 'set -e; tar -xzf "
      "blockspec_jax.tar.gz; rm blockspec_jax.tar.gz; cd blockspec_jax; python3.11 -c \"import ensurepip\" 2>/dev/null "
      "|| { sudo apt-get update -q && sudo apt-get install -y -q python3.11 python3.11-venv; }; python3.11 -m venv "
      ".venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip install -e . \"jax[tpu]>=0.10,<0.11\"'"]
  setup = dry("tpu_vm.sh", "setup", *TPU, "--python", "python3.12", path=empty_bin)
  assert "python3.12 -m venv .venv" in setup[-1] and "python3.11" not in setup[-1]
  assert dry("tpu_vm.sh", "fetch", *TPU, path=empty_bin) == [
      "mkdir -p results/t",
      "gcloud compute tpus tpu-vm scp t:blockspec_jax/results results/t --zone us-central2-b --worker=0 --recurse"]
  assert dry("tpu_vm.sh", "fetch", *TPU, "--path", "results/suites", "--dest", "out dir", path=empty_bin) == [
      "mkdir -p 'out dir'",
      "gcloud compute tpus tpu-vm scp t:blockspec_jax/results/suites 'out dir' --zone us-central2-b --worker=0 "
      "--recurse"]
  assert dry("tpu_vm.sh", "ssh", *TPU, path=empty_bin) == [
      "gcloud compute tpus tpu-vm ssh t --zone us-central2-b --worker=0"]
  assert dry("tpu_vm.sh", "ssh", *TPU, "--worker", "3", "--project", "p", path=empty_bin) == [
      "gcloud compute tpus tpu-vm ssh t --zone us-central2-b --project p --worker=3"]
  assert dry("tpu_vm.sh", "delete", *TPU, path=empty_bin) == [
      "gcloud compute tpus tpu-vm delete t --zone us-central2-b"]
  # options may come before the subcommand
  assert dry("tpu_vm.sh", *TPU, "delete", path=empty_bin) == dry("tpu_vm.sh", "delete", *TPU, path=empty_bin)


def test_gpu_subcommands_print_their_exact_commands(empty_bin):
  create = ("--machine-type a3-highgpu-8g --maintenance-policy TERMINATE --image-family "
            "common-cu128-ubuntu-2204-nvidia-570 --image-project deeplearning-platform-release --boot-disk-size 200GB "
            "--metadata install-nvidia-driver=True")
  assert dry("gpu_vm.sh", "create", *GPU, path=empty_bin) == [
      f"gcloud compute instances create g --zone us-central1-a {create}"]
  assert dry("gpu_vm.sh", "create", *GPU, "--hosts", "2", "--spot", "--project", "p", path=empty_bin) == [
      "gcloud compute instances create g-0 g-1 --zone us-central1-a --project p --machine-type a3-highgpu-8g "
      "--provisioning-model SPOT --maintenance-policy TERMINATE --image-family common-cu128-ubuntu-2204-nvidia-570 "
      "--image-project deeplearning-platform-release --boot-disk-size 200GB --metadata install-nvidia-driver=True"]
  assert dry("gpu_vm.sh", "create", *GPU, "--machine-type", "n1-standard-8", "--accelerator",
             "type=nvidia-tesla-t4,count=1", path=empty_bin) == [
      "gcloud compute instances create g --zone us-central1-a --machine-type n1-standard-8 --accelerator "
      "type=nvidia-tesla-t4,count=1 --maintenance-policy TERMINATE --image-family common-cu128-ubuntu-2204-nvidia-570 "
      "--image-project deeplearning-platform-release --boot-disk-size 200GB --metadata install-nvidia-driver=True"]
  install = ("'set -e; tar -xzf blockspec_jax.tar.gz; rm blockspec_jax.tar.gz; cd blockspec_jax; python3.11 -c "
             "\"import ensurepip\" 2>/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q python3.11 "
             "python3.11-venv; }; python3.11 -m venv .venv; .venv/bin/pip install -q --upgrade pip; .venv/bin/pip "
             "install -e . \"jax[cuda12]>=0.10,<0.11\"'")
  assert dry("gpu_vm.sh", "setup", *GPU, "--hosts", "2", path=empty_bin) == [
      "mkdir -p build",
      "git archive --format=tar.gz --prefix=blockspec_jax/ --output=build/blockspec_jax.tar.gz HEAD",
      "gcloud compute scp build/blockspec_jax.tar.gz g-0:blockspec_jax.tar.gz --zone us-central1-a",
      f"gcloud compute ssh g-0 --zone us-central1-a --command {install}",
      "gcloud compute scp build/blockspec_jax.tar.gz g-1:blockspec_jax.tar.gz --zone us-central1-a",
      f"gcloud compute ssh g-1 --zone us-central1-a --command {install}"]
  assert dry("gpu_vm.sh", "run", *GPU, "--", *SUITE, path=empty_bin) == [
      "gcloud compute ssh g --zone us-central1-a --command 'cd blockspec_jax && . .venv/bin/activate && python -m "
      "blockspec_jax.eval.suite --gin_file gin/eval/block_vs_token.gin'"]
  assert dry("gpu_vm.sh", "fetch", *GPU, "--hosts", "2", path=empty_bin) == [
      "mkdir -p results/g", "gcloud compute scp g-0:blockspec_jax/results results/g --zone us-central1-a --recurse"]
  assert dry("gpu_vm.sh", "ssh", *GPU, path=empty_bin) == ["gcloud compute ssh g --zone us-central1-a"]
  assert dry("gpu_vm.sh", "ssh", *GPU, "--hosts", "3", "--worker", "2", path=empty_bin) == [
      "gcloud compute ssh g-2 --zone us-central1-a"]
  assert dry("gpu_vm.sh", "delete", *GPU, "--hosts", "3", path=empty_bin) == [
      "gcloud compute instances delete g-0 g-1 g-2 --zone us-central1-a"]


def test_gpu_multihost_run_gives_every_host_its_process_id_and_waits(empty_bin):
  lines = dry("gpu_vm.sh", "run", *GPU, "--hosts", "2", "--port", "9999", "--", *GAMMA_JOB, path=empty_bin)
  job = shlex.join(GAMMA_JOB)
  assert lines == [
      shlex.join(["gcloud", "compute", "ssh", f"g-{i}", "--zone", "us-central1-a", "--command",
                  ENTER + f"export BLOCKSPEC_JAX_MULTIHOST=1 JAX_COORDINATOR_ADDRESS=g-0:9999 JAX_NUM_PROCESSES=2 "
                  f"JAX_PROCESS_ID={i} && {job}"]) + " &" for i in range(2)] + ["wait"]
  assert lines[0] == (
      "gcloud compute ssh g-0 --zone us-central1-a --command 'cd blockspec_jax && . .venv/bin/activate && export "
      "BLOCKSPEC_JAX_MULTIHOST=1 JAX_COORDINATOR_ADDRESS=g-0:9999 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 && python -m "
      "blockspec_jax.run --gin_param '\"'\"'run_job.gamma = 6'\"'\"' --gin_param '\"'\"'run_job.output_json = "
      "'\"'\"'\"'\"'\"'\"'\"'\"'results/my run.json'\"'\"'\"'\"'\"'\"'\"'\"''\"'\"'' &")
  single = dry("gpu_vm.sh", "run", *GPU, "--", *SUITE, path=empty_bin)
  assert not any(word in single[0] for word in ("BLOCKSPEC_JAX_MULTIHOST", "JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID"))


def test_local_prints_and_runs_the_job(empty_bin):
  assert dry("local.sh", path=empty_bin) == ["python -m blockspec_jax.run"]
  assert dry("local.sh", "--", *GAMMA_JOB, path=empty_bin) == [shlex.join(GAMMA_JOB)]
  assert dry("local.sh", "--fake-devices", "8", "--", *SUITE, path=empty_bin) == [
      "env XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m blockspec_jax.eval.suite "
      "--gin_file gin/eval/block_vs_token.gin"]
  system_path = os.environ.get("PATH", "/usr/bin:/bin")
  result = launch("local.sh", "--fake-devices", "4", "--", "printenv", "XLA_FLAGS", "JAX_PLATFORMS",
                  path=system_path, extra_env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
  assert result.returncode == 0, result.stderr
  assert result.stdout == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4\ncpu\n"
  assert result.stderr == ("+ env 'XLA_FLAGS=--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4'"
                           " JAX_PLATFORMS=cpu printenv XLA_FLAGS JAX_PLATFORMS\n")
  failed = launch("local.sh", "--", "bash", "-c", "exit 7", path=system_path)
  assert failed.returncode == 7  # the job's own status


def test_quoting_matches_shlex_and_survives_bash(empty_bin):
  words = ["a b", "it's", "", "$HOME", "x*", "semi;colon", "é", "tab\there", "new\nline", "-", "a=b", "@%+=:,./-_",
           "\"double\"", "back\\slash", "!bang"]
  lines = launch("local.sh", "--dry-run", "--", "printf", "<%s>", *words, path=empty_bin).stdout
  assert lines == shlex.join(["printf", "<%s>", *words]) + "\n"
  echoed = subprocess.run([BASH, "-c", lines], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
                          timeout=60)
  assert echoed.stdout == "".join(f"<{w}>" for w in words)


ERRORS = [
    ("tpu_vm.sh", [], "missing subcommand"),
    ("tpu_vm.sh", ["frob", *TPU], "unknown subcommand 'frob'"),
    ("tpu_vm.sh", ["create", "--zone", "z", "--accelerator-type", "v4-8"], "missing --name"),
    ("tpu_vm.sh", ["create", "--name", "t", "--accelerator-type", "v4-8"], "missing --zone"),
    ("tpu_vm.sh", ["create", *TPU], "missing --accelerator-type"),
    ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v9-8"], "no default --version"),
    ("tpu_vm.sh", ["run", *TPU, "--accelerator-type", "v4-8"], "missing job command"),
    ("tpu_vm.sh", ["run", *TPU, "--accelerator-type", "v4-8", "--"], "missing job command"),
    ("tpu_vm.sh", ["run", *TPU, "--", "ls"], "missing --accelerator-type"),
    ("tpu_vm.sh", ["run", *TPU, "--accelerator-type", "v9-8", "--", "ls"], "cannot tell how many hosts"),
    ("tpu_vm.sh", ["run", *TPU, "--multihost", "--single-host", "--", "ls"], "exclude each other"),
    ("tpu_vm.sh", ["run", *TPU, "python", "-m", "x"], "unexpected argument 'python'"),
    ("tpu_vm.sh", ["delete", *TPU, "--frob"], "unknown option --frob"),
    ("tpu_vm.sh", ["delete", *TPU, "-x"], "unknown option -x"),
    ("tpu_vm.sh", ["delete", "--zone", "z", "--name"], "option --name needs a value"),
    ("tpu_vm.sh", ["delete", "--name", "--zone", "z"], "option --name needs a value"),
    ("tpu_vm.sh", ["delete", *TPU, "--spot=yes"], "option --spot takes no value"),
    ("tpu_vm.sh", ["delete", *TPU, "--", "ls"], "'delete' takes no job command"),
    ("tpu_vm.sh", ["ssh", *TPU, "--worker", "one"], "--worker must be"),
    ("tpu_vm.sh", ["setup", *TPU, "--python", "python3; rm -rf /"], "--python must"),
    ("gpu_vm.sh", ["create", *GPU, "--hosts", "0"], "--hosts must be an integer >= 1"),
    ("gpu_vm.sh", ["ssh", *GPU, "--hosts", "2", "--worker", "2"], "--worker must be a host index below --hosts (2)"),
    ("gpu_vm.sh", ["run", *GPU, "--port", "70000", "--", "ls"], "--port must be at most 65535"),
    ("gpu_vm.sh", ["run", *GPU], "missing job command"),
    ("gpu_vm.sh", ["run", "--zone", "z", "--", "ls"], "missing --name"),
    ("gpu_vm.sh", ["launch", *GPU], "unknown subcommand 'launch'"),
    ("local.sh", ["--fake-devices", "0"], "--fake-devices must be an integer >= 1"),
    ("local.sh", ["python", "-m", "blockspec_jax.run"], "unexpected argument 'python'"),
    ("local.sh", ["--nope"], "unknown option --nope"),
]


@pytest.mark.parametrize("script,args,message", ERRORS, ids=[f"{s}:{' '.join(a)}" for s, a, _ in ERRORS])
@pytest.mark.parametrize("mode", ["run", "dry-run"])
def test_bad_input_is_one_line_and_exit_status_2(empty_bin, script, args, message, mode):
  result = launch(script, *(with_dry_run(args) if mode == "dry-run" else args), path=empty_bin)
  assert result.returncode == 2, (result.stdout, result.stderr)
  assert result.stdout == ""
  assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{script}: error: "), result.stderr
  assert message in result.stderr


@pytest.mark.parametrize("script,args", [
    ("tpu_vm.sh", ["create", *TPU, "--accelerator-type", "v4-8"]), ("tpu_vm.sh", ["setup", *TPU]),
    ("tpu_vm.sh", ["run", *TPU, "--accelerator-type", "v4-32", "--", *SUITE]), ("tpu_vm.sh", ["fetch", *TPU]),
    ("tpu_vm.sh", ["ssh", *TPU]), ("tpu_vm.sh", ["delete", *TPU]),
    ("gpu_vm.sh", ["create", *GPU]), ("gpu_vm.sh", ["setup", *GPU]), ("gpu_vm.sh", ["run", *GPU, "--", *SUITE]),
    ("gpu_vm.sh", ["fetch", *GPU]), ("gpu_vm.sh", ["ssh", *GPU]), ("gpu_vm.sh", ["delete", *GPU, "--hosts", "2"])])
def test_without_gcloud_the_scripts_stop_before_running_anything(empty_bin, script, args):
  result = launch(script, *args, path=empty_bin)
  assert result.returncode == 1
  assert result.stdout == ""
  error = [line for line in result.stderr.splitlines() if ": error: " in line]
  assert error == [f"{script}: error: gcloud not found on PATH: install the Google Cloud CLI "
                   "(https://cloud.google.com/sdk/docs/install), run 'gcloud init', or add --dry-run to print the "
                   "commands without running them"]
  assert "+ " not in result.stderr  # nothing was run


@pytest.fixture
def fake_gcloud(tmp_path):
  """A PATH whose gcloud records its arguments (NUL-separated, one file per call) in the directory returned, and
  exits with $FAKE_GCLOUD_STATUS."""
  bin_dir, log = tmp_path / "bin", tmp_path / "calls"
  bin_dir.mkdir()
  log.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(f"#!{BASH}\nprintf '%s\\0' \"$@\" > \"$GCLOUD_LOG/$BASHPID\"\nexit \"${{FAKE_GCLOUD_STATUS:-0}}\"\n")
  gcloud.chmod(0o755)
  return str(bin_dir), log


def recorded(log: pathlib.Path) -> list[list[str]]:
  return sorted(["gcloud", *f.read_text().split("\0")[:-1]] for f in log.iterdir())


def test_the_scripts_run_exactly_what_dry_run_prints(empty_bin, fake_gcloud):
  path, log = fake_gcloud
  env = {"GCLOUD_LOG": str(log)}
  args = ["run", *TPU, "--accelerator-type", "v4-32", "--", *GAMMA_JOB]
  printed = dry("tpu_vm.sh", *args, path=empty_bin)
  result = launch("tpu_vm.sh", *args, path=path, extra_env=env)
  assert result.returncode == 0, result.stderr
  assert recorded(log) == [shlex.split(printed[0])]
  assert f"+ {printed[0]}\n" in result.stderr

  for f in log.iterdir():
    f.unlink()
  args = ["run", *GPU, "--hosts", "3", "--", *GAMMA_JOB]
  printed = dry("gpu_vm.sh", *args, path=empty_bin)
  result = launch("gpu_vm.sh", *args, path=path, extra_env=env)
  assert result.returncode == 0, result.stderr
  assert recorded(log) == sorted(shlex.split(line.removesuffix(" &")) for line in printed[:-1])
  assert len(printed) == 4 and printed[-1] == "wait"


def test_a_failing_gcloud_fails_the_script(fake_gcloud):
  path, log = fake_gcloud
  env = {"GCLOUD_LOG": str(log), "FAKE_GCLOUD_STATUS": "3"}
  assert launch("tpu_vm.sh", "delete", *TPU, path=path, extra_env=env).returncode == 3
  result = launch("gpu_vm.sh", "run", *GPU, "--hosts", "2", "--", *SUITE, path=path, extra_env=env)
  assert result.returncode == 1
  assert "gpu_vm.sh: error: 2 of the background commands failed" in result.stderr


@pytest.fixture
def fake_remote(tmp_path):
  """A PATH whose gcloud plays the remote host for `ssh … --command C`: it runs C with bash in a fake home that holds
  ~/blockspec_jax/.venv/bin/activate (empty), as the login shell of a worker would."""
  home, bin_dir = tmp_path / "home", tmp_path / "bin"
  (home / "blockspec_jax" / ".venv" / "bin").mkdir(parents=True)
  (home / "blockspec_jax" / ".venv" / "bin" / "activate").write_text("")
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(f"#!{BASH}\nwhile (($#)) && [[ $1 != --command ]]; do shift; done\n"
                    f"cd {shlex.quote(str(home))} && exec {BASH} -c \"$2\"\n")
  gcloud.chmod(0o755)
  return f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def test_the_remote_shell_gets_the_job_words_and_the_multihost_environment(fake_remote):
  job = ["printf", "<%s>\\n", "run_job.gamma = 6", "suite.out_dir = 'a b'", "$HOME", "${BLOCKSPEC_JAX_MULTIHOST:-unset}"]
  show = ["&&", "printenv", "BLOCKSPEC_JAX_MULTIHOST"]  # literal words of the job, not shell syntax
  result = launch("tpu_vm.sh", "run", *TPU, "--accelerator-type", "v4-32", "--", *job, *show, path=fake_remote)
  assert result.returncode == 0, result.stderr
  assert result.stdout == ("<run_job.gamma = 6>\n<suite.out_dir = 'a b'>\n<$HOME>\n<${BLOCKSPEC_JAX_MULTIHOST:-unset}>\n"
                           "<&&>\n<printenv>\n<BLOCKSPEC_JAX_MULTIHOST>\n")
  env_job = ["bash", "-c", 'printf "%s|%s|%s|%s\\n" "${BLOCKSPEC_JAX_MULTIHOST:-unset}" "${JAX_COORDINATOR_ADDRESS:-}" '
             '"${JAX_NUM_PROCESSES:-}" "${JAX_PROCESS_ID:-}"']
  one_host = launch("tpu_vm.sh", "run", *TPU, "--accelerator-type", "v4-8", "--", *env_job, path=fake_remote)
  assert one_host.returncode == 0 and one_host.stdout == "unset|||\n", one_host.stderr
  slice_ = launch("tpu_vm.sh", "run", *TPU, "--accelerator-type", "v4-32", "--", *env_job, path=fake_remote)
  assert slice_.returncode == 0 and slice_.stdout == "1|||\n", slice_.stderr
  hosts = launch("gpu_vm.sh", "run", *GPU, "--hosts", "3", "--", *env_job, path=fake_remote)
  assert hosts.returncode == 0, hosts.stderr
  assert sorted(hosts.stdout.splitlines()) == [f"1|g-0:8476|3|{i}" for i in range(3)]


def test_the_remote_install_command_is_valid_shell(empty_bin):
  for script in ("tpu_vm.sh", "gpu_vm.sh"):
    install = shlex.split(dry(script, "setup", "--name", "n", "--zone", "z", path=empty_bin)[-1])[-1]
    subprocess.run([BASH, "-n", "-c", install], check=True, timeout=60)

@pytest.mark.parametrize("script", SCRIPTS)
def test_help(empty_bin, script):
  for flag in ("--help", "-h"):
    result = launch(script, flag, path=empty_bin)
    assert result.returncode == 0 and result.stdout.startswith(f"Usage: launch/{script}") and "--dry-run" in result.stdout


def test_scripts_work_from_any_directory(empty_bin, tmp_path):
  env = {"PATH": empty_bin}
  for cwd, script in ((LAUNCH, "tpu_vm.sh"), (LAUNCH, "./local.sh"), (tmp_path, str(LAUNCH / "gpu_vm.sh"))):
    result = subprocess.run([BASH, script, "fetch", *TPU, "--dry-run"] if "local" not in script else
                            [BASH, script, "--dry-run"], capture_output=True, text=True, env=env, cwd=str(cwd),
                            timeout=60)
    assert result.returncode == 0 and result.stdout, (script, result.stderr)

def test_scripts_are_valid_bash():
  for script in (*SCRIPTS, "common.sh"):
    subprocess.run([BASH, "-n", str(LAUNCH / script)], check=True, timeout=60)


def doc_commands() -> list[str]:
  """The launch/ command lines of the code blocks of docs/LAUNCH.md (backslash continuations joined)."""
  commands, in_block, pending = [], False, ""
  for line in DOC.read_text().splitlines():
    if line.strip().startswith("```"):
      in_block = not in_block
      continue
    if not in_block:
      continue
    line = pending + line.strip()
    pending = ""
    if line.endswith("\\"):
      pending = line[:-1] + " "
      continue
    if line.startswith("launch/"):
      commands.append(line)
  return commands


def test_every_command_in_the_walkthrough_is_accepted(empty_bin):
  commands = doc_commands()
  scripts = {shlex.split(c)[0] for c in commands}
  assert scripts == {f"launch/{s}" for s in SCRIPTS}, scripts
  for command in commands:
    argv = shlex.split(command, comments=True)
    if "--dry-run" not in argv:
      argv = with_dry_run(argv)
    result = launch(argv[0].removeprefix("launch/"), *argv[1:], path=empty_bin)
    assert result.returncode == 0, (command, result.stderr)
    assert result.stdout


def test_every_gin_file_the_walkthrough_names_exists():
  names = re.findall(r"--gin_file[ =]+['\"]?([^\s'\"`]+)", DOC.read_text())
  checked = [n for n in names if not n.startswith("gin/eval/")]  # the eval suites are being written beside this
  assert checked, "docs/LAUNCH.md names no gin file outside gin/eval/"
  missing = [n for n in checked if not (REPO / n).is_file()]
  assert not missing, missing


def doc_blocks() -> list[tuple[str, str]]:
  """The fenced code blocks of docs/LAUNCH.md in order: (language, text)."""
  blocks, current = [], None
  for line in DOC.read_text().splitlines():
    fence = line.strip()
    if fence.startswith("```"):
      if current is None:
        current = (fence[3:], [])
      else:
        blocks.append((current[0], "".join(l + "\n" for l in current[1])))
        current = None
    elif current is not None:
      current[1].append(line.strip())
  return blocks


def test_the_dry_run_listings_in_the_walkthrough_are_what_the_scripts_print(empty_bin):
  blocks = doc_blocks()
  shown = 0
  for (language, text), following in zip(blocks, blocks[1:] + [("", "")]):
    lines = text.splitlines()
    if language == "bash" and len(lines) == 1 and "--dry-run" in lines[0]:
      argv = shlex.split(lines[0])
      result = launch(argv[0].removeprefix("launch/"), *argv[1:], path=empty_bin)
      assert following[0] == "text", f"no listing after {lines[0]!r}"
      assert result.returncode == 0 and result.stdout == following[1], lines[0]
      shown += 1
  assert shown >= 2
