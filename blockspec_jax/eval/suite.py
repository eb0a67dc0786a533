"""Evaluation suites: methods × γ × temperature over the task categories of a prompt set, in one gin-configured run.

    python -m blockspec_jax.eval.suite --gin_file gin/eval/block_vs_token.gin [--gin_param "suite.gammas = (2, 4)"]

A suite decodes every prompt of every category (``task`` of the prompt rows: code, chat, math, …) with each method
(``"autoregressive"``, any registered verifier, ``"<verifier>@<drafter>"``; see ``methods_lib.parse_method``) at each γ and
temperature, on one target and drafter, at batch 1, through the same timed phases as the main job
(``harness.run_method``). Prompts of all categories are padded to one width rounded up to ``width_bucket`` tokens, so a
suite compiles one program per (method, γ, temperature), whatever its categories, and suites whose prompts fall in
the same bucket share compiled programs (with the persistent compilation cache). Every category of a method starts
from the same seed, so methods are compared on the same prompts and keys. The first category of each program runs
its first prompt's prefill once untimed and compiles the decode program on a finished state (no extra decode);
the others reuse the compiled programs. Rows that run the same prefill (autoregressive decoding at every
temperature; the methods sharing a drafter at one γ) compute each prompt's prefill once and each count its measured
time (``harness.PrefillCache``; ``suite.share_prefills = False`` times every row's own): the suite runs them one after
the other, and writes its rows in the grid's order.

Each run writes a directory (``suite.out_dir``; default ``results/suites/<name>-<UTC time>``):

* ``config.gin``: the resolved gin configuration (every binding in force, defaults included);
* ``results.json``: settings, environment, prompts (id, task, source, licence) and one row per category × method ×
  γ × temperature (``ROW_FIELDS`` and the per-position acceptance), plus an ``all`` row over every category;
* ``results.csv``: the same rows, one line each (per-position acceptance as ``;``-separated numbers);
* ``be_vs_gamma.png``, ``speedup_vs_gamma.png`` (one panel per category, a line per method and temperature),
  ``acceptance_per_position.png`` (per category, each method at its largest γ), with matplotlib; with fidelity
  measured (``suite.fidelity``; by default when a lossy rule is in the grid), ``tradeoff.png``: speedup against the
  shift of the target's mean log-likelihood of the emitted tokens from autoregressive sampling (``mean_logp``,
  ``delta_logp_vs_ar``; :mod:`blockspec_jax.eval.fidelity`), one point per method, γ and temperature: lossless rules
  sit at 0 up to sampling noise, a lossy rule's shift is its bias;
* ``report.md``: the settings, a table per category and the plots, for a person to read.

Only process 0 of a multi-host run writes (``runtime.is_main_process``).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import pathlib
import platform
import sys
import time
from typing import Any

import gin
import jax
import numpy as np

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax import job_config
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax.eval import fidelity as fidelity_lib
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval.suite_plots import write_plots

__all__ = ["SuiteSettings", "suite_job", "load_suite_prompts", "ROW_FIELDS", "write_csv", "write_plots",
           "write_markdown", "bucket_width", "main"]

#: The columns of ``results.csv`` (and of every row of ``results.json``), in order.
ROW_FIELDS = ("task", "method", "gamma", "draft_nodes", "temperature", "top_k", "top_p", "lossy", "prompts",
              "tokens_generated", "target_calls", "target_calls_per_token", "block_efficiency",
              "draft_acceptance_rate", "wall_s", "tokens_per_s", "speedup", "prefill_s", "decode_tokens_per_s",
              "decode_speedup", "peak_rss_gb", "compiles_while_timed", "mean_logp", "delta_logp_vs_ar",
              "acceptance_per_position")
ALL_TASKS = "all"
#: Names of the shipped prompt files (``suite.prompts``); anything else is a path.
SHIPPED_PROMPTS = prompts_lib.SHIPPED_PROMPTS


def bucket_width(width: int, bucket: int) -> int:
  """``width`` rounded up to a multiple of ``bucket`` (the padded prompt width every program of a suite shares)."""
  if bucket < 1:
    raise checks.UsageError(f"width_bucket must be >= 1, got {bucket}")
  return -(-width // bucket) * bucket


def _pooled(rows: list[dict]) -> dict:
  """One row over several categories' rows of one method, γ and temperature: sums of tokens, calls and times, and
  their ratios (tokens-weighted, as if the categories had been one prompt set)."""
  out = {k: rows[0][k] for k in ("method", "gamma", "temperature", "top_k", "top_p", "lossy", "draft_nodes")
         if k in rows[0]}
  out["task"] = ALL_TASKS
  for k in ("prompts", "tokens_generated", "target_calls", "wall_s", "prefill_s", "decode_s", "compiles_while_timed",
            "prefills_reused"):
    out[k] = sum(r.get(k, 0) for r in rows)
  out["target_calls_per_token"] = out["target_calls"] / max(out["tokens_generated"], 1)
  out["tokens_per_s"] = out["tokens_generated"] / out["wall_s"]
  out["decode_tokens_per_s"] = out["tokens_generated"] / out["decode_s"]
  out["peak_rss_gb"] = max(r["peak_rss_gb"] for r in rows)
  if "loglik_tokens" in rows[0]:
    out["loglik_sum"] = sum(r["loglik_sum"] for r in rows)
    out["loglik_tokens"] = sum(r["loglik_tokens"] for r in rows)
    out["mean_logp"] = out["loglik_sum"] / max(out["loglik_tokens"], 1)
  if "block_efficiency" in rows[0]:
    drafts = [r["target_calls"] for r in rows]  # one target call per draft
    out["block_efficiency"] = sum(r["block_efficiency"] * d for r, d in zip(rows, drafts)) / max(sum(drafts), 1)
    drafted = [r["target_calls"] * r["draft_nodes"] for r in rows]
    out["draft_acceptance_rate"] = (sum(r["draft_acceptance_rate"] * d for r, d in zip(rows, drafted))
                                    / max(sum(drafted), 1))
    out["acceptance_per_position"] = [
        sum(r["acceptance_per_position"][i] * d for r, d in zip(rows, drafts)) / max(sum(drafts), 1)
        for i in range(len(rows[0]["acceptance_per_position"]))]
  return out


def _with_speedups(rows: list[dict]) -> None:
  """``speedup`` / ``decode_speedup``: tokens/s over autoregressive decoding of the same category, temperature and
  sampler (NaN where the suite has no autoregressive row); with fidelity measured, ``delta_logp_vs_ar`` likewise."""
  base = {(r["task"], r["temperature"]): r for r in rows if r["method"] == methods_lib.AUTOREGRESSIVE}
  for r in rows:
    b = base.get((r["task"], r["temperature"]))
    r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
    r["decode_speedup"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b else float("nan")
    if "mean_logp" in r:
      r["delta_logp_vs_ar"] = r["mean_logp"] - b["mean_logp"] if b else float("nan")


def write_csv(rows: list[dict], path) -> pathlib.Path:
  """``rows`` as CSV with the ``ROW_FIELDS`` columns (missing fields empty, lists ``;``-joined)."""
  path = pathlib.Path(path)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(ROW_FIELDS)
    for r in rows:
      cells = []
      for k in ROW_FIELDS:
        v = r.get(k)
        if isinstance(v, (list, tuple)):
          v = ";".join(f"{x:.6g}" for x in v)
        elif isinstance(v, float):
          v = f"{v:.6g}"
        cells.append("" if v is None else v)
      writer.writerow(cells)
  return path


def _fmt(v, spec: str) -> str:
  return "–" if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def write_markdown(report: dict, rows: list[dict], plots: list[pathlib.Path], path) -> pathlib.Path:
  """A Markdown report of a suite: settings, one table per category, the plots."""
  s = report["settings"]
  fidelity = any("mean_logp" in r for r in rows)
  lines = [f"# Suite `{report['name']}`", "",
           f"{s['target']} (target) with {s['drafter']} (drafter), {s['dtype']}; γ ∈ {list(s['gammas'])}, "
           f"T ∈ {list(s['temperatures'])}, top-k {s['top_k']}, top-p {s['top_p']}; {s['max_new_tokens']} new tokens "
           f"per prompt; seed {s['seed']}.", "",
           f"Prompts: `{s['prompts']}`, {len(report['prompts'])} rows "
           f"({', '.join(f'{t}: {n}' for t, n in report['prompts_per_task'].items())}); padded width "
           f"{report['prompt_width']} tokens.", "",
           f"Ran {report['environment']['date']} on {report['environment']['platform']} "
           f"({report['environment']['devices']}), jax {report['environment']['jax']}, "
           f"{report['wall_s'] / 60:.1f} min, peak resident memory {report['peak_rss_gb']:.2f} GB.", "",
           "N: draft nodes per target call (γ for a chain); BE: block efficiency (tokens per target call); accept: "
           "draft acceptance rate; calls/token: target calls per emitted token; speedup: tokens/s over autoregressive "
           "decoding of the same category and temperature, "
           "end to end (prefill + decode); dec: the decode phase alone. Timings are one run on this machine."
           + (" A prompt's prefill is computed once for the rows that run the same one (autoregressive decoding at "
              "every temperature, the methods sharing a drafter at one γ) and its measured time counted in each."
              if s.get("share_prefills") else "")
           + (" log p: the target's mean log-likelihood (T = 1) of the emitted tokens, Δ: its shift from "
              "autoregressive sampling (sampling noise for lossless rules, bias for lossy ones)." if fidelity else ""),
           ""]
  for task in dict.fromkeys(r["task"] for r in rows):
    lines += [f"## {task}", "",
              "| method | γ | N | T | BE | accept | calls/token | tok/s | speedup | dec speedup |"
              + (" log p | Δ log p |" if fidelity else ""),
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if fidelity else "")]
    for r in rows:
      if r["task"] != task:
        continue
      name = r["method"] + (" (lossy)" if r.get("lossy") else "")
      lines.append(f"| {name} | {_fmt(r['gamma'], 'd')} | {_fmt(r.get('draft_nodes'), 'd')} | {r['temperature']:g} | "
                   f"{_fmt(r.get('block_efficiency'), '.3f')} | {_fmt(r.get('draft_acceptance_rate'), '.3f')} | "
                   f"{r['target_calls_per_token']:.3f} | {r['tokens_per_s']:.2f} | {_fmt(r['speedup'], '.2f')}× | "
                   f"{_fmt(r['decode_speedup'], '.2f')}× |"
                   + (f" {_fmt(r.get('mean_logp'), '.4f')} | {_fmt(r.get('delta_logp_vs_ar'), '+.4f')} |"
                      if fidelity else ""))
    lines.append("")
  for p in plots:
    lines += [f"![{p.stem}]({p.name})", ""]
  path = pathlib.Path(path)
  path.write_text("\n".join(lines))
  return path


def load_suite_prompts(prompts: str) -> list[dict]:
  """The rows of ``suite.prompts``: a shipped file by name (``SHIPPED_PROMPTS``), ``"seqio:<task>[:<split>]"`` (a
  registered seqio Task or Mixture, split ``validation`` by default; the ``blockspec_*`` prompt Tasks are registered
  on demand; needs the seqio extra), or a JSONL file's path."""
  if str(prompts).startswith("seqio:"):
    from blockspec_jax.data import seqio_tasks
    _, name, *rest = str(prompts).split(":")
    if not name or len(rest) > 1:
      raise checks.UsageError(f"suite.prompts {prompts!r}: write seqio:<task> or seqio:<task>:<split>")
    try:
      if name.startswith(seqio_tasks.PREFIX):
        seqio_tasks.register_prompt_tasks()
      return seqio_tasks.prompts_from_seqio(name, rest[0] if rest else "validation")
    except (seqio_tasks.SeqioUnavailable, ValueError) as e:
      raise checks.UsageError(f"suite.prompts {prompts!r}: {e}") from None
  return prompts_lib.load_prompts(prompts)


def _default_out_dir(name: str) -> pathlib.Path:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
  return pathlib.Path("results") / "suites" / f"{name}-{stamp}"


@gin.configurable("suite")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteSettings(job_config.EvalSettings):
  """A suite's settings (gin: ``suite.gammas = (2, 4)``, …): the fields every evaluation job has
  (``job_config.EvalSettings``) and these; made once, they check every field (``job_config``'s groups), before a model
  loads. A suite runs one drafter (``drafter``)."""

  name: str = "suite"
  """The suite's name (in its report and default directory)."""
  prompts: str = "six"
  """``job_config.DataSettings.prompts``."""
  tasks: Any = None
  """``job_config.DataSettings.tasks``."""
  prompts_per_task: int | None = None
  """``job_config.DataSettings.prompts_per_task``."""
  methods: tuple = methods_lib.METHODS
  """``job_config.MethodGrid.methods``."""
  gammas: tuple = (4,)
  """``job_config.MethodGrid.gammas``."""
  method_gammas: dict | None = None
  """``job_config.MethodGrid.method_gammas``."""
  drafter_settings: dict | None = None
  """``job_config.MethodGrid.drafter_settings``."""
  verifier_settings: dict | None = None
  """``job_config.MethodGrid.verifier_settings``."""
  temperatures: tuple = (1.0,)
  """``job_config.SamplerSettings.temperatures``."""
  width_bucket: int = 64
  """Prompts are padded to a multiple of it, so suites whose prompts fall in one bucket share compiled programs."""
  fidelity: bool | None = None
  """Measure every row's mean target log-likelihood of its emitted tokens (:func:`run_suite`); None: when a rule of
  the grid is lossy at one of its temperatures."""
  out_dir: str | None = None
  """The suite's directory (default ``results/suites/<name>-<UTC time>``)."""
  plots: bool = True
  """``job_config.OutputSettings.plots``."""
  progress: bool = True
  """``job_config.OutputSettings.progress``."""

  def __post_init__(self):
    if not self.out_dir:  # the default directory's time, once
      object.__setattr__(self, "out_dir", str(_default_out_dir(self.name)))
    super().__post_init__()

  def groups(self) -> tuple:
    """``(models, grid, sampler, data, output)`` for :func:`run_suite` (the output directory made last, once the
    rest is checked)."""
    grid = job_config.MethodGrid(methods=self.methods, gammas=self.gammas, drafter_settings=self.drafter_settings,
                                 verifier_settings=self.verifier_settings, method_gammas=self.method_gammas)
    models, sampler = self.models(), self.sampler_settings(self.temperatures)
    data = self.data_settings(self.prompts, tasks=self.tasks, prompts_per_task=self.prompts_per_task)
    return (models, grid, sampler, data,
            job_config.OutputSettings(out_dir=str(self.out_dir), plots=self.plots, progress=self.progress))


def suite_job(**overrides) -> dict:
  """Run a suite (see the module docstring): :class:`SuiteSettings` from gin (``suite.*``) and ``overrides``, checked
  before a model loads, then :func:`run_suite`."""
  s = SuiteSettings(**overrides)
  return run_suite(s.name, *s.groups(), width_bucket=s.width_bucket, fidelity=s.fidelity,
                   share_prefills=s.share_prefills)


def run_suite(name: str, models: job_config.Models, grid: job_config.MethodGrid,
              sampler: job_config.SamplerSettings, data: job_config.DataSettings, output: job_config.OutputSettings,
              width_bucket: int = 64, fidelity: bool | None = None, share_prefills: bool = True) -> dict:
  """A suite on checked settings (one drafter): writes ``output.out_dir`` and returns the report.

  ``name``: the suite's name (in its report and default directory). ``width_bucket``: prompts are padded to a
  multiple of it, so suites whose prompts fall in one bucket share compiled programs. ``fidelity``: measure every
  row's mean target log-likelihood of its emitted tokens (one teacher-forced target pass per prompt, outside the timed
  phases) and plot speed against it; None (default): when a rule of the grid is lossy at one of its temperatures.
  ``share_prefills``: rows that run the same prefill share it, as in the main job (``run_job.share_prefills``)."""
  if len(models.drafters) != 1:
    raise checks.UsageError(f"a suite runs one drafter, got {list(models.drafters)}")
  if fidelity is None:
    fidelity = any(methods_lib.method_is_lossy(m, sampler.sampler(t), grid.verifier_settings)
                   for m in grid.methods for t in sampler.temperatures)
  tasks, by_task = _select_prompts(data)
  bucket_width(1, width_bucket)
  job_config.check_switch(share_prefills, "share_prefills")
  compile_dir = runtime.enable_compilation_cache(models.compilation_cache)
  target_model, (drafter_model,), load_s = models.load()
  mesh = models.device_mesh()
  ids = {t: prompts_lib.encode_prompts(target_model, task_rows, data.chat, data.system)
         for t, task_rows in by_task.items()}
  width = bucket_width(max(len(p) for task_ids in ids.values() for p in task_ids), width_bucket)
  methods_lib.check_methods_fit(grid.methods, grid.all_gammas, target_model, [drafter_model], width,
                                data.max_new_tokens, grid.drafter_settings, grid.verifier_settings)
  print(f"suite {name}: loaded {models.drafters[0]} → {models.target} ({models.dtype}) in {load_s:.1f} s; "
        f"{sum(map(len, by_task.values()))} prompts in {len(tasks)} categories, width {width}; jax {jax.__version__} "
        f"on {runtime.describe_devices(mesh)}; compilation cache {compile_dir or 'off'}", flush=True)
  start = time.perf_counter()
  results = _run_grid(name, grid, sampler, data, (target_model, drafter_model), ids, width, bool(fidelity),
                      harness.PrefillCache() if share_prefills else None, output.progress, mesh)
  wall = time.perf_counter() - start
  settings = dict(target=models.target, drafter=models.drafters[0], prompts=str(data.prompts), tasks=tasks,
                  prompts_per_task=data.prompts_per_task, methods=list(grid.methods), gammas=list(grid.gammas),
                  temperatures=list(sampler.temperatures), top_k=sampler.top_k, top_p=sampler.top_p,
                  max_new_tokens=data.max_new_tokens, dtype=models.dtype, seed=sampler.seed, chat=data.chat,
                  system=data.system, drafter_settings=grid.drafter_settings, verifier_settings=grid.verifier_settings,
                  method_gammas=grid.method_gammas or None, width_bucket=width_bucket, fidelity=bool(fidelity),
                  scan_layers=models.scan_layers, share_prefills=share_prefills, mesh=list(models.mesh))
  report = _report(name, settings, by_task, width, wall, output.out_dir, results)
  if runtime.is_main_process():
    _write_directory(name, report, results, output)
  return report


def _select_prompts(data: job_config.DataSettings) -> tuple[list[str], dict[str, list[dict]]]:
  """The categories to run and the first ``data.prompts_per_task`` rows of each (a :class:`UsageError` naming the
  categories the prompt set lacks)."""
  rows = load_suite_prompts(data.prompts)
  present = list(dict.fromkeys(r["task"] for r in rows))
  tasks = present if data.tasks is None else list(data.tasks)
  unknown = [t for t in tasks if t not in present]
  if unknown:
    raise checks.UsageError(f"suite: tasks {unknown} are not in {data.prompts} (it has {', '.join(present)})")
  return tasks, {t: [r for r in rows if r["task"] == t][:data.prompts_per_task] for t in tasks}


def _run_grid(name: str, grid: job_config.MethodGrid, sampler: job_config.SamplerSettings,
              data: job_config.DataSettings, pair: tuple, ids: dict[str, list], width: int, fidelity: bool,
              prefills: harness.PrefillCache | None, progress: bool, mesh=None) -> list[dict]:
  """Every run of the grid on every category of ``ids`` with the loaded ``(target, drafter)`` ``pair``: the rows, in
  the grid's order, with their speedups (and an ``all`` row per run when there are several categories)."""
  # Runs: autoregressive once per temperature (γ does not apply), every other method at every γ; categories
  # innermost, so one compiled program serves them all.
  runs = [(t, m, g) for t in sampler.temperatures for m in grid.methods for g in grid.gammas_of(m)]
  # Run them grouped by γ (autoregressive first), so rows that can share a prefill run one after the other; the
  # rows are written in the grid's order.
  order = sorted(range(len(runs)), key=lambda j: (-1 if runs[j][2] is None else runs[j][2], j))
  from tqdm.auto import tqdm
  bar = tqdm(total=len(runs) * len(ids), desc=f"suite {name}", unit="run", disable=not progress, file=sys.stderr)
  by_run = {}
  for j in order:
    per_task = _run_categories(runs[j], grid, sampler, data, pair, ids, width, fidelity, prefills, bar, mesh)
    by_run[j] = per_task + ([_pooled(per_task)] if len(ids) > 1 else [])
  bar.close()
  results = [row for j in range(len(runs)) for row in by_run[j]]
  _with_speedups(results)
  return results


def _run_categories(run: tuple, grid: job_config.MethodGrid, sampler: job_config.SamplerSettings,
                    data: job_config.DataSettings, pair: tuple, ids: dict[str, list], width: int, fidelity: bool,
                    prefills: harness.PrefillCache | None, bar, mesh=None) -> list[dict]:
  """One ``(temperature, method, γ)`` run over every category of ``ids`` (on ``mesh``: ``harness.run_method``): one
  summary row per category (the first compiles, the others reuse its programs)."""
  temperature, method, gamma = run
  target_model, drafter_model = pair
  per_task = []
  for i, (task, task_ids) in enumerate(ids.items()):
    bar.set_postfix_str(f"{method} γ={gamma} T={temperature:g} {task}")
    summary, outputs = harness.run_method(method, target_model, drafter_model, task_ids, width,
                                          gamma=gamma if gamma is not None else grid.gammas[0],
                                          max_new_tokens=data.max_new_tokens, temperature=temperature,
                                          seed=sampler.seed, stop_ids=target_model.stop_ids,
                                          drafter_settings=grid.drafter_settings,
                                          verifier_settings=grid.verifier_settings, top_k=sampler.top_k,
                                          top_p=sampler.top_p, warm=i > 0, prefills=prefills, mesh=mesh)
    summary.update(task=task, top_k=sampler.top_k, top_p=sampler.top_p, peak_rss_gb=runtime.peak_rss_gb())
    if fidelity:  # one program for every row: the shape is the bucketed width + the token budget
      total, count, _ = fidelity_lib.target_loglik(target_model, task_ids, outputs,
                                                   width=width + data.max_new_tokens, window=data.max_new_tokens)
      summary.update(loglik_sum=total, loglik_tokens=count, mean_logp=total / max(count, 1))
    per_task.append(summary)
    bar.update(1)
  return per_task


def _report(name: str, settings: dict, by_task: dict[str, list[dict]], width: int, wall: float, out: pathlib.Path,
            results: list[dict]) -> dict:
  """The suite's report (``results.json``): settings, environment, prompts and rows."""
  return dict(
      name=name,
      settings=settings,
      environment=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       jax=jax.__version__, platform=jax.devices()[0].platform,
                       devices=f"{jax.device_count()} × {jax.devices()[0].device_kind}",
                       machine=platform.machine(), processes=jax.process_count()),
      prompts=[dict(id=r["id"], task=r["task"], source=r["source"], licence=r["licence"])
               for t in by_task for r in by_task[t]],
      prompts_per_task={t: len(by_task[t]) for t in by_task}, prompt_width=width, wall_s=wall,
      peak_rss_gb=runtime.peak_rss_gb(), out_dir=str(out), results=results)


def _write_directory(name: str, report: dict, results: list[dict], output: job_config.OutputSettings) -> None:
  """Write the suite's directory: ``config.gin``, ``results.json``, ``results.csv``, the plots, ``report.md``."""
  out = output.out_dir
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.gin").write_text(gin.operative_config_str())
  runtime.write_report(out / "results.json", report)
  write_csv(results, out / "results.csv")
  written = write_plots(results, out) if output.plots else []
  write_markdown(report, results, written, out / "report.md")
  print(f"suite {name}: {len(results)} rows in {report['wall_s'] / 60:.1f} min; wrote {out}/ (report.md, "
        f"results.json, results.csv, config.gin{''.join(', ' + p.name for p in written)})", flush=True)


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.eval.suite", __doc__, suite_job, argv)


if __name__ == "__main__":
  sys.exit(main())
