"""The main job: autoregressive vs speculative decoding (any registered rule and drafter) on real models and prompts.

    python -m blockspec_jax.run [--gin_file gin/runs/qwen_pair.gin] [--gin_param "run_job.gamma = 6"]

Default: Qwen2.5-Coder 0.5B drafter → 1.5B target (one tokenizer), the shipped prompt file (code, chat, math), γ = 4,
T ∈ {0, 1}, methods autoregressive, token, block. ``run_job.methods`` takes every registered verifier
(``verify.VERIFIERS``: block, token, greedy, exact_match, rrs, rrs_wor, spectr, traversal, point_mass, …), each
optionally with its drafter, ``"<verifier>@<drafter>"`` (``drafters.DRAFTERS``: model, k_chains, rsd_c, rsd_s, ngram,
heads_tree, …; default: the model chain for chain rules, k i.i.d. chains, RSD-C trees or the heads' p-best tree for
tree rules), and ``run_job.drafter_settings`` binds
drafter shapes, e.g. ``{"k_chains": {"k": 4}, "rsd_c": {"branching": (2, 2, 1, 1)}}``. For each temperature, every
method decodes every prompt at batch 1 (one compiled program per method and
temperature: prompts are padded to a common width and carry their own lengths, so nothing recompiles per prompt;
the first prompt's prefill runs once untimed and the decode program is compiled on a finished state, so
compiling adds no decode). Methods that run the same prefill (every speculative method with one drafter at one γ,
autoregressive decoding at every temperature) compute each prompt's prefill once and share it: its measured time is
charged to every row that uses it (``run_job.share_prefills = False`` times every row's own). Prints a table and writes a JSON file with, per method and
temperature: block efficiency (mean acceptance length), draft acceptance rate, per-position acceptance, target calls,
tokens generated, wall time, tokens/s and speedup over autoregressive decoding at the same temperature, end to end
and for the decode phase alone (prefill and decode are compiled and timed apart), and every method's generated token
ids (``generated_ids``: two runs, or two layouts, can be compared token for token). The generated text of one prompt
is printed per method so a person can see it is real.
"""

from __future__ import annotations

import dataclasses
import sys

import gin
import jax

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax import job_config
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax.data import prompts as prompts_lib

METHODS = methods_lib.METHODS


def format_table(rows, drafters: list[str] | None = None) -> str:
  """The main job's table; with ``drafters`` (several drafters), each speculative row names its drafter and the
  lines below give every drafter's tokens/s relative to the first one's, method by method."""
  width = max([18] + [len(r["method"]) + 6 * bool(r.get("lossy")) + (len(r.get("drafter", "")) + 3 if drafters else 0)
                      for r in rows])
  header = (f"{'method':<{width}} {'T':>4} {'γ':>3} {'N':>3} | {'BE':>5} {'accept':>7} | {'calls':>6} {'tokens':>6} "
            f"{'wall s':>8} {'tok/s':>7} {'speedup':>7} | {'prefill s':>9} {'dec tok/s':>9} {'dec x':>6}")
  lines = [header, "-" * len(header)]
  for r in rows:
    be = f"{r['block_efficiency']:5.2f}" if "block_efficiency" in r else "    -"
    acc = f"{r['draft_acceptance_rate']:7.3f}" if "draft_acceptance_rate" in r else "      -"
    nodes = r.get("draft_nodes") or "-"
    name = r["method"] + (" lossy" if r.get("lossy") else "") + (
        f" [{r['drafter']}]" if drafters and "drafter" in r else "")
    lines.append(f"{name:<{width}} {r['temperature']:>4.1f} {r['gamma'] or '-':>3} {nodes:>3} | {be} {acc} | "
                 f"{r['target_calls']:>6} {r['tokens_generated']:>6} {r['wall_s']:>8.2f} {r['tokens_per_s']:>7.2f} "
                 f"{r['speedup']:>6.2f}x | {r['prefill_s']:>9.2f} {r['decode_tokens_per_s']:>9.2f} "
                 f"{r['decode_speedup']:>5.2f}x")
  lines.append("N: draft nodes scored per target call (γ for a chain); "
               "BE: block efficiency = mean tokens per target call (1 + accepted / drafts); accept: draft acceptance "
               "rate; lossy: the rule does not sample the target's law at this temperature; speedup: tokens/s over "
               "autoregressive decoding of the target at the same temperature, end to end (prefill + decode); dec: "
               "the decode phase alone (prompt forwards timed apart and left out).")
  if any(r.get("prefills_reused") for r in rows):
    lines.append("prefill s: a prompt's prefill is computed once for the rows that run the same one (one drafter "
                 "and γ, or autoregressive decoding at every temperature) and its measured time is counted in each "
                 "of them.")
  if drafters:
    first = {(r["method"], r["temperature"]): r for r in rows if r.get("drafter") == drafters[0]}
    for r in rows:
      ref = first.get((r["method"], r["temperature"]))
      if ref is not None and r.get("drafter") not in (None, drafters[0]):
        lines.append(f"{r['method']} T={r['temperature']:g}: [{r['drafter']}] vs [{drafters[0]}]: tok/s "
                     f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}x, decode tok/s "
                     f"{r['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.3f}x, BE "
                     f"{r['block_efficiency']:.2f} vs {ref['block_efficiency']:.2f}")
  return "\n".join(lines)


@gin.configurable("run_job")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings(job_config.EvalSettings):
  """``run_job``'s settings (gin: ``run_job.gamma = 6``, …): the fields every evaluation job has
  (``job_config.EvalSettings``: the models, the sampler's seed and filters, ``chat``, ``system``, ``max_new_tokens``,
  the mesh, ``share_prefills``) and these; made once, they check every field (``job_config``'s groups), before a model
  loads."""

  prompts_path: str = str(prompts_lib.DEFAULT_PROMPTS)
  """``job_config.DataSettings.prompts``: the prompt file."""
  num_prompts: int | None = 6
  """``job_config.DataSettings.num_prompts``."""
  gamma: int = 4
  """The one γ of ``job_config.MethodGrid.gammas``."""
  temperatures: tuple = (0.0, 1.0)
  """``job_config.SamplerSettings.temperatures``."""
  methods: tuple = METHODS
  """``job_config.MethodGrid.methods``."""
  drafter_settings: dict | None = None
  """``job_config.MethodGrid.drafter_settings``."""
  verifier_settings: dict | None = None
  """``job_config.MethodGrid.verifier_settings``."""
  output_json: str | None = "results/run.json"
  """``job_config.OutputSettings.output_json``."""
  show_text: bool = True
  """``job_config.OutputSettings.show_text``."""

  def groups(self) -> tuple:
    """``(models, grid, sampler, data, output)`` for :func:`main_job`."""
    methods_lib.check_gamma(self.gamma)  # the one γ, named as it is bound (MethodGrid says "every gamma")
    grid = job_config.MethodGrid(methods=self.methods, gammas=(self.gamma,), drafter_settings=self.drafter_settings,
                                 verifier_settings=self.verifier_settings)
    return (self.models(), grid, self.sampler_settings(self.temperatures),
            self.data_settings(self.prompts_path, num_prompts=self.num_prompts),
            job_config.OutputSettings(output_json=self.output_json, show_text=self.show_text))


def run_job(**overrides) -> dict:
  """The main job (see the module docstring): :class:`RunSettings` from gin (``run_job.*``) and ``overrides``,
  checked before a model loads, then :func:`main_job`."""
  settings = RunSettings(**overrides)
  return main_job(*settings.groups(), share_prefills=settings.share_prefills)


def main_job(models: job_config.Models, grid: job_config.MethodGrid, sampler: job_config.SamplerSettings,
             data: job_config.DataSettings, output: job_config.OutputSettings, share_prefills: bool = True) -> dict:
  """The main job on checked settings: every method of ``grid`` (at its one γ) decodes every prompt of ``data`` at
  each temperature of ``sampler``; prints the table and returns the report (written to ``output.output_json``).

  ``share_prefills``: rows that run the same prefill (same models, drafter, γ and budget: temperature and verifier
  do not enter it) compute each prompt's prefill once (``harness.PrefillCache``; the same state bit for bit) and each
  count its measured time; False runs and times every row's own."""
  job_config.check_switch(share_prefills, "share_prefills")
  rows = prompts_lib.load_prompts(data.prompts, limit=data.num_prompts)
  if not rows:
    raise checks.UsageError(f"no prompts in {data.prompts}")
  compile_dir = runtime.enable_compilation_cache(models.compilation_cache)
  compiles_before = runtime.backend_compiles()
  target_model, drafter_models, load_s = models.load()
  mesh = models.device_mesh()
  print(f"loaded {', '.join(map(str, models.drafters))} → {models.target} ({models.dtype}) in {load_s:.1f} s; "
        f"{len(rows)} prompts; jax {jax.__version__} on {runtime.describe_devices(mesh)}; compilation cache "
        f"{compile_dir or 'off'}", flush=True)
  prompt_ids = prompts_lib.encode_prompts(target_model, rows, data.chat, data.system)
  width = max(len(p) for p in prompt_ids)
  methods_lib.check_methods_fit(grid.methods, grid.gammas, target_model, drafter_models, width, data.max_new_tokens,
                                grid.drafter_settings, grid.verifier_settings)
  prefills = harness.PrefillCache() if share_prefills else None
  labels = methods_lib.drafter_labels(models.drafters)
  results, texts, generated = _decode_grid(grid, sampler, data, target_model, list(zip(labels, drafter_models)),
                                           prompt_ids, width, prefills, mesh)
  several = len(drafter_models) > 1
  print()
  print(format_table(results, labels if several else None))
  if output.show_text:
    print(f"\nprompt [{rows[0]['id']}]: {rows[0]['text'][:300]}")
    for name, text in texts.items():
      print(f"\n--- {name} ---\n{text}")
  rss_gb = runtime.peak_rss_gb()
  print(f"\npeak resident memory of this job: {rss_gb:.2f} GB (10^9 bytes)")
  report = dict(target=models.target, drafter=list(models.drafters) if several else models.drafters[0],
                dtype=models.dtype, gamma=grid.gammas[0], max_new_tokens=data.max_new_tokens, top_k=sampler.top_k,
                top_p=sampler.top_p, system=data.system, peak_rss_gb=rss_gb,
                devices=runtime.describe_devices(mesh), mesh=list(models.mesh),
                programs_compiled=runtime.backend_compiles() - compiles_before,
                prompts=[dict(id=r["id"], task=r["task"], source=r["source"], licence=r["licence"]) for r in rows],
                results=results, sample_text=texts, generated_ids=generated)
  if output.output_json and runtime.is_main_process():
    print(f"\nwrote {runtime.write_report(output.output_json, report)}")
  return report


def _decode_grid(grid: job_config.MethodGrid, sampler: job_config.SamplerSettings, data: job_config.DataSettings,
                 target_model, drafters: list, prompt_ids: list, width: int, prefills,
                 mesh=None) -> tuple[list, dict, dict]:
  """Every method with each ``(label, drafter model)`` of ``drafters`` at each temperature (on ``mesh``: see
  ``harness.run_method``): the summary rows (speedups over the temperature's autoregressive row), the first prompt's
  text and every prompt's token ids by row name."""
  several = len(drafters) > 1
  gamma = grid.gammas[0]
  results, texts, generated = [], {}, {}
  for temperature in sampler.temperatures:
    baseline = None
    for method in grid.methods:
      pairs = [(None, None)] if method == methods_lib.AUTOREGRESSIVE else drafters
      for label, drafter_model in pairs:
        summary, outputs = harness.run_method(method, target_model, drafter_model, prompt_ids, width, gamma=gamma,
                                              max_new_tokens=data.max_new_tokens, temperature=temperature,
                                              seed=sampler.seed, stop_ids=target_model.stop_ids,
                                              drafter_settings=grid.drafter_settings,
                                              verifier_settings=grid.verifier_settings, prefills=prefills,
                                              mesh=mesh)
        if label is not None:
          summary["drafter"] = label
        if method == methods_lib.AUTOREGRESSIVE:
          baseline = summary
        summary["speedup"] = summary["tokens_per_s"] / baseline["tokens_per_s"] if baseline else float("nan")
        summary["decode_speedup"] = (summary["decode_tokens_per_s"] / baseline["decode_tokens_per_s"] if baseline
                                     else float("nan"))
        results.append(summary)
        name = method + (f" [{label}]" if several and label is not None else "")
        texts[f"{name}@T={temperature}"] = target_model.tokenizer.decode(outputs[0], skip_special_tokens=True)
        generated[f"{name}@T={temperature}"] = outputs
        print(f"  {name:<15} T={temperature}: {summary['tokens_per_s']:.2f} tok/s"
              + (f", BE {summary['block_efficiency']:.2f}" if "block_efficiency" in summary else ""), flush=True)
  return results, texts, generated


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.run", __doc__, run_job, argv)


if __name__ == "__main__":
  sys.exit(main())
