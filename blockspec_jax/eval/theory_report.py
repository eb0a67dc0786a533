"""Expected accepted tokens per iteration, token vs block verification, exact and measured, beside the bound.

For each drafter/target pair of small tabular models: the exact ``E[τ]`` of token and block verification (by
enumeration), the full-information bound ``Σ_i Σ_{x^i} min(M_s(x^i), M_b(x^i))`` (reachable only by rules that
carry state across iterations), and the same expectations measured by running the jitted rules on sampled drafts
(counting τ, ± one standard error, and the Rao–Blackwellised ``Σ_i w_i``).

Tree section (:func:`tree_report_rows`, :func:`format_tree_table`): for a few of the pairs, the exact ``E[τ]`` of
every tree rule of ``verify.TREE_RULES`` on a chain (γ = 2), two chains of depth 2 and the binary tree of depth 2
(:mod:`blockspec_jax.theory.trees`, by enumeration of every tree), beside the same measured by the jitted rules on
trees drawn as each rule requires (numpy sampler, ± one standard error).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import theory, verify
from blockspec_jax.decoding import reference as ref


# Exact E[τ] enumerates all V^γ drafts (~0.2 ms each in numpy): 2·10^5 drafts is about 40 s per rule and pair.
MAX_EXACT_DRAFTS = 200_000


def check_enumerable(pairs) -> None:
  """ValueError, before anything is computed, for a pair whose exact table would enumerate more than
  ``MAX_EXACT_DRAFTS`` drafts (V^γ: V = 8 allows γ ≤ 5)."""
  for pair in pairs:
    drafts = pair.target.vocab_size ** pair.gamma
    if drafts > MAX_EXACT_DRAFTS:
      raise ValueError(f"exact E[τ] for {pair.name!r} at γ = {pair.gamma} enumerates V^γ = {drafts:,} drafts, above "
                       f"the {MAX_EXACT_DRAFTS:,} this report allows (about 0.2 ms each per rule); use smaller gammas")


@dataclasses.dataclass(frozen=True)
class PairSpec:
  """A named drafter/target pair of tabular models and the context the block starts from."""
  name: str
  drafter: theory.TabularLM
  target: theory.TabularLM
  context: tuple[int, ...]
  gamma: int


def default_pairs(gammas=(2, 4), seed: int = 0) -> list[PairSpec]:
  """The paper's toy (γ = 2) and random pairs (Dirichlet rows; the drafter is a noisy copy of the target)."""
  drafter, target, gamma = theory.paper_toy()
  pairs = [PairSpec("paper toy V=2", drafter, target, (), gamma)]
  rng = np.random.default_rng(seed)
  for vocab, depth, concentration in ((3, 2, 0.5), (5, 1, 1.0), (8, 0, 0.3)):
    target = theory.TabularLM.random(rng, vocab, depth, concentration)
    noise = rng.dirichlet(np.full(vocab, concentration), size=target.probs.shape[0])
    drafter = theory.TabularLM(0.5 * target.probs + 0.5 * noise, depth)
    for g in gammas:
      pairs.append(PairSpec(f"random V={vocab} depth={depth}", drafter, target, (0,) if depth else (), g))
  return pairs


def measure(pair: PairSpec, rule: str, num_samples: int, seed: int):
  keys = jax.random.split(jax.random.key(seed), num_samples)
  run = jax.jit(functools.partial(ref.verify_blocks_tabular, gamma=pair.gamma, verifier=rule))
  _, res = run(keys, ref.TabularTables.from_lm(pair.drafter), ref.TabularTables.from_lm(pair.target),
               jnp.asarray(pair.context, jnp.int32))
  counted = theory.counting_estimate(np.asarray(res.num_accepted))
  rao_blackwell = theory.rao_blackwell_accepted(np.asarray(res.acceptance_probs, np.float64))
  return counted, rao_blackwell


def report_rows(pairs, num_samples: int = 100_000, seed: int = 0) -> list[dict]:
  pairs = list(pairs)
  check_enumerable(pairs)
  rows = []
  for i, pair in enumerate(pairs):
    args = (pair.drafter, pair.target, pair.context, pair.gamma)
    row = dict(name=pair.name, gamma=pair.gamma,
               token_exact=theory.expected_accepted("token", *args),
               block_exact=theory.expected_accepted("block", *args),
               bound=theory.full_information_bound(*args))
    for rule in ("token", "block"):
      counted, rao_blackwell = measure(pair, rule, num_samples, seed + i)
      row[f"{rule}_measured"], row[f"{rule}_stderr"], row[f"{rule}_rb"] = (
          counted.mean, counted.stderr, rao_blackwell.mean)
    rows.append(row)
  return rows


def format_table(rows) -> str:
  header = (f"{'pair':<22} {'γ':>2} | {'token exact':>11} {'measured':>15} | {'block exact':>11} {'measured':>15} "
            f"{'RB':>6} | {'bound':>6} | {'block gain':>10}")
  lines = [header, "-" * len(header)]
  for r in rows:
    gain = 100 * (r["block_exact"] - r["token_exact"]) / max(r["token_exact"], 1e-12)
    lines.append(
        f"{r['name']:<22} {r['gamma']:>2} | {r['token_exact']:>11.4f} {r['token_measured']:>8.4f} ±{r['token_stderr']:.4f}"
        f" | {r['block_exact']:>11.4f} {r['block_measured']:>8.4f} ±{r['block_stderr']:.4f} {r['block_rb']:>6.4f}"
        f" | {r['bound']:>6.4f} | {gain:>+9.1f}%")
  lines.append("Expected accepted draft tokens per iteration E[τ] (block efficiency = E[τ] + 1). 'measured': the jitted "
               "rules on sampled drafts, mean ± s.e.; RB: Rao–Blackwellised Σ w_i.")
  return "\n".join(lines)


# --- trees ---------------------------------------------------------------------------------------------------------

#: label -> per-depth branching of the tree shapes in the tree section.
TREE_SHAPES = {"chain γ=2": (1, 1), "2 chains d=2": (2, 1), "binary (2,2)": (2, 2)}

#: Pairs of :func:`default_pairs` in the tree section -> their short label there.
TREE_PAIRS = {"paper toy V=2": "toy V=2", "random V=3 depth=2": "rand V=3 d=2",
              "random V=5 depth=1": "rand V=5 d=1"}


def default_tree_pairs(seed: int = 0) -> list[PairSpec]:
  """The pairs of :data:`TREE_PAIRS` (the same models as :func:`default_pairs` with this seed), named by label."""
  pairs = {}
  for pair in default_pairs((2,), seed):
    if pair.name in TREE_PAIRS and pair.name not in pairs:
      pairs[pair.name] = dataclasses.replace(pair, name=TREE_PAIRS[pair.name])
  return [pairs[name] for name in TREE_PAIRS]


@functools.lru_cache(maxsize=None)
def _tree_runner(rule: str, parents: tuple[int, ...]):
  """jit(vmap) of ``verify.tree_verify`` for one rule and shape. On CPU with XLA's backend optimisation off: these
  small kernels then compile about 3x faster, which dominates the section's runtime (the law is the same)."""
  parents_N = np.asarray(parents, np.int32)
  options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
  return jax.jit(jax.vmap(lambda key, tokens_N, q_NxV, p_N1xV: verify.tree_verify(
      key, tokens_N, parents_N, q_NxV, p_N1xV, rule=rule)), compiler_options=options)


def measure_trees(pairs, rule: str, branching, num_samples: int, seed: int) -> list[theory.Estimate]:
  """Measured ``E[τ]`` of ``rule`` on trees of per-depth ``branching``, one estimate per pair (counting τ).

  ``num_samples`` trees per pair drawn by ``theory.sample_trees`` as ``verify.tree_sampling(rule)`` says, all pairs
  verified in one call: rows zero-padded to the largest vocabulary (a token of probability 0 under both models is
  never drawn, never accepted and adds nothing to a residual, so padding changes no law), one compile per (rule,
  shape).
  """
  parents_N = theory.branching_parents(branching)
  sampling = verify.tree_sampling(rule)
  vocab = max(pair.target.vocab_size for pair in pairs)
  tokens, q_rows, p_rows = [], [], []
  for i, pair in enumerate(pairs):
    tokens_BxN, q_BxNxV, p_BxN1xV = theory.sample_trees(np.random.default_rng([seed, i]), pair.drafter, pair.target,
                                                         pair.context, parents_N, num_samples, sampling)
    pad = ((0, 0), (0, 0), (0, vocab - pair.target.vocab_size))
    tokens.append(tokens_BxN)
    q_rows.append(np.pad(q_BxNxV, pad))
    p_rows.append(np.pad(p_BxN1xV, pad))
  keys = jax.random.split(jax.random.key(seed), num_samples * len(pairs))
  res = _tree_runner(rule, tuple(int(u) for u in parents_N))(
      keys, jnp.asarray(np.concatenate(tokens), jnp.int32), jnp.asarray(np.concatenate(q_rows), jnp.float32),
      jnp.asarray(np.concatenate(p_rows), jnp.float32))
  tau_PxB = np.asarray(res.num_accepted).reshape(len(pairs), num_samples)
  return [theory.counting_estimate(tau_B) for tau_B in tau_PxB]


def tree_report_rows(pairs, num_samples: int = 30_000, seed: int = 0) -> list[dict]:
  """One row per (pair, shape): ``name, shape, nodes`` and, per rule, ``{rule}_exact``, ``{rule}_measured``,
  ``{rule}_stderr``."""
  rows = {(pair.name, shape): dict(name=pair.name, shape=shape, nodes=int(np.sum(np.cumprod(branching))))
          for pair in pairs for shape, branching in TREE_SHAPES.items()}
  for j, (shape, branching) in enumerate(TREE_SHAPES.items()):
    parents_N = theory.branching_parents(branching)
    for k, rule in enumerate(sorted(verify.TREE_RULES)):
      estimates = measure_trees(pairs, rule, branching, num_samples, seed + 1000 * j + k)
      for pair, estimate in zip(pairs, estimates):
        row = rows[pair.name, shape]
        row[f"{rule}_exact"] = theory.tree_expected_accepted(rule, pair.drafter, pair.target, pair.context,
                                                             parents_N)
        row[f"{rule}_measured"], row[f"{rule}_stderr"] = estimate.mean, estimate.stderr
  return list(rows.values())


def format_tree_table(rows) -> str:
  """One line per (pair, shape); per rule ``exact  measured±s.e.``."""
  rules = sorted(verify.TREE_RULES)
  header = f"{'pair':<13} {'tree':<13} {'N':>2} | " + " | ".join(f"{rule:^22}" for rule in rules)
  subheader = f"{'':<13} {'':<13} {'':>2} | " + " | ".join(f"{'exact':>7} {'measured±s.e.':>14}" for _ in rules)
  lines = [header, subheader, "-" * len(header)]
  for r in rows:
    cells = [f"{r[f'{rule}_exact']:>7.4f} {r[f'{rule}_measured']:>7.4f}±{r[f'{rule}_stderr']:.4f}" for rule in rules]
    lines.append(f"{r['name']:<13} {r['shape']:<13} {r['nodes']:>2} | " + " | ".join(cells))
  sampling = ", ".join(f"{rule} {verify.tree_sampling(rule).replace('_', ' ')}" for rule in rules)
  lines.append("Trees: expected accepted nodes per iteration E[τ], exact (every tree enumerated) and measured (the "
               f"jitted rules on sampled trees, mean ± s.e.).\nSiblings drawn: {sampling}.")
  return "\n".join(lines)
