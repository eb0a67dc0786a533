"""Lossy decoding with its error measured, side by side with the lossless rules (one run, one set of prompts).

    python -m blockspec_jax.eval.bench_lossy --gin_file gin/bench/lossy_qwen.gin [--gin_param ...]

Rows: autoregressive decoding of the target, token and block verification (lossless), SPRINTER at several head
thresholds (``sprinter``: a learned verifier head decides when the target is called) and MJSD/MTAD at several
``τ`` (``mtad``: joint verification of beam drafts). For every row, on the same prompts and keys:

* speed: target calls per emitted token, tokens/s and the speedup over autoregressive decoding (batch 1, prefill
  and decode timed as in the main job), block efficiency (tokens per target call);
* fidelity on the real pair: the target's mean log-likelihood of the generated tokens (teacher-forced, the target at
  T = 1, untransformed) and its perplexity; the pass rate of the generated HumanEval completions (code prompts; each
  completion runs in a subprocess sandbox with a timeout, :mod:`blockspec_jax.eval.humaneval`);
* fidelity, exactly, on a tabular pair: the total variation between the law of the first ``n`` emitted tokens and the
  target's (:mod:`blockspec_jax.theory.lossy`; 0 for the lossless rules, computed, not assumed). SPRINTER's head
  there is the ideal one (it accepts a context when ``P_{x~q}[q(x) ≤ p(x)] ≥ threshold``).

A lossless rule's log-likelihood differs from autoregressive decoding only by sampling noise (it samples the same
law); a lossy rule's shift is its bias: MTAD favours drafts the target finds likely (lower perplexity than sampling,
the paper's claim), SPRINTER emits drafter tokens where its head accepts. The pass rate on a handful of problems is
coarse (it is reported with its counts). Writes a JSON report and a speed-against-fidelity plot (PNG).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import time

import gin
import numpy as np

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax import job_config
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval.fidelity import target_loglik

__all__ = ["method_specs", "tabular_pair", "same_draft_table", "tabular_fidelity", "target_loglik", "format_table",
           "LossySettings", "bench_lossy_job", "LossyGrid", "lossy_bench", "main"]


def method_specs(thresholds, taus, cap: int, lossless=("token", "block"), sprinter_bonus=(True,),
                 sprinter_heads=(None,)) -> list[dict]:
  """The rows of one run: ``{"label", "method", "verifier_settings"}`` for autoregressive, the lossless rules, SPRINTER
  at every threshold (cap ``cap``; with and/or without the bonus token, ``sprinter_bonus``: the rows without it are
  labelled "no bonus"; with each head of ``sprinter_heads``, in its row's ``"head"``: with more than one head, each
  row's label ends with its head's directory name in brackets) and MTAD at every τ."""
  specs = [dict(label="autoregressive", method=methods_lib.AUTOREGRESSIVE, verifier_settings={})]
  specs += [dict(label=rule, method=rule, verifier_settings={}) for rule in lossless]
  heads = tuple(sprinter_heads)
  specs += [dict(label=f"sprinter θ={t:g}" + ("" if bonus else " no bonus")
                 + (f" [{pathlib.PurePath(str(head)).name}]" if len(heads) > 1 else ""), method="sprinter",
                 verifier_settings={"sprinter": {"threshold": float(t), "cap": int(cap), "bonus": bool(bonus)}},
                 head=head)
            for head in heads for bonus in sprinter_bonus for t in thresholds]
  specs += [dict(label=f"mtad τ={tau:g}", method="mtad", verifier_settings={"mtad": {"tau": float(tau)}})
            for tau in taus]
  return specs


def tabular_pair(*, vocab_size: int = 4, depth: int = 3, seed: int = 0, mix: float = 0.5):
  """``(drafter, target)`` tabular models: the target ``TabularLM.random(seed, V, depth)``, the drafter
  ``(1 − mix)·target + mix·random`` (a drafter correlated with its target, as a distilled or smaller model is)."""
  from blockspec_jax.theory.tabular import TabularLM
  target = TabularLM.random(seed, vocab_size, depth)
  noise = TabularLM.random(seed + 1, vocab_size, depth)
  return TabularLM((1 - mix) * target.probs + mix * noise.probs, depth), target


def same_draft_table(taus, *, gamma: int, n: int = 3, vocab_size: int = 4, depth: int = 3, seed: int = 0,
                     mix: float = 0.5) -> list[dict]:
  """Token, block and MTAD at every ``τ`` verifying the SAME drafts (ancestral chains of the drafter), exactly, on
  the tabular pair of :func:`tabular_pair`: ``E[τ]`` per iteration (block efficiency − 1) and the TV of the first
  ``n`` emitted tokens against the target. Rows ``{"rule", "expected_accepted", "tv"}``."""
  from blockspec_jax.theory import exact, lossy
  drafter, target = tabular_pair(vocab_size=vocab_size, depth=depth, seed=seed, mix=mix)
  expected = exact.sequence_law(target, (), n)
  rows = []
  for rule in ("token", "block"):
    law = exact.emitted_prefix_law(exact.exact_outcome_law(rule, drafter, target, (), gamma), target, (), n)
    rows.append(dict(rule=rule, expected_accepted=exact.expected_accepted(rule, drafter, target, (), gamma),
                     tv=lossy.law_tv(law, expected)))
  for tau in taus:
    rows.append(dict(rule=f"mtad τ={tau:g}",
                     expected_accepted=lossy.mtad_expected_accepted(drafter, target, (), gamma, tau, draft="sample"),
                     tv=lossy.mtad_sequence_tv(drafter, target, (), n, gamma, tau, draft="sample")))
  return rows


def tabular_fidelity(specs, *, gamma: int, width: int, n: int = 3, vocab_size: int = 4, depth: int = 3,
                     seed: int = 0, mix: float = 0.5) -> dict[str, float]:
  """Exact TV of the first ``n`` emitted tokens against the target's law, per row label, on a tabular pair: the target
  ``TabularLM.random(seed, V, depth)``, the drafter ``(1 − mix)·target + mix·random`` (a correlated drafter), the
  empty context. MTAD uses the deterministic best beam of width ``width`` (the exact beam law; the real-model rows
  may sample beams)."""
  from blockspec_jax import verify
  from blockspec_jax.theory import exact, lossy
  drafter, target = tabular_pair(vocab_size=vocab_size, depth=depth, seed=seed, mix=mix)
  context = ()
  expected = exact.sequence_law(target, context, n)
  out = {}
  for s in specs:
    rule = s["method"]
    theory_law = verify.VERIFIERS[rule].theory_law if rule in verify.VERIFIERS else None
    if rule == methods_lib.AUTOREGRESSIVE:
      out[s["label"]] = 0.0
    elif theory_law in exact.LAWS:  # any rule with an exact chain law (the lossless rules, lenient), its settings
      outcome_law = exact.exact_outcome_law(theory_law, drafter, target, context, gamma,
                                            **s["verifier_settings"].get(rule, {}))
      out[s["label"]] = lossy.law_tv(exact.emitted_prefix_law(outcome_law, target, context, n), expected)
    elif rule == "sprinter":
      settings = s["verifier_settings"]["sprinter"]
      accepts = lossy.ideal_head_accepts(target.next_probs, drafter.next_probs, settings["threshold"])
      law = lossy.sprinter_sequence_law(target.next_probs, drafter.next_probs, accepts, context, n, settings["cap"],
                                        vocab_size, bonus=verify.get_verifier("sprinter", **settings).bonus)
      out[s["label"]] = lossy.law_tv(law, expected)
    elif rule == "mtad":
      out[s["label"]] = lossy.mtad_sequence_tv(drafter, target, context, n, gamma, s["verifier_settings"]["mtad"]["tau"],
                                               draft="beam", width=width)
    else:
      raise ValueError(f"no tabular law for rule {rule!r}")
  return out


def format_table(rows) -> str:
  header = (f"{'method':<22} | {'calls/tok':>9} {'BE':>5} {'tok/s':>7} {'speedup':>7} | {'mean logp':>9} "
            f"{'PPL':>7} {'Δlogp vs AR':>11} | {'HumanEval':>9} | {'TV tab':>8}")
  lines = [header, "-" * len(header)]
  for r in rows:
    be = f"{r['block_efficiency']:5.2f}" if r.get("block_efficiency") is not None else "    -"
    he = f"{r['humaneval_passed']}/{r['humaneval_num']}" if r.get("humaneval_num") else "-"
    name = r["label"] + (" lossy" if r.get("lossy") else "")
    lines.append(f"{name:<22} | {r['target_calls_per_token']:>9.3f} {be} {r['tokens_per_s']:>7.2f} "
                 f"{r['speedup']:>6.2f}x | {r['mean_logp']:>9.4f} {r['perplexity']:>7.3f} "
                 f"{r['delta_logp_vs_ar']:>+11.4f} | {he:>9} | {r['tabular_tv']:>8.4f}")
  lines.append("calls/tok: target calls per emitted token; BE: tokens per target call; mean logp: the target's mean "
               "log-likelihood (T = 1) of the generated tokens, PPL = exp(−mean logp), Δ vs autoregressive sampling "
               "with ± its standard error in the JSON; HumanEval: completions that pass their tests / code "
               "completions; TV tab: exact total variation of the first emitted tokens against the target on the "
               "tabular pair.")
  return "\n".join(lines)


def _plot(rows, path: pathlib.Path, title: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for r in rows:
    marker = "o" if not r.get("lossy") else ("s" if r["method"] == "sprinter" else "^")
    for ax, x in ((axes[0], r["delta_logp_vs_ar"]), (axes[1], r["tabular_tv"])):
      ax.scatter([x], [r["speedup"]], marker=marker, s=50)
      ax.annotate(r["label"], (x, r["speedup"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
  axes[0].set_xlabel("Δ mean target log-likelihood vs autoregressive (real pair)")
  axes[1].set_xlabel("exact TV of the first tokens vs the target (tabular pair)")
  for ax in axes:
    ax.set_ylabel("speedup over autoregressive (tokens/s)")
    ax.grid(alpha=0.3)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


@dataclasses.dataclass(frozen=True)
class LossyGrid:
  """The bench's rows (:func:`method_specs`) and the drafters they run with; checked when built."""

  #: The draft length γ of every speculative row.
  gamma: int = 4
  #: SPRINTER's head thresholds, one row each (``()``: no SPRINTER rows, and no head needed).
  thresholds: tuple[float, ...] = (0.3, 0.5, 0.7)
  #: SPRINTER's cap: the target is called at least once per ``cap`` tokens.
  cap: int = 20
  #: MTAD's τ, one row each (``()``: no MTAD rows).
  taus: tuple[float, ...] = (0.3, 0.5)
  #: The trained SPRINTER head (a ``python -m blockspec_jax.train`` work directory), or several side by side: a
  #: tuple of work directories (one set of SPRINTER rows each, labelled with the directory's name), e.g. the heads
  #: trained on the two label sets (``sprinter_job.label_set``).
  sprinter_head: str | tuple[str, ...] | None = "results/train/sprinter_qwen"
  #: MTAD's beam drafter: beams per draft.
  beam_width: int = 4
  #: MTAD's beam drafter: sample the beams (False: the top ones).
  beam_sample: bool = True
  #: MTAD's beam drafter: the official code's per-step sampler (W (beam, token) pairs ∝ exp(score) each step)
  #: instead of Kool's stochastic beam search (with ``beam_sample``).
  beam_per_step: bool = False
  #: SPRINTER with the bonus token after an accepted flagged token (True, the paper's), without it (False, this
  #: codebase's variant before 2026-11-28), or both side by side: (True, False).
  sprinter_bonus: tuple[bool, ...] = (True,)
  #: The lossless rules beside them, one row each (the baseline the lossy rows are read against).
  lossless: tuple[str, ...] = ("token", "block")

  def __post_init__(self):
    from blockspec_jax import verify
    bad = [r for r in self.lossless if r not in verify.VERIFIERS or not verify.get_verifier(r).lossless]
    if bad or len(set(self.lossless)) != len(self.lossless):
      raise checks.UsageError(f"bench_lossy.lossless must list registered lossless rules once each "
                              f"({', '.join(sorted(n for n in verify.VERIFIERS if verify.get_verifier(n).lossless))}), "
                              f"got {self.lossless!r}")
    if not self.sprinter_bonus or len(set(self.sprinter_bonus)) != len(self.sprinter_bonus) or not all(
        isinstance(b, bool) for b in self.sprinter_bonus):
      raise checks.UsageError(f"bench_lossy.sprinter_bonus must list True and/or False once each, got "
                              f"{self.sprinter_bonus!r}")
    heads = self.sprinter_heads
    if self.thresholds and (not heads or not all(isinstance(h, str) and h for h in heads)
                            or len({pathlib.PurePath(h).name for h in heads}) != len(heads)):
      raise checks.UsageError(f"bench_lossy.sprinter_head must name one trained head's directory, or a tuple of "
                              f"directories with distinct names, for the SPRINTER rows; got {self.sprinter_head!r}")
    specs = self.specs()
    methods_lib.check_settings(gamma=self.gamma, methods=[s["method"] for s in specs])
    for s in specs:
      methods_lib.check_verifier_settings(s["verifier_settings"])

  def specs(self) -> list[dict]:
    """The rows, autoregressive first (:func:`method_specs`)."""
    return method_specs(self.thresholds, self.taus, self.cap, lossless=self.lossless,
                        sprinter_bonus=self.sprinter_bonus, sprinter_heads=self.sprinter_heads)

  @property
  def sprinter_heads(self) -> tuple:
    """:attr:`sprinter_head` as a tuple (``()`` for None)."""
    if self.sprinter_head is None:
      return ()
    return tuple(self.sprinter_head) if isinstance(self.sprinter_head, (tuple, list)) else (self.sprinter_head,)

  def drafter_settings(self, head: str | None = None) -> dict:
    """The drafters' settings of a row: SPRINTER's head (``head``, a row's ``"head"``; default the first of
    :attr:`sprinter_heads`), MTAD's beam."""
    head = head if head is not None else (self.sprinter_heads or (None,))[0]
    return {"sprinter": {"head": head},
            "beam": {"width": self.beam_width, "sample": self.beam_sample, "per_step": self.beam_per_step}}


@gin.configurable("bench_lossy")
@dataclasses.dataclass(frozen=True, kw_only=True)
class LossySettings(job_config.EvalSettings):
  """The bench's settings (gin: ``bench_lossy.gamma = 4``, …): the fields every evaluation job has
  (``job_config.EvalSettings``) and these (:class:`LossyGrid` documents the grid's); made once, they check every
  field, before a model loads. One drafter (``drafter``), one temperature."""

  sprinter_head: str | tuple | None = "results/train/sprinter_qwen"
  """:attr:`LossyGrid.sprinter_head` (one head's directory, or a tuple of them)."""
  prompts_path: str = str(prompts_lib.DEFAULT_PROMPTS)
  """``job_config.DataSettings.prompts``."""
  num_prompts: int | None = None
  """``job_config.DataSettings.num_prompts``."""
  temperature: float = 1.0
  """The one temperature of the bench."""
  max_new_tokens: int = 96
  """``job_config.DataSettings.max_new_tokens``."""
  gamma: int = 4
  thresholds: tuple = (0.3, 0.5, 0.7)
  cap: int = 20
  taus: tuple = (0.3, 0.5)
  beam_width: int = 4
  beam_sample: bool = True
  beam_per_step: bool = False
  sprinter_bonus: tuple = (True,)
  lossless: tuple = ("token", "block")
  """:class:`LossyGrid`'s fields of the same names."""
  tabular_n: int = 3
  """The exact fidelity on the tabular pair compares the law of the first ``n`` emitted tokens."""
  humaneval_timeout_s: float = 10.0
  """Each HumanEval completion's time limit."""
  humaneval_unsafe_no_sandbox: bool = False
  """Where this machine cannot contain generated code, run the HumanEval completions anyway (:func:`lossy_bench`)."""
  output_json: str | None = "results/bench_lossy.json"
  """``job_config.OutputSettings.output_json``."""
  plot: str | None = "results/bench_lossy.png"
  """The speed-against-fidelity plot (a PNG path; None: none)."""

  def groups(self) -> tuple:
    """``(models, grid, sampler, data, output)`` for :func:`lossy_bench`."""
    models = self.models()
    sampler = self.sampler_settings((self.temperature,))
    data = self.data_settings(self.prompts_path, num_prompts=self.num_prompts)
    if not self.thresholds and not self.taus:
      raise checks.UsageError("bench_lossy needs a lossy row: at least one SPRINTER threshold or one MTAD tau (() "
                              "leaves that method out)")
    grid = LossyGrid(gamma=self.gamma, thresholds=self.thresholds, cap=self.cap, taus=self.taus,
                     sprinter_head=self.sprinter_head, beam_width=self.beam_width, beam_sample=self.beam_sample,
                     sprinter_bonus=tuple(self.sprinter_bonus), beam_per_step=self.beam_per_step,
                     lossless=tuple(self.lossless))
    return models, grid, sampler, data, job_config.OutputSettings(output_json=self.output_json)


def bench_lossy_job(**overrides) -> dict:
  """The bench (module docstring): :class:`LossySettings` from gin (``bench_lossy.*``) and ``overrides``, checked
  before a model loads, then :func:`lossy_bench`, which documents the rest."""
  s = LossySettings(**overrides)
  return lossy_bench(*s.groups(), plot=s.plot, tabular_n=s.tabular_n, humaneval_timeout_s=s.humaneval_timeout_s,
                     share_prefills=s.share_prefills, humaneval_unsafe_no_sandbox=s.humaneval_unsafe_no_sandbox)


def lossy_bench(models: job_config.Models, grid: LossyGrid, sampler: job_config.SamplerSettings,
                data: job_config.DataSettings, output: job_config.OutputSettings, plot: str | None = None,
                tabular_n: int = 3, humaneval_timeout_s: float = 10.0, share_prefills: bool = True,
                humaneval_unsafe_no_sandbox: bool = False) -> dict:
  """The bench on checked settings (one drafter, the first temperature of ``sampler``); returns the report, written to
  ``output.output_json``, and draws ``plot`` (a PNG path; None: none).

  ``tabular_n``: the exact fidelity on the tabular pair compares the law of the first ``n`` emitted tokens.
  ``humaneval_timeout_s``: each HumanEval completion's time limit. ``share_prefills``: rows that run the same prefill
  (token and block; SPRINTER at every threshold; MTAD at every τ) compute each prompt's prefill once and each count
  its measured time, as in the main job (``harness.PrefillCache``). ``humaneval_unsafe_no_sandbox``: where this
  machine cannot contain generated code (no user namespaces, no seccomp, not Linux), run the HumanEval completions
  anyway, uncontained, as this user (``unsafe_no_sandbox`` of :func:`blockspec_jax.eval.humaneval.score_completions`;
  ``docs/SANDBOX.md``); by default scoring them raises ``SandboxUnavailable`` there."""
  if not isinstance(share_prefills, bool):
    raise checks.UsageError(f"bench_lossy.share_prefills must be True or False, got {share_prefills!r}")
  if len(models.drafters) != 1:
    raise checks.UsageError(f"bench_lossy runs one drafter, got {list(models.drafters)}")
  specs, gamma, temperature = grid.specs(), grid.gamma, sampler.temperatures[0]
  start = time.perf_counter()
  tabular = tabular_fidelity(specs, gamma=gamma, width=grid.beam_width, n=tabular_n, seed=sampler.seed)
  same = same_draft_table(grid.taus, gamma=gamma, n=tabular_n, seed=sampler.seed)
  print(f"tabular pair (V = 4, γ = {gamma}), the same sampled drafts under each rule, exactly: "
        + "; ".join(f"{r['rule']} E[τ] {r['expected_accepted']:.4f} TV {r['tv']:.4f}" for r in same), flush=True)
  rows = prompts_lib.load_prompts(data.prompts, limit=data.num_prompts)
  compile_dir = runtime.enable_compilation_cache(models.compilation_cache)
  target_model, (drafter_model,), _ = models.load()
  mesh = models.device_mesh()
  print(f"loaded {models.drafters[0]} → {models.target} ({models.dtype}); {len(rows)} prompts; T = {temperature:g}; "
        f"on {runtime.describe_devices(mesh)}; compilation cache {compile_dir or 'off'}", flush=True)
  prompt_ids = prompts_lib.encode_prompts(target_model, rows, data.chat, data.system)
  width = max(len(p) for p in prompt_ids)
  needed = max(methods_lib.method_gamma(s["method"], gamma, s["verifier_settings"]) for s in specs)
  methods_lib.check_cache_room(width, data.max_new_tokens, needed, target_model.config, drafter_model.config)
  scorer = _humaneval_scorer(rows, humaneval_timeout_s, humaneval_unsafe_no_sandbox)
  results = _bench_rows(grid, sampler, data, (target_model, drafter_model), rows, prompt_ids, width, tabular, scorer,
                        harness.PrefillCache() if share_prefills else None, mesh)
  print()
  print(format_table(results))
  rss_gb = runtime.peak_rss_gb()
  print(f"\npeak resident memory of this job: {rss_gb:.2f} GB (10^9 bytes)")
  report = dict(target=models.target, drafter=models.drafters[0], sprinter_head=grid.sprinter_head,
                dtype=models.dtype, temperature=temperature, gamma=gamma, cap=grid.cap, beam_width=grid.beam_width,
                beam_sample=grid.beam_sample, beam_per_step=grid.beam_per_step, top_k=sampler.top_k,
                top_p=sampler.top_p, max_new_tokens=data.max_new_tokens, seed=sampler.seed, system=data.system,
                peak_rss_gb=rss_gb, seconds=time.perf_counter() - start,
                prompts=[dict(id=r["id"], task=r["task"]) for r in rows], tabular_tv=tabular,
                tabular_same_drafts=same, results=results)
  if output.output_json and runtime.is_main_process():
    print(f"wrote {runtime.write_report(output.output_json, report)}")
  if plot and runtime.is_main_process() and _plot(results, pathlib.Path(plot), f"{models.drafters[0]} → {models.target}, T = {temperature:g}, "
                    f"{len(rows)} prompts × {data.max_new_tokens} tokens"):
    print(f"wrote {plot}")
  return report


def _humaneval_scorer(rows: list[dict], timeout_s: float, unsafe_no_sandbox: bool):
  """``texts -> score`` of the HumanEval completions among ``rows`` (:func:`humaneval.score_completions`); None when
  no row is a HumanEval problem."""
  from blockspec_jax.eval import humaneval
  code_rows = [r for r in rows if r["id"].startswith("HumanEval/")]
  if not code_rows:
    return None
  problems = humaneval.load_problems([r["id"] for r in code_rows])
  return lambda texts: humaneval.score_completions(rows, texts, timeout_s=timeout_s, problems=problems,
                                                   unsafe_no_sandbox=unsafe_no_sandbox)


def _bench_rows(grid: LossyGrid, sampler: job_config.SamplerSettings, data: job_config.DataSettings, pair: tuple,
                rows: list[dict], prompt_ids: list, width: int, tabular: dict, scorer,
                prefills: harness.PrefillCache | None, mesh=None) -> list[dict]:
  """Every row of ``grid`` decoded with the loaded ``(target, drafter)`` ``pair`` (on ``mesh``:
  ``harness.run_method``), with its speed, its target
  log-likelihood against autoregressive decoding's, its tabular TV and (with a ``scorer``) its HumanEval score."""
  target_model, drafter_model = pair
  results, baseline, ar_per_seq = [], None, None
  for s in grid.specs():
    drafter_settings = grid.drafter_settings(s.get("head"))
    summary, outputs = harness.run_method(s["method"], target_model, drafter_model, prompt_ids, width,
                                          gamma=grid.gamma, max_new_tokens=data.max_new_tokens,
                                          temperature=sampler.temperatures[0], seed=sampler.seed,
                                          stop_ids=target_model.stop_ids, drafter_settings=drafter_settings,
                                          verifier_settings=s["verifier_settings"], top_k=sampler.top_k,
                                          top_p=sampler.top_p, prefills=prefills, mesh=mesh)
    summary["label"] = s["label"]
    summary["verifier_settings"] = s["verifier_settings"]
    if s["method"] == "sprinter":
      summary["sprinter_head"] = drafter_settings["sprinter"]["head"]
    total, count, per_seq = target_loglik(target_model, prompt_ids, outputs)
    summary.update(mean_logp=total / max(count, 1), perplexity=math.exp(-total / max(count, 1)),
                   per_prompt_mean_logp=per_seq)
    if baseline is None:
      baseline, ar_per_seq = summary, np.asarray(per_seq)
    diff = np.asarray(per_seq) - ar_per_seq
    summary["delta_logp_vs_ar"] = summary["mean_logp"] - baseline["mean_logp"]
    summary["delta_logp_stderr"] = float(np.std(diff, ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else None
    summary["speedup"] = summary["tokens_per_s"] / baseline["tokens_per_s"]
    summary["tabular_tv"] = tabular[s["label"]]
    if scorer is not None:
      score = scorer([target_model.tokenizer.decode(o, skip_special_tokens=True) for o in outputs])
      summary.update(humaneval_passed=score["passed"], humaneval_num=score["num"],
                     humaneval_pass_rate=score["pass_rate"], humaneval_results=score["results"])
    summary["sample_text"] = target_model.tokenizer.decode(outputs[0], skip_special_tokens=True)
    results.append(summary)
    print(f"  {s['label']:<18} {summary['tokens_per_s']:.2f} tok/s, {summary['target_calls_per_token']:.3f} calls/tok,"
          f" mean logp {summary['mean_logp']:.4f}" + (f", HumanEval {summary['humaneval_passed']}/"
                                                      f"{summary['humaneval_num']}" if scorer else ""), flush=True)
  return results


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.eval.bench_lossy", __doc__, bench_lossy_job, argv)


if __name__ == "__main__":
  sys.exit(main())
