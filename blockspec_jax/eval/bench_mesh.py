"""The main job on 1, 2, 4 and 8 devices, side by side in one run: compile counts and decode speed per mesh; and the
other jobs' compile counts on 1 and 8 devices.

    python -m blockspec_jax.eval.bench_mesh [--gin_file gin/bench/mesh_smollm2.gin] [--gin_param "bench_mesh.devices = (1, 8)"]

For each device count ``n`` of ``devices`` the main job (``run_job`` with the bindings of ``gin_file``) runs in its
own process on a ``(n, 1)`` mesh (every device over ``data``, ``job_config.Models.mesh``); on a CPU the devices are
fake ones (``--xla_force_host_platform_device_count``) that share this machine's cores, so the figures show the
overhead of the sharded programs, not a scaling (2 cores cannot scale to 8 devices). Per device count and row of the
job: the programs the whole job compiled (``programs_compiled``: the same at every count when nothing recompiles per
call; each row's ``compiles_while_timed`` must be 0), the decode tokens/s and its ratio to one device's, and whether the
row's token ids equal one device's. With ``compile_jobs`` (``gin/bench/mesh_jobs.gin``), the smoke suite,
``eval.paired`` and the distillation smoke job each run on every count of ``compile_devices`` in a process of their
own: the programs each compiled, those compiled after a program's first use, and whether its numbers match. Writes a
JSON report with every job's rows.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import gin

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax import runtime

__all__ = ["bench_mesh_job", "device_env", "compare", "format_table", "COMPILE_JOBS", "compile_counts",
           "format_compile_table", "main"]


def device_env(devices: int, base: dict | None = None) -> dict:
  """``base`` (default ``os.environ``) with ``devices`` fake CPU devices in ``XLA_FLAGS`` (a device count already
  there replaced) and ``JAX_PLATFORMS=cpu``."""
  base = dict(os.environ if base is None else base)
  flags = [f for f in base.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  return dict(base, XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
              JAX_PLATFORMS="cpu")


def compare(reports: dict[int, dict]) -> list[dict]:
  """One line per device count and report row: ``devices``, ``row`` (``<method>@T=<t>``), ``programs_compiled`` of the
  job, ``compiles_while_timed``, ``decode_tokens_per_s``, ``tokens_per_s``, their ratios to the smallest device
  count's same row, and ``same_tokens`` (the row's token ids equal that count's)."""
  first = reports[min(reports)]
  base_rows = {f"{r['method']}@T={r['temperature']}": r for r in first["results"]}
  lines = []
  for devices in sorted(reports):
    report = reports[devices]
    for r in report["results"]:
      row = f"{r['method']}@T={r['temperature']}"
      base = base_rows[row]
      lines.append(dict(devices=devices, mesh=report.get("mesh"), row=row,
                        programs_compiled=report.get("programs_compiled"),
                        compiles_while_timed=r["compiles_while_timed"],
                        decode_tokens_per_s=r["decode_tokens_per_s"], tokens_per_s=r["tokens_per_s"],
                        decode_ratio=r["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                        ratio=r["tokens_per_s"] / base["tokens_per_s"],
                        block_efficiency=r.get("block_efficiency"),
                        same_tokens=report["generated_ids"][row] == first["generated_ids"][row]))
  return lines


def format_table(lines: list[dict]) -> str:
  header = (f"{'devices':>7} {'mesh':>6} {'row':<22} {'compiled':>8} {'timed':>5} {'BE':>5} {'dec tok/s':>9} "
            f"{'x 1 dev':>7} {'tok/s':>7} {'x 1 dev':>7} {'same ids':>8}")
  out = [header, "-" * len(header)]
  for x in lines:
    mesh = "x".join(map(str, x["mesh"])) if x["mesh"] else "-"
    be = f"{x['block_efficiency']:5.2f}" if x["block_efficiency"] is not None else "    -"
    out.append(f"{x['devices']:>7} {mesh:>6} {x['row']:<22} {x['programs_compiled']!s:>8} "
               f"{x['compiles_while_timed']:>5} {be} {x['decode_tokens_per_s']:>9.2f} {x['decode_ratio']:>6.2f}x "
               f"{x['tokens_per_s']:>7.2f} {x['ratio']:>6.2f}x {'yes' if x['same_tokens'] else 'NO':>8}")
  out.append("compiled: programs the whole job compiled (load to report); timed: programs compiled inside a row's "
             "timed calls (0: nothing recompiles per call); x 1 dev: against the first device count's same row; "
             "same ids: the row's token ids equal the first device count's. Fake CPU devices share the machine's "
             "cores: the ratios show the sharded programs' overhead, not a scaling.")
  return "\n".join(out)


#: Runs one job's ``main(argv)`` in this process and writes ``{"rc", "programs_compiled"}`` (every program XLA compiled
#: in the process, the job's whole run) to the file named by the second argument.
_DRIVER = """
import importlib, json, sys
from blockspec_jax import runtime
runtime.backend_compiles()
module, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
rc = importlib.import_module(module).main(argv)
json.dump({"rc": rc, "programs_compiled": runtime.backend_compiles()}, open(out, "w"))
"""


def _suite_job(n: int, tmp: pathlib.Path):
  """The smoke suite (two categories) on ``(n, 1)``: its rows' programs compiled inside timed calls, and every
  row's target calls and tokens (the numbers a layout must not change)."""
  argv = ["--gin_file", "gin/eval/smoke.gin"]
  for p in (f"suite.mesh = ({n}, 1)", f"suite.out_dir = {str(tmp / 'suite')!r}", "suite.plots = False",
            "suite.progress = False", "suite.compilation_cache = 'off'", "suite.tasks = ('code', 'math')"):
    argv += ["--gin_param", p]

  def read():
    rows = [r for r in json.loads((tmp / "suite" / "results.json").read_text())["results"] if r["task"] != "all"]
    return (sum(r["compiles_while_timed"] for r in rows),
            {f"{r['method']}@{r['task']}": [r["target_calls"], r["tokens_generated"]] for r in rows})
  return "blockspec_jax.eval.suite", argv, read


def _paired_job(n: int, tmp: pathlib.Path):
  """``eval.paired`` (SmolLM2 drafting for itself, 2 prompts × 2 positions, γ ≤ 3) with ``--mesh nx1``: its table's
  block efficiencies (no per-call count: one scoring program per length bucket)."""
  argv = ["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--num-prompts", "2", "--sample-tokens", "8",
          "--positions", "2", "--gamma", "3", "--draws", "2", "--json", str(tmp / "paired.json"), "--mesh", f"{n}x1"]

  def read():
    summary = json.loads((tmp / "paired.json").read_text())["summary"]
    return None, [[s["gamma"], s["be"]["token"], s["be"]["block"]] for s in summary]
  return "blockspec_jax.eval.paired", argv, read


def _distill_job(n: int, tmp: pathlib.Path):
  """The distillation smoke job (tiny random pair, 20 steps) on ``(n, 1)``: programs compiled inside the steps after
  each fit's first (``metrics.jsonl``'s ``programs_compiled``) and the last loss."""
  argv = ["--gin_file", "gin/train/distill_smoke.gin", "--workdir", str(tmp / "distill"),
          "--gin_param", "distill_job.num_steps = 20", "--gin_param", "distill_job.progress = False",
          "--gin_param", f"distill_job.mesh = ({n}, 1)"]

  def read():
    rows = [json.loads(line) for line in (tmp / "distill" / "metrics.jsonl").read_text().splitlines() if line]
    return sum(r["programs_compiled"] for r in rows[1:]), rows[-1]["loss"]
  return "blockspec_jax.train.__main__", argv, read


#: The jobs whose compile counts :func:`bench_mesh_job` measures beside the main job (``compile_jobs``).
COMPILE_JOBS = {"suite": _suite_job, "paired": _paired_job, "distill": _distill_job}


def compile_counts(jobs, devices, timeout_s: float) -> list[dict]:
  """Each job of ``jobs`` (names of :data:`COMPILE_JOBS`) on each device count, in its own process: ``job``,
  ``devices``, ``programs_compiled`` (the whole run), ``after_first`` (programs compiled after each program's first
  use: the suite's timed calls, distillation's later steps; None where the job has no repeated call) and ``same``
  (its numbers equal the first device count's: counts exactly, floats to 1e-5 relative)."""
  lines = []
  for job in jobs:
    first = None
    for n in devices:
      with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        module, argv, read = COMPILE_JOBS[job](n, tmp)
        print(f"bench_mesh: {job} on {n} device(s) ...", flush=True)
        proc = subprocess.run([sys.executable, "-c", _DRIVER, module, str(tmp / "driver.json"), *argv],
                              env=device_env(n), capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
          raise RuntimeError(f"{job} on {n} device(s) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        driver = json.loads((tmp / "driver.json").read_text())
        after_first, numbers = read()
      first = numbers if first is None else first
      lines.append(dict(job=job, devices=n, programs_compiled=driver["programs_compiled"], after_first=after_first,
                        numbers=numbers, same=_same(numbers, first)))
  return lines


def _same(a, b, rel: float = 1e-5) -> bool:
  """``a`` equals ``b``: integers, strings and structure exactly, floats to ``rel`` (float32 sums split over
  devices round differently)."""
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k], rel) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
  if isinstance(a, float) or isinstance(b, float):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)
  return a == b


def format_compile_table(lines: list[dict]) -> str:
  header = f"{'job':<8} {'devices':>7} {'compiled':>8} {'after first use':>15} {'same numbers':>12}"
  out = [header, "-" * len(header)]
  for x in lines:
    after = "-" if x["after_first"] is None else x["after_first"]
    out.append(f"{x['job']:<8} {x['devices']:>7} {x['programs_compiled']:>8} {after!s:>15} "
               f"{'yes' if x['same'] else 'NO':>12}")
  out.append("compiled: programs XLA compiled in the job's process, start to end; after first use: programs compiled "
             "inside the suite's timed calls / distillation's steps after the first (0: nothing recompiles per call; "
             "-: the job repeats no call); same numbers: the suite's target calls and tokens per row exactly, the "
             "paired table's block efficiencies and distillation's last loss to 1e-5 relative, against the first "
             "device count's (float32 sums split over devices round differently).")
  return "\n".join(out)


def _device_counts(value, name: str, allow_empty: bool = False) -> tuple:
  value = tuple(value) if isinstance(value, (tuple, list)) else value
  if not isinstance(value, tuple) or (not value and not allow_empty) or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value):
    raise checks.UsageError(f"bench_mesh.{name} must be a tuple of device counts >= 1, got {value!r}")
  return value


@gin.configurable("bench_mesh")
def bench_mesh_job(devices=(1, 2, 4, 8), job_gin_file: str = "gin/runs/smollm2_self.gin", job_params=(),
                   output_json: str | None = "results/bench_mesh.json", timeout_s: float = 1800.0,
                   compile_jobs=(), compile_devices=(1, 8)) -> dict:
  """Run the main job of ``job_gin_file`` (plus the gin bindings ``job_params``, e.g. ``("run_job.num_prompts =
  8",)``) once per device count of ``devices`` (``()``: not at all), each in its own process on a ``(n, 1)`` mesh, and
  print the table (:func:`format_table`); then each job of ``compile_jobs`` (``"suite"``, ``"paired"``,
  ``"distill"``: :data:`COMPILE_JOBS`) on each of ``compile_devices`` (:func:`compile_counts`,
  :func:`format_compile_table`). Returns the report (written to ``output_json``)."""
  devices = _device_counts(devices, "devices", allow_empty=bool(compile_jobs))
  compile_devices = _device_counts(compile_devices, "compile_devices")
  compile_jobs = tuple(compile_jobs)
  unknown = [j for j in compile_jobs if j not in COMPILE_JOBS]
  if unknown:
    raise checks.UsageError(f"bench_mesh.compile_jobs: unknown job(s) {unknown}; known: {sorted(COMPILE_JOBS)}")
  if devices and not pathlib.Path(job_gin_file).is_file():
    raise checks.UsageError(f"bench_mesh.job_gin_file: no gin file {job_gin_file!r}")
  runtime.check_output_file(output_json, "the report (output_json)")
  reports = {}
  with tempfile.TemporaryDirectory() as tmp:
    for n in devices:
      out = pathlib.Path(tmp) / f"run_{n}.json"
      params = [*job_params, f"run_job.mesh = ({n}, 1)", f"run_job.output_json = {str(out)!r}",
                "run_job.show_text = False", "run_job.compilation_cache = 'off'"]
      command = [sys.executable, "-m", "blockspec_jax.run", "--gin_file", job_gin_file]
      for p in params:
        command += ["--gin_param", p]
      print(f"bench_mesh: the main job on {n} device(s) ...", flush=True)
      proc = subprocess.run(command, env=device_env(n), capture_output=True, text=True, timeout=timeout_s)
      if proc.returncode != 0:
        raise RuntimeError(f"the main job on {n} device(s) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
      reports[n] = json.loads(out.read_text())
  lines = compare(reports) if reports else []
  if lines:
    print(format_table(lines))
  compiled = compile_counts(compile_jobs, compile_devices, timeout_s)
  if compiled:
    print(format_compile_table(compiled))
  report = dict(job_gin_file=job_gin_file, job_params=list(job_params), devices=list(devices), lines=lines,
                jobs={str(n): {k: v for k, v in r.items() if k != "sample_text"} for n, r in reports.items()},
                compile_jobs=compiled)
  if output_json:
    print(f"wrote {runtime.write_report(output_json, report)}")
  return report


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.eval.bench_mesh", __doc__, bench_mesh_job, argv)


if __name__ == "__main__":
  sys.exit(main())
