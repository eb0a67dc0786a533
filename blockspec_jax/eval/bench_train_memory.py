"""What repeated checkpoint saves cost in resident memory, under glibc's defaults and under
:func:`blockspec_jax.runtime.limit_heap_growth`, side by side in one run.

    python -m blockspec_jax.eval.bench_train_memory [--arrays 96] [--mib 8] [--saves 8] [--json PATH]

Each mode runs in a process of its own (the allocator's settings are process-wide): a training state of ``arrays``
float32 parameters of ``mib`` MiB each with AdamW's two moments (3 × arrays × mib MiB in all, the size of a
0.5B model's layers), saved ``saves`` times with the training jobs' checkpoint manager (orbax, synchronous, 2 kept).
Modes: ``glibc defaults``; ``mmap threshold`` (blocks of 1 MiB and more mapped on their own, glibc's per-thread arenas
left at their default, 8 per core); ``limit_heap_growth`` (the threshold and one arena: what the training command
sets). Prints the resident set after the state is built and after every save, and each mode's peak; the figure that
matters is the growth from the first save to the last, which a long run pays on every save.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

__all__ = ["MODES", "measure", "main"]

#: mode -> (environment additions, whether the child calls ``runtime.limit_heap_growth``)
MODES = {
    "glibc defaults": ({}, False),
    "mmap threshold": ({"MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1))}, True),
    "limit_heap_growth": ({}, True),
}

_CHILD = """
import json, pathlib, sys
arrays, mib, saves, workdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
from blockspec_jax import runtime
if sys.argv[4] == "1":
  runtime.limit_heap_growth()
import jax
from blockspec_jax.train import checkpoints, trainer
shape = (mib * 256, 1024)
init = {f"w{i}": jax.random.normal(jax.random.key(i), shape) for i in range(arrays)}
state = trainer.init_state(init, trainer.make_optimizer("adamw", 1e-3, "constant"))
jax.block_until_ready(state)
manager = checkpoints.make_manager(pathlib.Path(workdir) / "checkpoints", 2, 1)
rows = [runtime.resident_gb()]
for step in range(1, saves + 1):
  checkpoints.save(manager, step, state)
  rows.append(runtime.resident_gb())
print(json.dumps({"resident_gb": rows, "peak_gb": runtime.peak_rss_gb()}))
"""


def measure(mode: str, arrays: int, mib: int, saves: int) -> dict:
  """One mode in a fresh process: ``{"resident_gb": [after the state, after save 1, ...], "peak_gb": ...}``."""
  extra, limit = MODES[mode]
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  env.update(extra)
  with tempfile.TemporaryDirectory() as workdir:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(arrays), str(mib), str(saves), "1" if limit else "0",
                           workdir], capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    raise RuntimeError(f"the {mode!r} process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _positive(text: str) -> int:
  """An argparse type: ``checks.check_int``'s rule (an integer >= 1) and its message."""
  from blockspec_jax.checks import check_int
  return check_int(int(text), "the value", error=argparse.ArgumentTypeError)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_train_memory", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--arrays", type=_positive, default=96, help="parameter arrays (default 96)")
  parser.add_argument("--mib", type=_positive, default=8, help="MiB per parameter array (default 8)")
  parser.add_argument("--saves", type=_positive, default=8, help="checkpoint saves (default 8)")
  parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
  args = parser.parse_args(argv)
  state_gb = 3 * args.arrays * args.mib * 2**20 / 1e9
  print(f"state: {args.arrays} arrays x {args.mib} MiB x 3 (AdamW) = {state_gb:.2f} GB; {args.saves} saves per mode")
  report = {"arrays": args.arrays, "mib": args.mib, "saves": args.saves, "state_gb": state_gb, "modes": {}}
  for mode in MODES:
    print(f"{mode}: running …", file=sys.stderr, flush=True)
    result = measure(mode, args.arrays, args.mib, args.saves)
    rows = result["resident_gb"]
    result["growth_gb"] = rows[-1] - rows[1]
    report["modes"][mode] = result
    print(f"{mode:>18}: resident {' '.join(f'{r:.2f}' for r in rows)} GB; peak {result['peak_gb']:.2f} GB; "
          f"growth from save 1 to save {args.saves}: {result['growth_gb']:+.2f} GB")
  base = report["modes"]["glibc defaults"]["peak_gb"]
  for mode, result in report["modes"].items():
    print(f"{mode:>18}: peak / glibc defaults' = {result['peak_gb'] / base:.3f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
