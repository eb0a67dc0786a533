"""Verifiers: frozen dataclasses wrapping one rule, with a batched form; the registry ``VERIFIERS`` (by name, or gin).

A rule is one class registered by one decorator; nothing else in the library names it::

    @register
    class TokenVerifier(Verifier):
      name = "token"                          # the registered name (jobs, methods "token@model", gin)
      rule = staticmethod(rules.token_verify)  # the single-block function (verify/rules.py's contract)
      theory_law = "token"                    # its exact numpy law: a name of theory.exact.LAWS (@chain_law)
      takes_coins = True

:func:`register` makes the class a frozen dataclass (settings are its fields, e.g. lenient's ``epsilon``), checks its
declarations, completes what they imply (a tree rule's sibling sampling from its law, a default drafter from that)
and adds it to :data:`VERIFIERS` (tree rules also to ``verify.tree.TREE_RULES``). The registry-wide tests
(tests/test_laws.py, tests/test_engine_trees.py, tests/test_tree_verify.py) then run every registered lossless rule
against its law, with every registered drafter it accepts (:meth:`Verifier.check_drafter`).

Every rule declares what the engine, the jobs and the tests need to know about it (class attributes):

=====================  ==========================================================================================
``lossless``           exactly the target's law when the draft law passed in is the one the draft was drawn from
``requires_greedy_target``  lossless only for a greedy (temperature 0) target (the greedy rule)
``needs_draft_probs``  reads the drafter rows ``q`` (False: greedy, exact-match)
``structure``          ``"chain"`` (verifies one chain of γ tokens) or ``"tree"`` (any tree, chains included)
``theory_law``         the exact law it follows: a name of ``theory.exact.LAWS`` (chain rules) or of
                       ``theory.trees.TREE_LAWS`` (tree rules); required of lossless rules, None for rules whose law
                       lives elsewhere (MTAD: :mod:`blockspec_jax.theory.lossy`)
``sibling_sampling``   for tree rules, how siblings must be drawn: ``"with_replacement"`` / ``"without_replacement"``
                       (read from the tree law at registration: declared once, in the theory)
``default_drafter``    the drafter a bare rule name runs with in jobs: ``"model"`` (the model chain) unless declared;
                       tree rules: :data:`DEFAULT_TREE_DRAFTERS` by their sibling sampling
``takes_coins``        ``rule`` accepts ``coins=`` (the uniforms, ``[γ]``): the reference loop's coin-keying study
``skips_target``       the rule decides itself when the target is called (SPRINTER): it runs its own loop
                       (:meth:`Verifier.decode`), not one target pass per draft
``reads_q_as_likelihood``  the rule reads ``q`` only as the drafter's likelihood of the drafted tokens (MTAD), so it
                       may verify beam drafts, whose tokens are not draws from ``q``
=====================  ==========================================================================================

Lossy rules (``lossless = False``) are ``lenient`` (DistillSpec), ``mtad`` (MJSD/MTAD joint verification of beam
drafts) and ``sprinter`` (a learned verifier head that skips the target); each states its error law in its docstring.

Chain rules (:mod:`blockspec_jax.verify.rules`) and tree rules (:mod:`blockspec_jax.verify.tree`,
:mod:`blockspec_jax.verify.traversal`) share one registry; :meth:`Verifier.verify_draft` is the engine's one entry
point for both.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp

from flax import struct

from blockspec_jax.contracts import SAMPLING_BEAM, SAMPLING_CHAIN, Draft, accepted_path
from blockspec_jax.theory import exact as theory_exact
from blockspec_jax.theory import trees as theory_trees
from blockspec_jax.verify import rules, traversal, tree
from blockspec_jax.verify.tree import POINT_MASS, TREE_RULES, WITH_REPLACEMENT, WITHOUT_REPLACEMENT, check_tree

__all__ = ["Verifier", "TokenVerifier", "BlockVerifier", "GreedyVerifier", "ExactMatchVerifier", "LenientVerifier",
           "JointVerifier", "SprinterVerifier", "SPRINTER_DEFAULT_CAP", "TreeVerifier", "RRSVerifier",
           "RRSWithoutReplacementVerifier", "SpecTrVerifier", "TraversalVerifier", "Verdict", "VERIFIERS",
           "DEFAULT_VERIFIER", "DEFAULT_TREE_DRAFTERS", "CHAIN", "TREE", "register", "get_verifier", "row_keys",
           "warn_if_inexact"]

CHAIN = "chain"
TREE = "tree"

#: The drafter a bare tree rule runs with, by the sibling sampling it needs: SpecTr's k i.i.d. chains, RSD-C trees.
DEFAULT_TREE_DRAFTERS = {WITH_REPLACEMENT: "k_chains", WITHOUT_REPLACEMENT: "rsd_c", POINT_MASS: "heads_tree"}

#: name -> registered Verifier class, in registration order (filled by :func:`register`).
VERIFIERS: dict[str, type["Verifier"]] = {}
DEFAULT_VERIFIER = "block"


@struct.dataclass
class Verdict:
  """A verified draft, per row, in the engine's terms (``G`` = γ, the draft's maximum depth).

  ``num_accepted_B``       int32 ``[B]``      τ: nodes on the accepted path
  ``path_BxG``             int32 ``[B, G]``   the accepted node at depth ``i + 1`` (−1 from τ on)
  ``next_token_B``         int32 ``[B]``      the correction or bonus token
  ``expected_accepted_B``  f32 ``[B]``        the Rao–Blackwellised ``Σ_i P(τ ≥ i | draft)`` where the rule provides
                                              it (chain rules), NaN otherwise (tree rules)
  """
  num_accepted_B: jax.Array
  path_BxG: jax.Array
  next_token_B: jax.Array
  expected_accepted_B: jax.Array


def row_keys(key: jax.Array, batch_size: int) -> jax.Array:
  """Per-row keys ``fold_in(key, row)``: a row's randomness depends only on its index, not on its neighbours."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch_size, dtype=jnp.uint32))


@dataclasses.dataclass(frozen=True)
class Verifier:
  """A verification rule plus its settings. Call it on one block; ``batch`` maps it over rows with ``jax.vmap``.

  Subclasses declare the class attributes of the module docstring and are registered by :func:`register`.
  Hashable and static under ``jax.jit``.
  """

  name: ClassVar[str] = ""
  lossless: ClassVar[bool] = True
  requires_greedy_target: ClassVar[bool] = False
  needs_draft_probs: ClassVar[bool] = True
  structure: ClassVar[str] = CHAIN
  theory_law: ClassVar[str | None] = None
  sibling_sampling: ClassVar[str | None] = None
  default_drafter: ClassVar[str | None] = "model"
  takes_coins: ClassVar[bool] = False
  skips_target: ClassVar[bool] = False
  reads_q_as_likelihood: ClassVar[bool] = False
  rule: ClassVar[Callable[..., rules.VerifyResult]]

  def check_drafter(self, drafter_name: str, drafter) -> None:
    """Raise a ValueError when drafts of ``drafter`` (a drafter class or instance: its declared ``is_chain`` and
    ``sibling_sampling``) cannot be verified by this rule (losslessly, for a lossless rule)."""
    is_chain, sibling_sampling = drafter.is_chain, drafter.sibling_sampling
    if sibling_sampling == SAMPLING_BEAM and self.needs_draft_probs and not self.reads_q_as_likelihood:
      fitting = ", ".join(sorted(n for n, c in VERIFIERS.items() if c.structure == CHAIN and (
          c.reads_q_as_likelihood or not c.needs_draft_probs)))
      raise ValueError(f"verifier {self.name!r} reads q as the law the draft was drawn from, but drafter "
                       f"{drafter_name} returns the best of several beams (its tokens are not draws from q): the "
                       f"rule's law would not hold; verify beam drafts with {fitting}")
    if self.structure == CHAIN and not is_chain:
      tree_rules = ", ".join(sorted(n for n, c in VERIFIERS.items() if c.structure == TREE))
      raise ValueError(f"verifier {self.name!r} verifies chains, but drafter {drafter_name} draws trees; use a tree "
                       f"rule ({tree_rules})")
    if (self.structure == TREE and sibling_sampling != SAMPLING_CHAIN
        and sibling_sampling != self.sibling_sampling):
      fitting = ", ".join(sorted(n for n, c in VERIFIERS.items()
                                 if c.structure == TREE and c.sibling_sampling == sibling_sampling))
      raise ValueError(f"verifier {self.name!r} needs siblings drawn {self.sibling_sampling.replace('_', ' ')}, but "
                       f"drafter {drafter_name} draws them {sibling_sampling.replace('_', ' ')}: the result would "
                       f"not be lossless; use {fitting or 'a rule for that sampling'}")

  def verify_draft(self, keys_B, draft: Draft, p_BxN1xV, depth_BxN, gamma: int) -> Verdict:
    """Verify every row's draft against the target rows ``p_BxN1xV`` (row 0: after the last committed token, row
    ``n + 1``: after node ``n``); ``depth_BxN`` from :func:`blockspec_jax.contracts.node_depths`."""
    if not draft.is_chain:
      raise ValueError(f"verifier {self.name!r} verifies chains; the draft is a tree")
    res = self.batch(keys_B, draft.tokens_BxN, draft.q_rows(p_BxN1xV.shape[-1]), p_BxN1xV)
    index_G = jnp.arange(gamma, dtype=jnp.int32)
    path_BxG = jnp.where(index_G[None, :] < res.num_accepted[:, None], index_G[None, :], -1)
    return Verdict(res.num_accepted, path_BxG, res.next_token, jnp.sum(res.acceptance_probs, axis=1))

  def lossless_under(self, sampler) -> bool:
    """Whether decoding with this rule has exactly the target's law under ``sampler`` (a ``sampling.Sampler``)."""
    return self.lossless and (sampler.temperature == 0.0 or not self.requires_greedy_target)

  def __call__(self, key, draft_tokens, draft_probs, target_probs) -> rules.VerifyResult:
    return type(self).rule(key, draft_tokens, draft_probs, target_probs)

  def batch(self, keys_B, draft_tokens_BxG, draft_probs_BxGxV, target_probs_BxG1xV) -> rules.VerifyResult:
    """Verify ``B`` independent blocks; ``keys_B`` holds one key per row (see :func:`row_keys`)."""
    for name, x, rank in (("draft_tokens", draft_tokens_BxG, 2), ("draft_probs", draft_probs_BxGxV, 3),
                          ("target_probs", target_probs_BxG1xV, 3)):
      if jnp.ndim(x) != rank:
        raise ValueError(f"batched {name} must have rank {rank} (leading batch axis), got shape {jnp.shape(x)}")
    sizes = {jnp.shape(keys_B)[0], jnp.shape(draft_tokens_BxG)[0], jnp.shape(draft_probs_BxGxV)[0],
             jnp.shape(target_probs_BxG1xV)[0]}
    if len(sizes) != 1:
      raise ValueError(f"batch sizes differ: keys {jnp.shape(keys_B)}, draft_tokens {jnp.shape(draft_tokens_BxG)}, "
                       f"draft_probs {jnp.shape(draft_probs_BxGxV)}, target_probs {jnp.shape(target_probs_BxG1xV)}")
    return jax.vmap(self)(keys_B, draft_tokens_BxG, draft_probs_BxGxV, target_probs_BxG1xV)


@dataclasses.dataclass(frozen=True)
class TreeVerifier(Verifier):
  """The base of tree rules: ``rule(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)`` (the contract
  of :mod:`blockspec_jax.verify.tree`) on any tree of ``N`` nodes (a chain is one). Lossless when siblings are drawn
  as ``sibling_sampling`` says, which a registered tree rule takes from its ``theory_law``
  (``theory.trees.TREE_LAWS``)."""
  structure: ClassVar[str] = TREE
  default_drafter: ClassVar[str | None] = None  # at registration: DEFAULT_TREE_DRAFTERS[sibling_sampling]

  def __call__(self, key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV):
    check_tree(tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
    return type(self).rule(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)

  def batch(self, keys_B, tokens_BxN, parents_BxN, draft_probs_BxNxV, target_probs_BxN1xV):
    """Verify ``B`` independent trees (one key per row); a :class:`~blockspec_jax.verify.TreeVerifyResult`."""
    return jax.vmap(self)(keys_B, tokens_BxN, parents_BxN, draft_probs_BxNxV, target_probs_BxN1xV)

  def verify_draft(self, keys_B, draft: Draft, p_BxN1xV, depth_BxN, gamma: int) -> Verdict:
    res = self.batch(keys_B, draft.tokens_BxN, draft.parents_BxN, draft.q_rows(p_BxN1xV.shape[-1]), p_BxN1xV)
    nan_B = jnp.full(res.num_accepted.shape, jnp.nan, jnp.float32)
    return Verdict(res.num_accepted, accepted_path(res.accepted_N, depth_BxN, gamma), res.next_token, nan_B)


_DECLARATIONS = ("name", "lossless", "requires_greedy_target", "needs_draft_probs", "structure", "theory_law",
                 "sibling_sampling", "default_drafter", "takes_coins", "skips_target", "reads_q_as_likelihood", "rule")


def register(cls: type[Verifier]) -> type[Verifier]:
  """Class decorator: register the Verifier subclass ``cls`` under ``cls.name`` (see the module docstring).

  Makes ``cls`` a frozen dataclass when its body is not one already; checks its declarations (a ValueError naming
  the first problem: a missing or taken name, a declaration shadowed by a field, an unknown structure, a lossless
  rule without a law, a law the theory does not have, a sibling sampling that contradicts the law's); fills in a tree
  rule's ``sibling_sampling`` from its law and its ``default_drafter`` from that; adds it to :data:`VERIFIERS` and, for
  a tree rule, ``(rule, sibling_sampling)`` to ``verify.tree.TREE_RULES``. Returns the class.
  """
  if not (isinstance(cls, type) and issubclass(cls, Verifier)):
    raise ValueError(f"register takes a Verifier subclass, got {cls!r}")
  name = cls.__dict__.get("name")
  if not isinstance(name, str) or not name or any(c in name for c in "@/: "):
    raise ValueError(f"verifier class {cls.__name__} must declare its own name (a non-empty string without '@', "
                     f"'/', ':' or spaces: methods are written '<rule>@<drafter>'), got {name!r}")
  if name in VERIFIERS:
    raise ValueError(f"verifier {name!r} is already registered ({VERIFIERS[name].__qualname__})")
  if "__dataclass_params__" not in cls.__dict__:
    cls = dataclasses.dataclass(frozen=True)(cls)
  shadowed = sorted({f.name for f in dataclasses.fields(cls)} & set(_DECLARATIONS))
  if shadowed:
    raise ValueError(f"verifier {name!r}: {', '.join(shadowed)} must be class attributes (no type annotation, or "
                     f"ClassVar), not dataclass fields")
  if cls.structure not in (CHAIN, TREE):
    raise ValueError(f"verifier {name!r}: structure must be {CHAIN!r} or {TREE!r}, got {cls.structure!r}")
  if not cls.skips_target and not callable(getattr(cls, "rule", None)):
    raise ValueError(f"verifier {name!r} must declare its rule function (rule = staticmethod(fn))")
  laws = theory_exact.LAWS if cls.structure == CHAIN else theory_trees.TREE_LAWS
  where = "theory.exact.LAWS (@chain_law)" if cls.structure == CHAIN else "theory.trees.TREE_LAWS (@tree_law)"
  if cls.theory_law is None and cls.lossless:
    raise ValueError(f"verifier {name!r} is lossless: declare its exact law (theory_law = a name of {where}) so the "
                     f"law tests can check it")
  if cls.theory_law is not None and cls.theory_law not in laws:
    raise ValueError(f"verifier {name!r}: theory_law {cls.theory_law!r} is not a law of {where}; known: "
                     f"{', '.join(laws)}")
  if cls.structure == TREE:
    declared = cls.__dict__.get("sibling_sampling")
    if cls.theory_law is not None:
      law_sampling = laws[cls.theory_law].sampling
      if declared is not None and declared != law_sampling:
        raise ValueError(f"verifier {name!r} declares sibling_sampling {declared!r} but its law {cls.theory_law!r} "
                         f"is exact for {law_sampling!r}: declare it once, with the law (theory.trees.tree_law)")
      cls.sibling_sampling = law_sampling
    if cls.sibling_sampling not in DEFAULT_TREE_DRAFTERS:
      raise ValueError(f"tree verifier {name!r}: sibling_sampling must be one of {', '.join(DEFAULT_TREE_DRAFTERS)}, "
                       f"got {cls.sibling_sampling!r}")
    if cls.default_drafter is None:
      cls.default_drafter = DEFAULT_TREE_DRAFTERS[cls.sibling_sampling]
    TREE_RULES[name] = (cls.rule, cls.sibling_sampling)
  VERIFIERS[name] = cls
  return cls


# --- the chain rules -----------------------------------------------------------------------------------------------

@register
class BlockVerifier(Verifier):
  name = "block"
  rule = staticmethod(rules.block_verify)
  theory_law = "block"
  takes_coins = True


@register
class TokenVerifier(Verifier):
  name = "token"
  rule = staticmethod(rules.token_verify)
  theory_law = "token"
  takes_coins = True


@register
class GreedyVerifier(Verifier):
  """Lossless only for a greedy (temperature 0) target; at T > 0 it emits argmaxes, not samples."""
  name = "greedy"
  requires_greedy_target = True
  needs_draft_probs = False
  rule = staticmethod(rules.greedy_verify)
  theory_law = "greedy"


@register
class ExactMatchVerifier(Verifier):
  name = "exact_match"
  needs_draft_probs = False
  rule = staticmethod(rules.exact_match_verify)
  theory_law = "exact_match"


@register
class LenientVerifier(Verifier):
  """DistillSpec's lenient verification (:func:`~blockspec_jax.verify.rules.lenient_verify`): LOSSY for ``ε < 1``.

  Accepts ``X_i`` with probability ``min(1, f(p, ε)/q)``, ``f`` ∈ ``"div"`` (``p/ε``), ``"div2"`` (``p/ε²``),
  ``"pow"`` (``p^ε``); ``ε = 1`` is token verification. Registered as ``"lenient"`` (ε = 0.5, f = "div"); other
  settings by ``get_verifier("lenient", epsilon=0.2, f="pow")`` or ``LenientVerifier(epsilon=0.2, f="pow")``,
  either accepted wherever a verifier is (``verifier=`` of the decoding loops). Its exact error on tabular models:
  :func:`blockspec_jax.theory.exact.one_step_tv`. Lossless only at ``ε = 1`` and for a greedy (T = 0) target: a
  one-hot ``p`` gives ``f(1) ≥ 1`` and ``f(0) = 0``, so the verdicts are the greedy rule's.
  """
  name = "lenient"
  lossless = False
  rule = staticmethod(rules.lenient_verify)
  theory_law = "lenient"
  epsilon: float = rules.LENIENT_DEFAULT_EPSILON
  f: str = "div"

  def __post_init__(self):
    epsilon, f = rules.check_lenient_settings(self.epsilon, self.f)
    object.__setattr__(self, "epsilon", epsilon)
    object.__setattr__(self, "f", f)

  def lossless_under(self, sampler) -> bool:
    """True only at ``ε = 1`` (token verification) or for a greedy (T = 0) target."""
    return self.epsilon == 1.0 or sampler.temperature == 0.0

  def __call__(self, key, draft_tokens, draft_probs, target_probs) -> rules.VerifyResult:
    return rules.lenient_verify(key, draft_tokens, draft_probs, target_probs, epsilon=self.epsilon, f=self.f)


@register
class JointVerifier(Verifier):
  """MJSD / MTAD joint verification (:func:`~blockspec_jax.verify.rules.joint_verify`): LOSSY.

  Accepts the longest prefix whose joint log-likelihood ratio ``Σ log p − log q`` exceeds ``log τ`` (every prefix
  scanned), then one plain target sample. Runs by default on beam drafts (drafter ``"beam"``: the best of ``W``
  beams with its per-token ``q``); on sampled chains (``"mtad@model"``) it shares drafts with token and block
  verification. Lossless only for a greedy (T = 0) target (it then accepts only target-argmax tokens) and at
  ``τ = inf`` (nothing accepted). Its exact error on tabular models: :mod:`blockspec_jax.theory.lossy` (beam drafts
  are not the sampled drafts of ``theory.exact``, so it names no ``theory_law``).
  """
  name = "mtad"
  lossless = False
  default_drafter = "beam"
  reads_q_as_likelihood = True
  rule = staticmethod(rules.joint_verify)
  tau: float = rules.JOINT_DEFAULT_TAU

  def __post_init__(self):
    object.__setattr__(self, "tau", rules.check_joint_tau(self.tau))

  def lossless_under(self, sampler) -> bool:
    return sampler.temperature == 0.0 or self.tau == float("inf")

  def __call__(self, key, draft_tokens, draft_probs, target_probs) -> rules.VerifyResult:
    return rules.joint_verify(key, draft_tokens, draft_probs, target_probs, tau=self.tau)


#: SPRINTER's default cap: the target is called at the latest after this many drafted tokens.
SPRINTER_DEFAULT_CAP = 20


@register
class SprinterVerifier(Verifier):
  """SPRINTER (Zhong et al., arXiv 2502.04557): a learned verifier head decides when the target is called: LOSSY.

  The drafter (``"sprinter"``: a model drafter with a linear + sigmoid head on its last hidden state) drafts one
  token at a time; the head reads the hidden state at the position that PRODUCED the token (so its decision does not
  depend on the token drawn) and accepts it when ``sigmoid(w·h + b) ≥ threshold``. The first token the head does
  not accept, or the ``cap``-th token of the segment, is *flagged*: the target scores the segment in one pass and
  the flagged token alone goes through the speculative-sampling test (``min(1, p/q)``, residual on rejection); when
  it passes, ``bonus`` (default, as the paper's code) adds one token drawn from the target's law after it (the pass
  scores one more position). The loop is :func:`blockspec_jax.decoding.sprinter.sprinter_decode` (``skips_target``).

  Where the head decides, the emitted law is ``p`` where flagged and ``q`` where accepted: ``(1 − η)·p + η·q`` with
  ``η`` the head's acceptance of that context, so ``TV = η·TV(p, q)`` at that step; a bonus token has law ``p``
  (its presence depends on the flagged token's acceptance: the exact law is
  :func:`blockspec_jax.theory.lossy.sprinter_sequence_law`). ``threshold > 1`` flags everything (token verification
  one token at a time, plus the bonus: lossless), ``threshold = 0`` accepts everything up to the cap.
  """
  name = "sprinter"
  lossless = False
  default_drafter = "sprinter"
  skips_target = True
  threshold: float = 0.5
  cap: int = SPRINTER_DEFAULT_CAP
  bonus: bool = True

  def __post_init__(self):
    t = self.threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
      raise ValueError(f"SPRINTER's threshold must be a number >= 0 (the head accepts a token when its probability "
                       f"is >= threshold; > 1 flags every token), got {t!r}")
    c = self.cap
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
      raise ValueError(f"SPRINTER's cap must be an integer >= 1 (the longest segment before the target is called), "
                       f"got {c!r}")
    if not isinstance(self.bonus, bool):
      raise ValueError(f"SPRINTER's bonus must be True (a token from the target's law after an accepted flagged "
                       f"token, as the paper's code) or False (none), got {self.bonus!r}")
    object.__setattr__(self, "threshold", float(t))

  def check_drafter(self, drafter_name: str, drafter) -> None:
    if not hasattr(drafter, "acceptable_probs"):
      raise ValueError(f"verifier {self.name!r} needs a drafter with a verifier head (acceptable_probs: drafter "
                       f"'sprinter'), got {drafter_name}")
    super().check_drafter(drafter_name, drafter)

  def lossless_under(self, sampler) -> bool:
    return self.threshold > 1.0

  def verify_draft(self, keys_B, draft: Draft, p_BxN1xV, depth_BxN, gamma: int) -> Verdict:
    raise ValueError(f"verifier {self.name!r} skips the target: it runs its own loop (decoding.sprinter), not one "
                     "verification per draft")


# --- the tree rules (verify/tree.py, verify/traversal.py); the sibling sampling comes with their law ----------------

@register
class RRSVerifier(TreeVerifier):
  """Recursive rejection sampling (SpecInfer) over i.i.d. siblings."""
  name = "rrs"
  rule = staticmethod(tree.rrs_tree_verify)
  theory_law = "rrs"


@register
class RRSWithoutReplacementVerifier(TreeVerifier):
  """Recursive rejection sampling (RSD) over siblings drawn without replacement."""
  name = "rrs_wor"
  rule = staticmethod(tree.rrs_wor_tree_verify)
  theory_law = "rrs_wor"


@register
class PointMassVerifier(TreeVerifier):
  """Recursive rejection sampling over fixed siblings, each its own point mass (BPD's p best paths verified
  together)."""
  name = "point_mass"
  rule = staticmethod(tree.point_mass_tree_verify)
  theory_law = "point_mass"
  needs_draft_probs = False


@register
class SpecTrVerifier(TreeVerifier):
  """SpecTr's k-sequential selection over i.i.d. siblings."""
  name = "spectr"
  rule = staticmethod(tree.spectr_tree_verify)
  theory_law = "spectr"


@register
class TraversalVerifier(TreeVerifier):
  """Traversal verification (Weng et al., NeurIPS 2025) over siblings drawn without replacement."""
  name = "traversal"
  rule = staticmethod(traversal.traversal_verify)
  theory_law = "traversal"


_warned_inexact: set = set()  # (rule name, temperature) pairs already warned about in this process


def warn_if_inexact(verifier: Verifier, sampler) -> bool:
  """Warn (once per rule and temperature in a process) when ``verifier`` does not sample the target's law under
  ``sampler`` although the user asked for sampling (e.g. the greedy rule at T > 0). Returns True when inexact."""
  if verifier.lossless_under(sampler):
    return False
  key = (verifier.name, float(sampler.temperature))
  if key not in _warned_inexact:
    _warned_inexact.add(key)
    why = ("it is lossless only for a greedy (T = 0) target" if verifier.requires_greedy_target
           else "it is a lossy rule")
    warnings.warn(f"verifier {verifier.name!r} at temperature {sampler.temperature:g} does not sample the target's "
                  f"distribution: {why}; use 'block' or 'token' for exact sampling", UserWarning, stacklevel=3)
  return True


def get_verifier(name: str = DEFAULT_VERIFIER, **settings) -> Verifier:
  """The verifier registered under ``name`` ("block" by default) built with ``settings`` (e.g. ``epsilon`` and ``f``
  of "lenient"); a Verifier instance is returned as is; unknown names list the known ones."""
  if isinstance(name, Verifier):
    return name
  try:
    cls = VERIFIERS[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(sorted(VERIFIERS))}") from None
  return cls(**settings)
