"""Paired comparison of verification rules on real models: the same contexts, the same drafts, every rule and γ.

Realised block efficiency (tokens per target call) from a few short decodes is a noisy figure: two rules decode
different trajectories, and with ~30 drafts per run the standard error of BE is ±0.1–0.3, as large as the gain of
block over token verification. This measures the gain with the noise of the trajectories taken out:

* contexts: prompts, each extended by a prefix of a sample from the target (e.g. the autoregressive output at the
  same temperature), so the contexts have the law speculative decoding meets them under;
* one prefill of the contexts, then ``draws`` drafts of ``γ_max`` tokens per context from the drafter, each scored by
  the target in one pass (:func:`blockspec_jax.decoding.speculative.draft_and_score`);
* for every rule and every γ ≤ γ_max, the rule on the first γ tokens of the same draft (the first γ tokens of a
  γ_max-token draft have exactly the law of a γ-token draft, and ``p`` rows 0..γ depend only on them): the
  Rao–Blackwellised ``Σ_i P(τ ≥ i | X^i)`` (``VerifyResult.acceptance_probs``), an unbiased estimate of E[τ] given
  the context. Block efficiency = 1 + E[τ].

The paired difference (block − token) per context is averaged over draws; the standard error is taken over contexts
(draws of one context share it, so they are not counted as independent).

    python -m blockspec_jax.eval.paired [--target qwen2.5-coder-1.5b] [--drafter qwen2.5-coder-0.5b]
        [--num-prompts 3] [--sample-tokens 32] [--positions 4] [--gamma 8] [--draws 8] [--temperature 1]
        [--json results/paired.json]

Contexts: the first ``--num-prompts`` shipped prompts (chat template, as the main job; ``--system none`` without
the template's default system message, or ``--system "<message>"`` with one's own), each extended by the first
0, n/k, 2n/k, … tokens (k = ``--positions``) of one autoregressive sample of n = ``--sample-tokens`` tokens from the
target at ``--temperature``.

Drafters (``--drafters A,B,…``): every drafter on the same contexts and keys, the first as the reference. A context's
tokens past its prompt were, in the decode it stands for, committed by decoding: a drafter whose state depends on
how they were committed (SD²: its cache holds keys and values written under each round's steering vector) is
brought to the state decoding leaves after committing them in rounds of ``--replay-stride`` tokens (default γ;
``steered:DIR?replay=1`` per drafter; 0 prefills the context as a prompt, as every drafter was measured before the
replay existed). Decoding's rounds commit τ + 1 tokens, between 1 and γ + 1; strides 1 and γ + 1 bound the
freshest and the stalest vectors a decode can leave. Plain drafters get the same table at any stride.

Trees (:mod:`blockspec_jax.eval.paired_trees`): ``--trees [--budgets 4,8,16] [--temperatures 1,0.6]`` compares
chains, SpecTr's k chains, RSD-C and RSD-S trees under their rules at equal node budgets, writes the table to
``--json`` after every arm (a rerun with the same file resumes: finished arms are kept) and a plot (SVG) beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import contracts, parallel, sampling
from blockspec_jax.checks import check_int
from blockspec_jax.theory.stats import mean_stderr
from blockspec_jax.contracts import Drafter
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.verify import get_verifier

__all__ = ["expected_accepted_table", "length_buckets", "paired_acceptance", "mean_stderr", "summarize_paired"]


def expected_accepted_table(target_params, drafter_params, keys_D, tokens_BxP, prompt_len_B, row_ids_B=None,
                            history_B=None, *, target, drafter: Drafter, gamma: int, sampler: sampling.Sampler,
                            verifiers: tuple[str, ...] = ("token", "block"), replay_stride: int = 1) -> jax.Array:
  """``E_DxBxRxG`` f32: for draw d, context b, rule r and γ = g + 1, ``Σ_{i≤γ} P(τ ≥ i | X^i)`` on the first γ tokens
  of draw d's draft. ``keys_D`` holds one key per draw; row b's draft in draw d uses ``fold_in(keys_D[d], id_b)``
  with ``id_b = row_ids_B[b]`` (default ``b``), so a context keeps its drafts when it is measured in another batch.
  ``history_B``: tokens at the end of each context that decoding committed (past the prompt); a drafter whose state
  depends on how they were committed (SD²) is replayed in rounds of ``replay_stride`` tokens
  (:func:`blockspec_jax.decoding.speculative.speculative_prefill`); None: every context is a prompt."""
  rules = tuple(get_verifier(v) for v in verifiers)
  state = spec.speculative_prefill(target_params, drafter_params, tokens_BxP, prompt_len_B, target=target,
                                   drafter=drafter, gamma=gamma, max_new_tokens=1, history_B=history_B,
                                   replay_stride=replay_stride)
  batch = tokens_BxP.shape[0]
  row_ids_B = jnp.arange(batch) if row_ids_B is None else jnp.asarray(row_ids_B, jnp.int32)

  def one_draw(key):
    row_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(row_ids_B)
    scored = spec.draft_and_score(target_params, drafter_params, state, row_keys_B, target=target,
                                  drafter=drafter, gamma=gamma, sampler=sampler)
    draft_BxG, p_BxG1xV = scored.draft.tokens_BxN, scored.p_BxN1xV
    q_BxGxV = scored.draft.q_rows(p_BxG1xV.shape[-1])  # point-mass drafts (n-gram, p-best lattices) give None
    # acceptance_probs do not depend on the verifier's uniforms: any key gives the same table.
    per_rule = [jnp.stack([jnp.sum(rule.batch(row_keys_B, draft_BxG[:, :g], q_BxGxV[:, :g],
                                              p_BxG1xV[:, :g + 1]).acceptance_probs, axis=1)
                           for g in range(1, gamma + 1)], axis=1) for rule in rules]
    return jnp.stack(per_rule, axis=1)  # [B, R, G]

  return jax.lax.map(one_draw, keys_D)


_table = jax.jit(expected_accepted_table,
                 static_argnames=("target", "drafter", "gamma", "sampler", "verifiers", "replay_stride"))


def length_buckets(lengths: Sequence[int], buckets: int) -> list[np.ndarray]:
  """Indices of ``lengths`` sorted by length and cut into ``buckets`` runs of near-equal count (fewer when there are
  fewer items): each run is padded to its own longest, not to the longest of all."""
  buckets = check_int(buckets, "buckets")
  order = np.argsort(np.asarray(lengths), kind="stable")
  return [run for run in np.array_split(order, min(int(buckets), len(order))) if len(run)]


def paired_acceptance(target_params, drafter_params, contexts: Sequence[Sequence[int]], *, target,
                      drafter: Drafter, gamma: int, temperature: float, draws: int, seed: int = 0,
                      verifiers: tuple[str, ...] = ("token", "block"), buckets: int = 1,
                      offsets: Sequence[int] | None = None, replay_stride: int = 0, mesh=None,
                      progress: str | None = None) -> np.ndarray:
  """Ragged token-id ``contexts`` → the ``[draws, contexts, rules, γ]`` table of :func:`expected_accepted_table`.

  ``offsets`` (each context's tokens past its prompt, :func:`build_contexts`) with ``replay_stride ≥ 1``: those
  tokens count as committed by decoding in rounds of ``replay_stride`` tokens, so a drafter whose state depends on
  how they were committed (SD²'s cache, written under each round's steering vector) is measured in the state
  decoding gives it; ``replay_stride = 0``, or no offsets: every context is prefilled as a prompt. Drafters without
  such state get the same table either way.

  ``buckets``: the contexts sorted by length and measured in this many batches, each padded to its own longest
  (:func:`length_buckets`): the prefill, which dominates a measurement, then runs over far fewer padding positions
  (96 contexts of 47–321 tokens: 31k padded positions in one batch, 18k in 3), at one compile per batch. Context
  ``b`` draws with the key of row ``b`` in any case, so the table is the one-batch table up to float rounding.

  ``mesh`` (``parallel.make_mesh``, of several devices): each batch's contexts over its ``data`` axis (padded to a
  multiple of it by repeating the last context, the padding cut from the table), both models' parameters laid out as
  ``parallel`` says; every process of a multi-host run passes the same contexts and gets the whole table. A context
  draws with its own keys wherever it runs, so the table is one device's up to float rounding.

  ``progress``: a tqdm bar of that name over the contexts (on stderr), advanced as each batch finishes; each batch
  compiles its own program (its own width), which the bar's postfix says while it runs."""
  if gamma < 1 or draws < 1:
    raise ValueError(f"gamma and draws must be >= 1, got gamma = {gamma}, draws = {draws}")
  if not contexts or min(len(c) for c in contexts) < 1:
    raise ValueError("every context needs at least one token")
  replay_stride = check_int(replay_stride, "replay_stride", 0, hint=" (0: contexts prefilled as prompts)")
  if offsets is not None:
    offsets = np.asarray(offsets, np.int32)
    if offsets.shape != (len(contexts),) or (offsets < 0).any() or \
        (offsets >= np.asarray([len(c) for c in contexts])).any():
      raise ValueError(f"offsets must give each of the {len(contexts)} contexts a count of tokens past its prompt in "
                       "[0, its length − 1]")
  replay = offsets is not None and replay_stride >= 1
  mesh, (target_params, drafter_params), keys_D, rows = parallel.layout_rows(
      mesh, (target_params, drafter_params), jax.random.split(jax.random.key(seed), draws))
  table_DxBxRxG = None
  runs = length_buckets([len(c) for c in contexts], buckets)
  from tqdm import tqdm
  bar = tqdm(total=len(contexts), desc=progress, unit="context", dynamic_ncols=True, file=sys.stderr,
             disable=progress is None)
  for batch, run in enumerate(runs):
    full = parallel.pad_rows(run, len(run) + -len(run) % rows)  # run itself on one device
    tokens_BxP, prompt_len_B = spec.prepare_prompts([list(contexts[i]) for i in full])
    bar.set_postfix_str(f"batch {batch + 1}/{len(runs)}: {len(run)} contexts of width {tokens_BxP.shape[1]}, compiling "
                        "and running", refresh=True)
    row_ids_B, history_B = full.astype(np.int32), (offsets[full] if replay else None)
    if mesh is not None:
      row_ids_B, tokens_BxP, prompt_len_B = parallel.shard_batch(mesh, row_ids_B, tokens_BxP, prompt_len_B)
      history_B = None if history_B is None else parallel.shard_batch(mesh, history_B)[0]
    part = parallel.gather(_table(target_params, drafter_params, keys_D, tokens_BxP, prompt_len_B, row_ids_B,
                                  history_B, target=target, drafter=drafter, gamma=gamma,
                                  sampler=sampling.Sampler(temperature=temperature), verifiers=tuple(verifiers),
                                  replay_stride=int(replay_stride) if replay else 1))[:, :len(run)]
    if table_DxBxRxG is None:
      table_DxBxRxG = np.zeros((part.shape[0], len(contexts), *part.shape[2:]), part.dtype)
    table_DxBxRxG[:, run] = part
    bar.update(len(run))
  bar.close()
  return table_DxBxRxG


def summarize_paired(table_DxBxRxG: np.ndarray, verifiers: tuple[str, ...] = ("token", "block")) -> list[dict]:
  """Per γ: block efficiency (1 + mean E[τ]) per rule, and the last rule minus the first (gain, its standard error
  over contexts, and the relative gain in block efficiency)."""
  per_context_BxRxG = np.asarray(table_DxBxRxG, np.float64).mean(axis=0)
  contexts = per_context_BxRxG.shape[0]
  out = []
  for g in range(per_context_BxRxG.shape[2]):
    be = {v: 1.0 + float(per_context_BxRxG[:, r, g].mean()) for r, v in enumerate(verifiers)}
    diff, stderr = mean_stderr(per_context_BxRxG[:, -1, g] - per_context_BxRxG[:, 0, g])
    out.append(dict(gamma=g + 1, be=be, diff=diff, diff_stderr=stderr,
                    gain=be[verifiers[-1]] / be[verifiers[0]] - 1, contexts=contexts,
                    draws=int(table_DxBxRxG.shape[0])))
  return out


def build_contexts(prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sequence[int]], positions: int,
                   owners: list | None = None, offsets: list | None = None) -> list:
  """Each prompt extended by the first ``0, n/k, …, (k−1)n/k`` tokens of its sample (n = the sample's length; a
  short sample gives fewer distinct contexts). ``owners``, when given, receives each context's prompt index and
  ``offsets`` its number of sampled tokens past the prompt."""
  contexts = []
  for i, (ids, sample) in enumerate(zip(prompt_ids, samples)):
    n = len(sample)
    for j in sorted({(k * n) // positions for k in range(positions)}):
      contexts.append(list(ids) + list(sample[:j]))
      if owners is not None:
        owners.append(i)
      if offsets is not None:
        offsets.append(j)
  return contexts


def sampled_contexts(target, prompt_ids, temperature: float, args, owners: list | None = None,
                     offsets: list | None = None) -> list:
  """Prompts extended by prefixes of one target sample each at ``temperature`` (see :func:`build_contexts`), sampled
  with the rows over every device (``parallel.autoregressive_rows``: the same tokens as one device)."""
  from blockspec_jax import runtime
  tokens_BxP, prompt_len_B = spec.prepare_prompts(prompt_ids)
  keys_B = jax.random.split(jax.random.key(args.seed + 1), len(prompt_ids))
  mesh = args.device_mesh
  with runtime.compiling(f"the target's sampling loop at T = {temperature:g} (compiled and run once)"):
    out = parallel.autoregressive_rows(mesh, target.params["params"], keys_B, tokens_BxP, prompt_len_B,
                                       target=target.config, max_new_tokens=args.sample_tokens,
                                       sampler=sampling.Sampler(temperature=temperature), stop_ids=target.stop_ids)
  samples = [np.asarray(out.tokens_BxN[b, :int(out.num_tokens_B[b])]).tolist() for b in range(len(prompt_ids))]
  return build_contexts(prompt_ids, samples, args.positions, owners, offsets)


def _trees_main(args, target, drafter_model, prompt_ids, start) -> int:
  """``--trees``: every arm of ``paired_trees.arms_for_budget`` at every budget and temperature; resumable."""
  from blockspec_jax import methods
  from blockspec_jax import runtime
  from blockspec_jax.eval import paired_trees as pt
  path = pathlib.Path(args.json)
  saved = json.loads(path.read_text()) if path.exists() else {}
  if saved:
    _check_same_contexts(path, saved, args, _CONTEXT_SETTINGS + ("verify_draws",))
  done = saved.get("results", [])
  have = {(r["temperature"], r["budget"], r["arm"]) for r in done}
  if done:
    print(f"resuming from {path}: {len(done)} arms already measured", flush=True)
  results = list(done)
  mesh = args.device_mesh
  placed = (target, drafter_model) if mesh is None else parallel.shard_models((target, drafter_model), mesh)
  for temperature in args.temperature_list:
    contexts = sampled_contexts(placed[0], prompt_ids, temperature, args)
    for budget in args.budget_list:
      for arm in pt.arms_for_budget(budget):
        if (temperature, budget, arm.label) in have:
          continue
        drafter = methods.build_drafter(arm.drafter, target, drafter_model, {arm.drafter: dict(arm.settings)}, arm.gamma)
        t0 = time.perf_counter()
        with runtime.compiling(f"T = {temperature:g}, {budget} nodes, {arm.label} ({len(contexts)} contexts)"):
          table = pt.run_arm(placed[0].params["params"], placed[1].params["params"], contexts, arm,
                             target=target.config, drafter=drafter, draws=args.draws, temperature=temperature,
                             seed=args.seed, verify_draws=args.verify_draws, mesh=mesh)
        results.append(dict(temperature=temperature, budget=budget, arm=arm.label, gamma=arm.gamma,
                            rules=list(arm.rules), seconds=time.perf_counter() - t0, table=table.tolist()))
        be = ", ".join(f"{r} {1 + table.mean(axis=(0, 1))[i]:.3f}" for i, r in enumerate(arm.rules))
        print(f"  T={temperature:g} N={budget:>2} {arm.label:<18} BE {be}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(config=_config(args), contexts=len(contexts), results=results)))
  print(format_trees(results, args.temperature_list))
  for temperature in args.temperature_list:
    rows = pt.summarize_arms([r for r in results if r["temperature"] == temperature])
    svg = path.with_name(f"{path.stem}_T{temperature:g}.svg")
    svg.write_text(pt.plot_arms(rows, temperature))
    print(f"wrote {svg}")
  print(f"wrote {path}; {time.perf_counter() - start:.0f} s")
  return 0


#: The settings a ``--drafters`` entry may carry for this job rather than its drafter (``steered:DIR?replay=8``).
_JOB_SETTINGS = ("replay",)


def _trained_entry(name, args) -> tuple[str, dict, int] | None:
  """``(drafter, settings, replay stride)`` of a ``--drafters`` entry naming a drafter with trained parts (checked,
  with its run's record, before any model loads), None for an entry that names a model."""
  from blockspec_jax import checks as checks_lib
  from blockspec_jax import methods
  spec_ = methods.trained_drafter_spec(name, job_settings=_JOB_SETTINGS)
  if spec_ is None:
    return None
  kind, settings = spec_
  stride = settings.pop("replay", args.replay_stride)
  stride = check_int(stride, f"{name!r}: replay", 0, hint=" (0: contexts prefilled as prompts)",
                     error=checks_lib.UsageError)
  return kind, settings, stride


def _paired_drafter(name, target, args):
  """``(drafter, its parameters, replay stride)`` for one ``--drafters`` entry: a model (name, path, training run) as
  a chain drafter, or ``<drafter>:<run dir>[?settings]`` (:func:`blockspec_jax.methods.trained_drafter_spec`: BPD heads,
  SD²) built on ``--drafter``'s model (the steered base, the heads' neural rescorer). The stride is the entry's
  ``replay`` setting (``steered:DIR?replay=1``), else ``--replay-stride``; None for drafters that do not replay."""
  from blockspec_jax import methods
  from blockspec_jax import sources
  entry = _trained_entry(name, args)
  if entry is None:
    drafter = sources.load_model(name, args.dtype, progress=False, scan_layers=True)
    sources.check_pair(target, drafter)
    return ModelDrafter(drafter.config), drafter.params["params"], None
  kind, settings, stride = entry
  base = sources.load_model(args.drafter, args.dtype, progress=False, scan_layers=True)
  sources.check_pair(target, base)
  drafter = methods.build_drafter(kind, target, base, {kind: settings}, args.gamma)
  return (drafter, methods.drafter_params(drafter, base, target),
          stride if contracts.replays_history(drafter) else None)


#: The settings that make the contexts and the drafts of a ``--drafters`` comparison: a resumed (or extended) run must
#: have the same ones (``--buckets`` may differ: it changes float rounding, not the drafts).
_CONTEXT_SETTINGS = ("target", "drafter", "prompts", "system", "num_prompts", "sample_tokens", "positions", "gamma",
                     "draws", "dtype", "seed")
#: What a file written before a setting existed measured with.
_EARLIER_DEFAULTS = {"system": "default"}


def _check_same_contexts(path: pathlib.Path, saved: dict, args, settings=_CONTEXT_SETTINGS) -> None:
  """A resumed (or extended) file was measured with ``args``' ``settings``; else a UsageError naming those that
  differ."""
  from blockspec_jax import checks as checks_lib
  changed = ["--" + k.replace("_", "-") for k in settings
             if saved.get("config", {}).get(k, _EARLIER_DEFAULTS.get(k)) != vars(args)[k]]
  if changed:
    raise checks_lib.UsageError(f"{path} was measured with other settings ({', '.join(changed)}), so its contexts or "
                                "drafts differ; pass another --json or remove it")


def _drafters_main(args, target, prompt_rows, prompt_ids, start) -> int:
  """``--drafters A,B,…``: every drafter on the same contexts at every temperature; resumable (``--json``), and a
  finished comparison takes more drafters appended to its list (only theirs are measured)."""
  from blockspec_jax import checks as checks_lib
  from blockspec_jax import methods
  from blockspec_jax.eval import paired_drafters as pd
  path = pathlib.Path(args.json)
  saved = json.loads(path.read_text()) if path.exists() else {}
  done = saved.get("results", [])
  if done:
    before = saved.get("drafters") or []
    if args.drafter_list[:len(before)] != before:
      raise checks_lib.UsageError(f"{path} holds results for the drafters {','.join(before)}; give them first (more may "
                            "follow: they are measured on the same contexts), or pass another --json")
    _check_same_contexts(path, saved, args)
  have = {(r["temperature"], r["drafter"]) for r in done}
  if done:
    print(f"resuming from {path}: {len(done)} (temperature, drafter) tables already measured", flush=True)
  results = list(done)
  labels = methods.drafter_labels(args.drafter_list)
  rules = ("token", "block")
  for temperature in args.temperature_list:
    contexts = tasks = None
    for name, label in zip(args.drafter_list, labels):
      if (temperature, label) in have:
        continue
      if contexts is None:
        owners, offsets = [], []
        contexts = sampled_contexts(target, prompt_ids, temperature, args, owners, offsets)
        tasks = [prompt_rows[i]["task"] for i in owners]
      drafter_obj, drafter_params, stride = _paired_drafter(name, target, args)
      draws = 1 if temperature == 0 else args.draws  # greedy drafts are the same in every draw
      t0 = time.perf_counter()
      print(f"T = {temperature:g}, drafter {label}: {len(contexts)} contexts × {draws} drafts in {args.buckets} "
            "batches of similar length (each batch compiles its own program)", file=sys.stderr, flush=True)
      table = paired_acceptance(target.params["params"], drafter_params, contexts,
                                target=target.config, drafter=drafter_obj, gamma=args.gamma,
                                temperature=temperature, draws=draws, seed=args.seed, verifiers=rules,
                                buckets=args.buckets, offsets=offsets, replay_stride=stride or 0,
                                mesh=args.device_mesh, progress=f"T={temperature:g} {label}")
      del drafter_obj, drafter_params
      results.append(dict(temperature=temperature, drafter=label, name=name, tasks=tasks, offsets=offsets,
                          replay_stride=stride,
                          seconds=time.perf_counter() - t0, table=table.tolist()))
      be = 1 + table.mean(axis=(0, 1))
      print(f"  T={temperature:g} {label}: BE block γ=4 {be[1, min(3, args.gamma - 1)]:.3f}, γ={args.gamma} "
            f"{be[1, -1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(dict(config=_config(args), drafters=args.drafter_list, results=results)))
  report = []
  for temperature in args.temperature_list:
    here = {r["drafter"]: r for r in results if r["temperature"] == temperature}
    sub = {_shown(label, here[label].get("replay_stride")): np.asarray(here[label]["table"])
           for label in labels if label in here}
    first = next(r for r in results if r["temperature"] == temperature)
    rows = pd.summarize_drafters(sub, first["tasks"], rules, gammas={4, args.gamma})
    report.append(pd.format_drafters(rows, temperature))
    if first.get("offsets") is not None:  # tables written before offsets were recorded have none
      groups = pd.offset_bins(first["offsets"], max(args.sample_tokens // args.positions, 1))
      rows = pd.summarize_drafters(sub, groups, rules, gammas={4, args.gamma})
      report.append(pd.format_drafters(rows, temperature, groups="tokens past the prompt"))
      split = pd.prompt_split(first["offsets"])
      if len(set(split)) == 2:  # Δ paired within: at the prompt, past it
        report.append(pd.format_within(pd.summarize_within(sub, split, rules, gammas={4, args.gamma}), temperature))
  text = "\n\n".join(report)
  print(text)
  md = path.with_suffix(".md")
  md.write_text(text + "\n")
  print(f"wrote {path} and {md}; {time.perf_counter() - start:.0f} s")
  return 0


def _shown(label: str, stride) -> str:
  """A drafter's label in the report, with how its contexts' history was replayed (drafters that replay it; a label
  whose settings name the stride, ``steered:DIR?replay=8``, already says it)."""
  if stride is None or re.search(r"[?&]replay=", label):
    return label
  return f"{label} (replay {stride})" if stride else f"{label} (prefilled as prompt)"


def format_trees(results, temperatures) -> str:
  """The trees table: per temperature and budget, every (arm, rule) BE ± stderr, then the paired comparisons."""
  from blockspec_jax.eval import paired_trees as pt
  lines = []
  for temperature in temperatures:
    sub = [r for r in results if r["temperature"] == temperature]
    rows = pt.summarize_arms(sub)
    lines.append(f"\nT = {temperature:g}: block efficiency (1 + E[τ]) ± one standard error over contexts")
    lines.append(f"{'N':>3} {'arm':<44} {'γ':>2} {'rule':<10} {'BE':>7} {'± se':>6}")
    for r in rows:
      lines.append(f"{r['budget']:>3} {r['arm']:<44} {r['gamma']:>2} {r['rule']:<10} {r['be']:>7.3f} "
                   f"{r['be_stderr']:>6.3f}")
    for r in sub:
      if "traversal" in r["rules"] and "rrs_wor" in r["rules"]:
        d, se = pt.paired_difference(sub, r["budget"], r["arm"], "traversal", "rrs_wor")
        lines.append(f"    N={r['budget']:>2} {r['arm']}: traversal − rrs_wor on the same trees: {d:+.3f} ± {se:.3f}")
    for budget in sorted({r["budget"] for r in sub}):
      labels = {r["arm"] for r in sub if r["budget"] == budget}
      rsd = next((a for a in labels if a.startswith("rsd_c ")), None)  # (2, 1, …): SpecTr's k = 2 shape
      k2 = "spectr k=2" if "spectr k=2" in labels else None
      if rsd and k2:
        d, se = pt.paired_difference(sub, budget, rsd, "rrs_wor", "rrs", worse_arm=k2)
        lines.append(f"    N={budget:>2} same shape, siblings without − with replacement: rrs_wor on {rsd} − rrs on "
                     f"{k2}: {d:+.3f} ± {se:.3f} (same contexts)")
    by = {(r["budget"], r["arm"], r["rule"]): r["be"] for r in rows}
    chain8 = by.get((8, "chain", "block"))
    best16 = max(((be, k) for k, be in by.items() if k[0] == 16 and k[1] != "chain"), default=None)
    if chain8 and best16:
      lines.append(f"    best tree at 16 nodes: {best16[1][2]} on {best16[1][1]} BE {best16[0]:.3f} = "
                   f"{best16[0] / chain8:.3f}× chain-block at γ = 8 ({chain8:.3f})")
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the gin job ``paired``'s settings and defaults, ``blockspec_jax.main``)."""
  from blockspec_jax import methods
  from blockspec_jax.data import formats
  from blockspec_jax.data import prompts as prompts_lib
  ap = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.paired", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--target", default=methods.DEFAULT_TARGET)
  ap.add_argument("--drafter", default=methods.DEFAULT_DRAFTER)
  ap.add_argument("--prompts", default=str(prompts_lib.DEFAULT_PROMPTS))
  ap.add_argument("--system", default=formats.SYSTEM_DEFAULT, help=formats.SYSTEM_OPTION_HELP)
  ap.add_argument("--num-prompts", type=int, default=3)
  ap.add_argument("--sample-tokens", type=int, default=32)
  ap.add_argument("--positions", type=int, default=4)
  ap.add_argument("--gamma", type=int, default=8, help="largest γ; every γ ≤ it is reported")
  ap.add_argument("--draws", type=int, default=8)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--buckets", type=int, default=1,
                  help="measure the contexts in this many batches of similar length (less padding in the prefill, "
                       "one compile each; the same drafts per context)")
  ap.add_argument("--replay-stride", type=int, default=None,
                  help="--drafters: a context's tokens past its prompt count as committed by decoding in rounds of "
                       "this many tokens, so drafters whose state depends on how tokens were committed (SD²: keys and "
                       "values written under each round's steering vector) are measured in the state decoding gives "
                       "them; 0 prefills every context as a prompt (default γ)")
  ap.add_argument("--json", default=None, help="default results/paired.json (results/paired_trees.json with --trees)")
  ap.add_argument("--trees", action="store_true", help="trees and chains at equal node budgets (see above)")
  ap.add_argument("--budgets", default="4,8,16", help="--trees: draft nodes per target call")
  ap.add_argument("--temperatures", default=None,
                  help="--trees (default 1,0.6) and --drafters (default 1,0): temperatures")
  ap.add_argument("--drafters", default=None,
                  help="comma-separated drafters (names, paths, training work directories, '<dir>@init', or "
                       "'<drafter>:<run dir>[?key=value&…]' for drafters with trained parts: "
                       "heads:results/train/heads_qwen?rescore=pbest_ngram, steered:results/train/steer_qwen, built "
                       "on --drafter's model) compared on the same contexts, the first as reference; resumable, "
                       "and more drafters may be appended to a finished --json")
  ap.add_argument("--verify-draws", type=int, default=16, help="--trees: verifier keys per draft for tree rules")
  ap.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                  help="the devices' mesh, data × model = every device (e.g. 4x2): contexts and sampled rows over "
                       "data, both models' parameters over model; default every device over data")
  return ap


def _numbers(text: str, option: str, parse) -> list:
  """The comma-separated values of ``option`` parsed with ``parse`` (a UsageError naming a value that does not)."""
  from blockspec_jax import checks as checks_lib
  try:
    return [parse(item) for item in text.split(",") if item.strip()]
  except ValueError:
    raise checks_lib.UsageError(f"{option} takes comma-separated numbers, got {text!r}") from None


def _check_args(args) -> None:
  """Every option checked before a model loads (a UsageError naming the first that cannot work); fills in
  ``args.temperature_list`` and ``args.budget_list`` and checks the trained drafters' runs."""
  from blockspec_jax import checks as checks_lib
  from blockspec_jax import methods
  from blockspec_jax import runtime
  for option, value in (("--positions", args.positions), ("--sample-tokens", args.sample_tokens),
                        ("--buckets", args.buckets), ("--draws", args.draws), ("--verify-draws", args.verify_draws)):
    check_int(value, option, error=checks_lib.UsageError)
  check_int(args.replay_stride, "--replay-stride", 0, hint=" (0: every context prefilled as a prompt)",
                 error=checks_lib.UsageError)
  # a trained drafter's entry is checked once, with its run's record and its replay setting (_trained_entry)
  models = [entry for entry in args.drafter_list if _trained_entry(entry, args) is None]
  methods.check_settings(gamma=args.gamma, temperatures=(args.temperature,), num_prompts=args.num_prompts,
                         dtype=args.dtype, models=(args.target, args.drafter, *models))
  from blockspec_jax.data import formats
  formats.check_system_option(args.system)
  if args.drafters is not None and args.trees:
    raise checks_lib.UsageError("--drafters and --trees are separate measurements; give one")
  if args.drafters is None and not args.trees and args.temperature_given:
    raise checks_lib.UsageError("--temperatures is for --trees and --drafters; the plain comparison takes --temperature")
  args.temperature_list = _numbers(args.temperatures, "--temperatures", float)
  methods.check_settings(temperatures=args.temperature_list)
  args.budget_list = [methods.check_gamma(b, "every budget") for b in _numbers(args.budgets, "--budgets", int)]
  if args.drafters is not None:
    if not args.drafter_list:
      raise checks_lib.UsageError("--drafters: give at least one drafter")
  runtime.check_output_file(args.json, "the report (--json)")
  args.mesh_shape = parallel.parse_mesh_shape(args.mesh)
  args.device_mesh = parallel.job_mesh(args.mesh_shape)


def _config(args) -> dict:
  """The options as a report records them (the mesh as its ``[data, model]`` shape)."""
  return dict({k: v for k, v in vars(args).items() if k not in ("device_mesh", "mesh_shape")},
              mesh=list(args.mesh_shape))


def main(argv=None) -> int:
  from blockspec_jax import cli
  from blockspec_jax import sources
  from blockspec_jax.data import prompts as prompts_lib
  ap = build_parser()
  args = ap.parse_args(argv)
  if args.json is None:
    args.json = ("results/paired_trees.json" if args.trees else "results/paired_drafters.json" if args.drafters
                 else "results/paired.json")
  args.temperature_given = args.temperatures is not None
  if args.temperatures is None:
    args.temperatures = "1,0.6" if args.trees else "1,0"
  args.drafter_list = [d for d in (args.drafters or "").split(",") if d]
  if args.replay_stride is None:
    args.replay_stride = args.gamma
  with cli.cli_errors(ap.prog):  # a mistake in the options, the prompts or a user's checkpoint: one line
    _check_args(args)
    prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)
    if args.drafters is not None:
      start = time.perf_counter()
      target = sources.load_model(args.target, args.dtype, scan_layers=True)
      rows = prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)
      return _drafters_main(args, target, rows, prompts_lib.encode_prompts(target, rows, True, args.system), start)
    return _pair_main(args)


def _pair_main(args) -> int:
  """Token vs block verification of one drafter (``--trees``: trees and chains at equal budgets) on one target."""
  from blockspec_jax import runtime
  from blockspec_jax import sources
  from blockspec_jax.data import prompts as prompts_lib
  start = time.perf_counter()
  target = sources.load_model(args.target, args.dtype, scan_layers=True)
  drafter = sources.load_model(args.drafter, args.dtype, scan_layers=True)
  sources.check_pair(target, drafter)
  rows = prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)
  prompt_ids = prompts_lib.encode_prompts(target, rows, True, args.system)
  if args.trees:
    return _trees_main(args, target, drafter, prompt_ids, start)
  contexts = sampled_contexts(target, prompt_ids, args.temperature, args)
  print(f"paired: {args.drafter} → {args.target}, T = {args.temperature:g}; {len(contexts)} contexts "
        f"({len(prompt_ids)} prompts × {args.positions} positions in a target sample), {args.draws} drafts of "
        f"γ = {args.gamma} each", flush=True)
  with runtime.compiling(f"the paired scoring program ({len(contexts)} contexts, compiled and run)"):
    table = paired_acceptance(target.params["params"], drafter.params["params"], contexts, target=target.config,
                              drafter=ModelDrafter(drafter.config), gamma=args.gamma, temperature=args.temperature,
                              draws=args.draws, seed=args.seed, buckets=args.buckets,
                              mesh=args.device_mesh)
  summary = summarize_paired(table)
  print(f"{'γ':>2} | {'BE token':>8} {'BE block':>8} | {'block − token (E[τ])':>20} | {'gain':>6}")
  for s in summary:
    print(f"{s['gamma']:>2} | {s['be']['token']:>8.3f} {s['be']['block']:>8.3f} | "
          f"{s['diff']:>+9.3f} ± {s['diff_stderr']:<8.3f} | {100 * s['gain']:>+5.1f}%")
  print("BE = 1 + Σ_i P(τ ≥ i | X^i) averaged over the same drafts for both rules; ± one standard error over "
        f"contexts. {time.perf_counter() - start:.0f} s")
  if args.json:
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(config=_config(args), contexts=[len(c) for c in contexts], summary=summary,
                                    table=table.tolist()), indent=1))
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
