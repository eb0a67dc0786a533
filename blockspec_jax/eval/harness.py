"""The timed decode of one method over a prompt set (:func:`run_method`), the prompts' encoding
(``data.prompts.encode_prompts``) and the prefills methods share (:class:`PrefillCache`): what the main job, the suites and
the benchmarks measure with.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np

from blockspec_jax.methods import (AUTOREGRESSIVE, build_drafter, drafter_params, method_gamma, method_is_lossy,
                                   parse_method)
from blockspec_jax.runtime import backend_compiles, compiling, release_programs_if_near_map_limit

__all__ = ["PrefillCache", "run_method"]


class PrefillCache:
  """Prefill states shared by the methods of one job: a prompt's prefill depends on the models, the drafter, γ and
  the token budget (they size and fill the caches), never on the temperature, the sampler or the verifier, so
  ``autoregressive`` at T = 0 and T = 1, or ``token`` and ``block`` at one γ with one drafter, run the same prefill
  program on the same inputs and get the same state bit for bit. :func:`run_method` given a cache computes each
  such state once, times it once, and charges that measured time to every row that uses it (its ``prefill_s``),
  so rows stay comparable end to end. The decode phase never donates its input state, so a state serves any
  number of decodes.

  Keys hold the models' ``id``: a cache belongs to one job, whose models live as long as it does. States are kept
  oldest-first and evicted beyond ``max_bytes`` (the Qwen pair's state of a 300-token prompt is ~30 MB), so a job
  reuses best when the rows sharing a prefill run close together. ``hits`` counts reused states."""

  def __init__(self, max_bytes: int = 2 << 30):
    import collections
    self.max_bytes = int(max_bytes)
    self.hits = 0
    self._entries = collections.OrderedDict()  # key -> (state, seconds, bytes)
    self._bytes = 0

  def get(self, key):
    """``(state, seconds)`` of ``key``, or None."""
    entry = self._entries.get(key)
    if entry is None:
      return None
    self.hits += 1
    return entry[0], entry[1]

  def put(self, key, state, seconds: float) -> None:
    """Keep ``state`` (measured in ``seconds``), evicting the oldest states beyond ``max_bytes``."""
    import jax
    size = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
    if key in self._entries or size > self.max_bytes:
      return
    self._entries[key] = (state, float(seconds), size)
    self._bytes += size
    while self._bytes > self.max_bytes:
      self._bytes -= self._entries.popitem(last=False)[1][2]

  def __len__(self) -> int:
    return len(self._entries)


def _phases(method: str, target, drafter, gamma: int, max_new_tokens: int, sampler, stop_ids,
            drafter_settings=None, verifier_settings=None, mesh=None):
  """The method's two compiled phases: ``prefill(tokens, lens) -> state`` and ``decode(keys, state) ->
  DecodeOutput`` (together exactly ``generate_autoregressive`` / ``generate_speculative``), and the key of its
  prefill (:class:`PrefillCache`: equal for methods whose prefills are the same program on the same parameters;
  None when the drafter cannot be hashed, then nothing is shared). ``mesh``: both models' parameters laid out on
  it (``parallel.shard_params``: a no-op for parameters already there) and the KV caches as
  ``parallel.cache_sharding`` says."""
  from blockspec_jax.decoding import speculative as spec
  tp = target.params["params"]
  placed = {}
  if mesh is not None:
    from blockspec_jax import parallel
    tp = parallel.shard_params(tp, mesh)
    placed = dict(cache_sharding=parallel.cache_sharding(mesh, target.config))
  rule, drafter_name = parse_method(method)
  if rule == AUTOREGRESSIVE:
    common = dict(target=target.config, max_new_tokens=max_new_tokens, **placed)
    return (lambda tokens, lens: spec.prefill_autoregressive(tp, tokens, lens, **common),
            lambda keys, state: spec.decode_autoregressive(tp, keys, state, sampler=sampler, stop_ids=stop_ids,
                                                           **common),
            (AUTOREGRESSIVE, id(target), max_new_tokens))
  from blockspec_jax import verify
  gamma = method_gamma(rule, gamma, verifier_settings)
  rule = verify.get_verifier(rule, **dict((verifier_settings or {}).get(rule, {})))
  drafter_obj = build_drafter(drafter_name, target, drafter, drafter_settings, gamma)
  dp = drafter_params(drafter_obj, drafter, target)
  if mesh is not None:
    dp = parallel.shard_params(dp, mesh)
  common = dict(target=target.config, drafter=drafter_obj, gamma=gamma, max_new_tokens=max_new_tokens, **placed)
  # The drafter's prefill key (its settings that the prefill reads: a trained drafter's path, a tree's shape) and the
  # two models determine the prefill state; drafters without ``prefill_key`` are keyed whole.
  prefill_key = getattr(drafter_obj, "prefill_key", None)
  key = ("speculative", id(target), id(drafter), prefill_key() if prefill_key else drafter_obj, gamma,
         max_new_tokens)
  try:
    hash(key)
  except TypeError:
    key = None
  return (lambda tokens, lens: spec.prefill_speculative(tp, dp, tokens, lens, **common),
          lambda keys, state: spec.decode_speculative(tp, dp, keys, state, verifier=rule, sampler=sampler,
                                                      stop_ids=stop_ids, **common),
          key)


@dataclasses.dataclass
class _TimedPhases:
  """One method's two compiled phases (:func:`_phases`) over a prompt set, and where they run: :meth:`run` decodes
  one batch of prompts, timed. ``rows`` prompts a batch (1 without a mesh, the ``data`` axis on one); prompt ``i``
  samples from ``fold_in(key, i)``; ``prefills``: the job's :class:`PrefillCache` (None: nothing shared)."""
  prefill: Any
  decode: Any
  prefill_key: Any
  prefills: PrefillCache | None
  prompt_ids: list
  width: int
  key: Any
  mesh: Any
  rows: int
  reused: int = 0  # prompts whose prefill came from ``prefills``

  def run(self, index: list[int], compile_only: bool = False) -> tuple:
    """The prompts ``index`` (at most ``rows``, padded to that by repeating the last): (their output, gathered, of
    ``rows`` rows, prefill seconds, decode seconds, programs compiled inside the two timed calls). ``compile_only``:
    the decode phase starts from a state whose rows are all finished, so it compiles the very program the timed
    prompts run (same shapes, same static arguments) but its loop runs no iteration. A state from ``prefills`` is
    used as it is and its recorded time returned; a timed prefill is kept there."""
    import jax
    from blockspec_jax import parallel
    full = [int(i) for i in parallel.pad_rows(index, self.rows)]
    padded = [ids + [0] * (self.width - len(ids)) for ids in (self.prompt_ids[i] for i in full)]
    tokens = np.asarray(padded, np.int32)
    lens = np.asarray([len(self.prompt_ids[i]) for i in full], np.int32)
    keys = (jax.random.fold_in(self.key, full[0])[None] if len(full) == 1 else
            jax.numpy.stack([jax.random.fold_in(self.key, i) for i in full]))
    if self.mesh is not None:
      keys, tokens, lens = parallel.shard_batch(self.mesh, keys, tokens, lens)
    cache_key = (self.prefill_key, tuple(map(tuple, padded)), tuple(len(self.prompt_ids[i]) for i in full)
                 ) if self.prefills is not None else None
    shared = self.prefills.get(cache_key) if cache_key is not None else None
    compiled = backend_compiles()
    start = time.perf_counter()
    if shared is not None:
      state, prefill_s = shared
      self.reused += 0 if compile_only else len(index)
    else:
      state = jax.block_until_ready(self.prefill(tokens, lens))
      prefill_s = time.perf_counter() - start
      if cache_key is not None and not compile_only:  # a compiling call's time is not a prefill's
        self.prefills.put(cache_key, state, prefill_s)
    if compile_only:  # every row finished, by a device op: the array keeps the state's placement (a host array
      # would be uncommitted where the state's is committed, e.g. a trained drafter's parameters, and the timed
      # prompts would compile the decode program again)
      state = state.replace(done_B=jax.numpy.logical_or(state.done_B, True))
    middle = time.perf_counter()
    out = jax.block_until_ready(self.decode(keys, state))
    end = time.perf_counter()
    if self.mesh is not None:
      out = parallel.gather(out)
    return out, prefill_s, end - middle, backend_compiles() - compiled


@dataclasses.dataclass
class _Tally:
  """What the timed batches of one method add up to; the padded rows never reach it (:meth:`add` takes the real
  rows only)."""
  prefill_s: float = 0.0
  decode_s: float = 0.0
  compiles: int = 0
  tokens: int = 0
  calls: int = 0
  outputs: list = dataclasses.field(default_factory=list)
  metrics: list = dataclasses.field(default_factory=list)
  extras: list = dataclasses.field(default_factory=list)

  def add(self, autoregressive: bool, real: int, out, prefill_s: float, decode_s: float, compiles: int) -> None:
    """The first ``real`` rows of the batch output ``out``, timed ``prefill_s`` + ``decode_s``."""
    from blockspec_jax import parallel
    self.prefill_s, self.decode_s, self.compiles = (self.prefill_s + prefill_s, self.decode_s + decode_s,
                                                    self.compiles + compiles)
    for b in range(real):
      n = int(out.num_tokens_B[b])
      self.tokens += n
      self.calls += n if autoregressive else int(out.metrics.num_drafts[b])
      self.outputs.append(np.asarray(out.tokens_BxN[b, :n]).tolist())
    self.metrics.append(parallel.take_rows(out.metrics, real))
    self.extras.append(None if out.extra is None else parallel.take_rows(out.extra, real))


def _concat_rows(parts: list):
  """The batches' trees (numpy leaves with a row axis) as one tree over every row."""
  import jax
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def _summary(method: str, temperature: float, rule_gamma, lossy: bool, prompts: int, tally: _Tally,
             reused: int) -> dict:
  """The report row of one method over ``prompts`` prompts: counts, times, and (speculative) the acceptance;
  ``reused``: prompts whose prefill state came from the job's :class:`PrefillCache`."""
  from blockspec_jax.decoding import speculative as spec
  wall = tally.prefill_s + tally.decode_s
  tokens, calls = tally.tokens, tally.calls
  summary = dict(method=method, temperature=temperature, gamma=rule_gamma, lossy=lossy,
                 target_calls_per_token=calls / max(tokens, 1), prompts=prompts, tokens_generated=tokens,
                 target_calls=calls, wall_s=wall, tokens_per_s=tokens / wall, prefill_s=tally.prefill_s,
                 decode_s=tally.decode_s, decode_tokens_per_s=tokens / tally.decode_s,
                 compiles_while_timed=tally.compiles, prefills_reused=reused)
  merged = _concat_rows(tally.metrics)
  if tally.extras and tally.extras[0] is not None:  # rule-specific counters (SPRINTER's flags, SD rejections), summed
    summary.update({k: int(np.sum(v)) for k, v in dataclasses.asdict(_concat_rows(tally.extras)).items()})
  s = spec.summarize_metrics(merged)
  summary["invalid_prob_rows"] = s["invalid_prob_rows"]
  if method != AUTOREGRESSIVE:
    summary.update(block_efficiency=s["mean_acceptance_length"], draft_acceptance_rate=s["draft_acceptance_rate"],
                   draft_nodes=int(np.sum(merged.num_draft_tokens)) // max(int(np.sum(merged.num_drafts)), 1),
                   acceptance_per_position=s["acceptance_per_position"],
                   expected_accepted_per_draft=s["expected_accepted_per_draft"],
                   per_prompt_acceptance_length=s["per_row_mean_acceptance_length"])
  return summary


def run_method(method, target, drafter, prompt_ids, width, *, gamma, max_new_tokens, temperature, seed, stop_ids,
               drafter_settings=None, verifier_settings=None, top_k: int = 0, top_p: float = 1.0,
               warm: bool = False, prefills: PrefillCache | None = None, mesh=None):
  """Decode every prompt with ``method`` ("autoregressive", a verifier name, or ``"<verifier>@<drafter>"``, see
  :func:`parse_method`; ``drafter_settings`` as in :func:`build_drafter`); returns the summary row and the generated
  token lists.

  Prompt ``i`` decodes with the key ``fold_in(key(seed), i)`` whatever the layout. Without ``mesh`` (or on a mesh of
  one device) every prompt decodes at batch 1. On a ``mesh`` (``parallel.make_mesh``) of several devices the prompts
  decode in batches of one row per ``data`` shard, the parameters and KV caches laid out as ``parallel`` says; the
  last batch is padded by repeating its last prompt, and the padded rows are dropped before anything is counted. A row
  samples from its own key at each iteration, so a row's tokens do not depend on the rows beside it. Across the
  processes of a multi-host run every process passes the same prompts and reads every row back
  (``parallel.gather``).

  Prefill and decode phase are compiled and timed apart (each ends in ``block_until_ready``): ``wall_s`` is their
  sum over the batches, ``prefill_s`` the prompt forwards (target, and drafter for speculative methods), ``decode_s``
  the loop, which is the phase the ideal speedup BE / (1 + γ·c) describes. Before the timed prompts, the first
  batch's prefill runs once untimed and the decode program is compiled on a finished state (no loop iteration), so
  compiling costs no extra decode.
  ``temperature``, ``top_k`` and ``top_p`` make the sampler both models decode with (``sampling.Sampler``).
  ``warm``: a previous call compiled the same programs (same method, γ, sampler, width, models and mesh), so the
  untimed first run is skipped (a suite's later categories).
  ``prefills``: a :class:`PrefillCache` shared by the job's calls: a batch whose prefill another method already
  ran (same models, drafter, γ, budget and prompts) starts from that state, and this row's ``prefill_s`` counts the
  time it took there (``prefills_reused`` says for how many prompts).
  """
  import jax
  from blockspec_jax import sampling
  if mesh is not None and mesh.size == 1:
    mesh = None  # one device: today's batch-1 programs, bit for bit
  if not warm:  # a long sweep of methods and shapes in one process; never between a warm call and its programs
    release_programs_if_near_map_limit()
  sampler = sampling.Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
  prefill, decode, prefill_key = _phases(method, target, drafter, gamma, max_new_tokens, sampler, stop_ids,
                                         drafter_settings, verifier_settings, mesh)
  rows = 1 if mesh is None else mesh.shape["data"]
  phases = _TimedPhases(prefill, decode, prefill_key, prefills if prefill_key is not None else None, prompt_ids,
                        width, jax.random.key(seed), mesh, rows)
  batches = [list(range(i, min(i + rows, len(prompt_ids)))) for i in range(0, len(prompt_ids), rows)]
  rule_gamma = None if method == AUTOREGRESSIVE else method_gamma(parse_method(method)[0], gamma, verifier_settings)
  label = f"{method} (T = {temperature:g}" + ("" if rule_gamma is None else f", γ = {rule_gamma}") + ")"
  if mesh is not None:
    label += f" on a {mesh.shape['data']} x {mesh.shape['model']} (data x model) mesh"
  if not warm:
    with compiling(label):
      # Compile both phases once per method and T: one batch's prefill, and the decode loop with no iteration.
      phases.run(batches[0], compile_only=True)
  tally = _Tally()
  for index in batches:
    tally.add(method == AUTOREGRESSIVE, len(index), *phases.run(index))  # the padded rows end here
  if tally.compiles:
    print(f"WARNING: {label}: {tally.compiles} program(s) compiled inside the timed prompts; its times include "
          "compilation", file=sys.stderr)
  summary = _summary(method, temperature, rule_gamma, method_is_lossy(method, sampler, verifier_settings),
                     len(prompt_ids), tally, phases.reused)
  if summary["invalid_prob_rows"]:
    print(f"WARNING: {method} at T = {temperature:g}: {summary['invalid_prob_rows']} probability rows were not "
          "distributions (NaN/inf logits or bad rows); its numbers are not trustworthy", file=sys.stderr)
  return summary, tally.outputs
