"""The main job on 1, 2, 4 and 8 devices, side by side in one run: compile counts and decode speed per mesh.

    python -m blockspec_jax.eval.bench_mesh [--gin_file gin/bench/mesh_smollm2.gin] [--gin_param "bench_mesh.devices = (1, 8)"]

For each device count ``n`` of ``devices`` the main job (``run_job`` with the bindings of ``gin_file``) runs in its
own process on a ``(n, 1)`` mesh (every device over ``data``, ``job_config.Models.mesh``); on a CPU the devices are
fake ones (``--xla_force_host_platform_device_count``) that share this machine's cores, so the figures show the
overhead of the sharded programs, not a scaling (2 cores cannot scale to 8 devices). Per device count and row of the
job: the programs the whole job compiled (``programs_compiled``: the same at every count when nothing recompiles per
call; each row's ``compiles_while_timed`` must be 0), the decode tokens/s and its ratio to one device's, and whether the
row's token ids equal one device's. Writes a JSON report with every job's rows.
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

__all__ = ["bench_mesh_job", "device_env", "compare", "format_table", "main"]


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


@gin.configurable("bench_mesh")
def bench_mesh_job(devices=(1, 2, 4, 8), job_gin_file: str = "gin/runs/smollm2_self.gin", job_params=(),
                   output_json: str | None = "results/bench_mesh.json", timeout_s: float = 1800.0) -> dict:
  """Run the main job of ``job_gin_file`` (plus the gin bindings ``job_params``, e.g. ``("run_job.num_prompts =
  8",)``) once per device count of ``devices``, each in its own process on a ``(n, 1)`` mesh, and print the table
  (:func:`format_table`); returns the report (written to ``output_json``)."""
  devices = tuple(devices) if isinstance(devices, (tuple, list)) else devices
  if not isinstance(devices, tuple) or not devices or not all(
      isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in devices):
    raise checks.UsageError(f"bench_mesh.devices must be a tuple of device counts >= 1, got {devices!r}")
  if not pathlib.Path(job_gin_file).is_file():
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
  lines = compare(reports)
  print(format_table(lines))
  report = dict(job_gin_file=job_gin_file, job_params=list(job_params), devices=list(devices), lines=lines,
                jobs={str(n): {k: v for k, v in r.items() if k != "sample_text"} for n, r in reports.items()})
  if output_json:
    print(f"wrote {runtime.write_report(output_json, report)}")
  return report


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.eval.bench_mesh", __doc__, bench_mesh_job, argv)


if __name__ == "__main__":
  sys.exit(main())
