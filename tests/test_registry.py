"""Plug-ins are one declaration: a rule, its law and a drafter registered at run time join the registry-wide law
tests (the parametrizations of tests/test_laws.py, tests/test_theory.py and tests/test_engine_trees.py), the jobs'
method names and the engine, and leave every registry as it was; each mistake in a declaration is one message."""

import numpy as np
import pytest

from blockspec_jax import drafters, methods, theory, verify
from blockspec_jax.theory import trees as theory_trees
from blockspec_jax.verify import tree as verify_tree

from helpers import (GREEDY, PASS_P, T1, check_greedy_equals_autoregressive, default_pairs, lossless_rules, model_pair,
                     registries_restored, registry_params, rule_drafter_pairs, single_block_law_chi2, stable_seed,
                     untrained_drafter)


def _register_throwaways():
  """A copy of token verification under a new name with its own law (a copy of the token law), and a trivial chain
  drafter (the model chain under a new name): each one declaration."""

  @theory.chain_law("token_copy")
  def token_copy_law(p_rows_Gp1xV, q_rows_GxV, draft_G):
    return theory.conditional_law("token", p_rows_Gp1xV, q_rows_GxV, draft_G)

  @verify.register
  class TokenCopyVerifier(verify.Verifier):
    name = "token_copy"
    rule = staticmethod(verify.token_verify)
    theory_law = "token_copy"

  @drafters.register("echo_chain")
  class EchoChainDrafter(drafters.ModelDrafter):
    """The model chain, registered under another name."""

  return TokenCopyVerifier, EchoChainDrafter


def _ids(params) -> tuple[set, set]:
  """The ids of ``registry_params`` entries: all of them, and those of the default run (not ``heavy``)."""
  every = {p.id for p in params}
  default = {p.id for p in params if not any(mark.name == "heavy" for mark in p.marks)}
  return every, default


def test_a_rule_and_a_drafter_registered_at_run_time_join_the_registry_tests():
  before = (dict(verify.VERIFIERS), dict(theory.LAWS), dict(drafters.DRAFTERS))
  with registries_restored():
    verifier_cls, drafter_cls = _register_throwaways()
    assert verify.get_verifier("token_copy") == verifier_cls() and drafters.DRAFTERS["echo_chain"] is drafter_cls
    assert drafter_cls.name == "echo_chain" and verifier_cls.default_drafter == "model"
    # The parametrizations the law tests read: the single-block and reference-loop laws (test_laws: lossless chain
    # rules), the exact losslessness of the law (test_theory) and the engine, at T = 1 and T = 0 (test_engine_trees).
    assert "token_copy" in lossless_rules(T1, verify.CHAIN) and "token_copy" in lossless_rules(GREEDY)
    pairs = rule_drafter_pairs(T1)
    assert ("token_copy", "echo_chain") in pairs and ("block", "echo_chain") in pairs
    assert ("rrs", "echo_chain") in pairs and ("token_copy", "k_chains") not in pairs  # a chain rule, a tree drafter
    for sampler in (T1, GREEDY):
      every, default = _ids(registry_params(sampler))
      assert {"token_copy@model", "token_copy@echo_chain", "block@echo_chain"} <= every
      assert {"token_copy@model", "block@echo_chain"} <= default  # its default drafter; the first rule fitting it
    assert ("token_copy", "model") in default_pairs(pairs)
    # The jobs' method names see them.
    assert "token_copy" in methods.known_methods()
    assert methods.parse_method("token_copy@echo_chain") == ("token_copy", "echo_chain")
    assert methods.parse_method("token_copy") == ("token_copy", "model")
    # One law check on the throwaway rule (test_laws' single-block check: 200k seeded samples against its law) ...
    drafter, target = theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)
    res, tau_res = single_block_law_chi2("token_copy", drafter, target, (0,), 3, 200_000,
                                         seed=stable_seed("random_v3_d2", "token_copy"))
    print(f"token_copy: outcome χ² p = {res.p_value:.4g}, τ χ² p = {tau_res.p_value:.4g}")
    assert res.p_value > PASS_P and tau_res.p_value > PASS_P
    # ... and the pair through the jitted loop (test_engine_trees' greedy check).
    check_greedy_equals_autoregressive("token_copy", "echo_chain")
  assert (dict(verify.VERIFIERS), dict(theory.LAWS), dict(drafters.DRAFTERS)) == before
  assert "token_copy" not in lossless_rules(T1) and "echo_chain" not in drafters.DRAFTERS


def test_a_tree_rule_takes_its_sampling_and_default_drafter_from_its_law():
  with registries_restored():
    @verify.register
    class RRSCopy(verify.TreeVerifier):
      name = "rrs_copy"
      rule = staticmethod(verify_tree.rrs_tree_verify)
      theory_law = "rrs"

    assert RRSCopy.sibling_sampling == theory_trees.TREE_LAWS["rrs"].sampling == verify.WITH_REPLACEMENT
    assert RRSCopy.default_drafter == verify.DEFAULT_TREE_DRAFTERS[verify.WITH_REPLACEMENT] == "k_chains"
    assert verify.tree_sampling("rrs_copy") == verify.WITH_REPLACEMENT and "rrs_copy" in verify.TREE_RULES
    assert ("rrs_copy", "k_chains") in default_pairs(rule_drafter_pairs(T1))
    with pytest.raises(ValueError, match="needs siblings drawn with replacement"):
      verify.get_verifier("rrs_copy").check_drafter("'rsd_c'", drafters.DRAFTERS["rsd_c"])
  assert "rrs_copy" not in verify.TREE_RULES and "rrs_copy" not in verify.VERIFIERS


def test_each_mistake_in_a_rule_declaration_is_one_message():
  def declare(**attributes):
    return type("Bad", (attributes.pop("base", verify.Verifier),),
                {"rule": staticmethod(verify.token_verify), **attributes})

  with registries_restored():
    cases = {
        "already registered": declare(name="token", theory_law="token"),
        "must declare its own name": declare(theory_law="token"),
        "without '@'": declare(name="a@b", theory_law="token"),
        "declare its exact law": declare(name="no_law"),
        "not a law of theory.exact.LAWS .*known: token": declare(name="bad_law", theory_law="nope"),
        "must declare its rule function": type("Bad", (verify.Verifier,), {"name": "no_rule", "theory_law": "token"}),
        "structure must be": declare(name="odd", theory_law="token", structure="graph"),
        "declares sibling_sampling 'without_replacement' but its law 'rrs'": declare(
            base=verify.TreeVerifier, name="bad_tree", theory_law="rrs",
            sibling_sampling=verify.WITHOUT_REPLACEMENT),
        "sibling_sampling must be one of": declare(base=verify.TreeVerifier, name="lossy_tree", lossless=False),
    }
    for message, cls in cases.items():
      with pytest.raises(ValueError, match=message):
        verify.register(cls)

    class Shadow(verify.Verifier):
      name = "shadow"
      rule = staticmethod(verify.token_verify)
      theory_law: str = "token"  # annotated: a dataclass field, not the declaration

    with pytest.raises(ValueError, match="theory_law must be class attributes"):
      verify.register(Shadow)
    with pytest.raises(ValueError, match="takes a Verifier subclass"):
      verify.register(int)
    with pytest.raises(ValueError, match="law 'token' is already registered"):
      theory.chain_law("token")(lambda p, q, d: p)
    with pytest.raises(ValueError, match="sampling must be"):
      theory.tree_law("sometimes", sampling="sometimes")
    assert "shadow" not in verify.VERIFIERS


def test_each_mistake_in_a_drafter_declaration_is_one_message():
  with registries_restored():
    with pytest.raises(ValueError, match="drafter 'model' is already registered"):
      drafters.register("model")(type("Again", (drafters.ModelDrafter,), {}))
    with pytest.raises(ValueError, match="non-empty string without '/'"):
      drafters.register("heads/raw")
    with pytest.raises(ValueError, match="must mix in drafters.settings.Settings"):
      drafters.register("plain")(type("Plain", (), {}))
    with pytest.raises(ValueError, match="is_chain .*True exactly for 'chain' and 'beam'"):
      drafters.register("confused")(type("Confused", (drafters.ModelDrafter,), {"is_chain": False}))
    with pytest.raises(ValueError, match="no budget shapes for drafter 'lattice'"):
      drafters.shape_for_budget("lattice", 4)


def test_drafters_declare_their_defaults_and_untrained_parts():
  """What the jobs and the registry tests read from a drafter class instead of its name."""
  assert drafters.DRAFTERS["rsd_c"].default_settings(3) == {"branching": (2, 1, 1)}
  assert all(cls.default_settings(3) == {} for name, cls in drafters.DRAFTERS.items() if name != "rsd_c")
  config, target, drafter_params = model_pair()
  for name in drafters.DRAFTERS:
    drafter, params = untrained_drafter(name, config, target, drafter_params, gamma=3)
    assert type(drafter) is drafters.DRAFTERS[name] and drafter.num_nodes(3) >= 3
    assert params is not None or name == "ngram"
  sprinter, params = untrained_drafter("sprinter", config, target, drafter_params)
  np.testing.assert_array_equal(params["head"]["w_D"], 0.0)
