"""Exact theory of speculative decoding on small tabular models (numpy/scipy only: no jax, no gin).

* :mod:`~blockspec_jax.theory.tabular`: :class:`TabularLM`, the next-token law as a table.
* :mod:`~blockspec_jax.theory.exact`: exact laws of one iteration by enumeration (the registry :data:`LAWS`, filled
  by ``@chain_law``), closed forms, the full-information bound, i.i.d. formulas, losslessness checks.
* :mod:`~blockspec_jax.theory.trees`: exact laws of one tree-verification iteration (the registry
  :data:`TREE_LAWS`, filled by ``@tree_law`` with each rule's sibling sampling) by enumeration of every tree and the
  rule's coins; multi-iteration emitted-prefix laws.

Verifiers name the law they follow (``verify.Verifier.theory_law``); this package never imports ``verify`` (nor jax).
* :mod:`~blockspec_jax.theory.estimators`: Rao–Blackwellised and counting estimates of ``E[τ]`` from sampled drafts.
* :mod:`~blockspec_jax.theory.stats`: χ² goodness of fit against exact laws.
"""

from blockspec_jax.theory.estimators import (DraftSample, Estimate, block_weights, clipped_ratio, counting_estimate,
                                             rao_blackwell_accepted, sample_drafts, token_weights)
from blockspec_jax.theory.exact import (LAWS, ChainLaw, acceptance_rate, chain_law, conditional_law, emitted_prefix_law,
                                        exact_outcome_law, exact_tau_law, expected_accepted,
                                        expected_accepted_block_closed_form, expected_accepted_token_closed_form,
                                        full_information_bound, iid_block_efficiency, iid_expected_accepted,
                                        paper_toy, sequence_law)
from blockspec_jax.theory.stats import Chi2Result, chi2_gof
from blockspec_jax.theory.tabular import TabularLM, num_rows_for, row_offsets
from blockspec_jax.theory.trees import (MAX_ENUMERATED_TREES, TREE_LAWS, TREE_RULE_SAMPLING, TreeDraws, TreeLaw,
                                        branching_parents, check_parents, enumerate_trees, sample_trees, spectr_rho_f64,
                                        tree_conditional_law, tree_depths, tree_emitted_prefix_law,
                                        tree_expected_accepted, tree_law, tree_lossless_error, tree_outcome_law,
                                        tree_tau_law)

__all__ = [
    # tabular
    "TabularLM", "row_offsets", "num_rows_for",
    # exact
    "LAWS", "ChainLaw", "chain_law", "conditional_law", "exact_outcome_law", "exact_tau_law", "expected_accepted",
    "expected_accepted_token_closed_form", "expected_accepted_block_closed_form", "full_information_bound",
    "sequence_law", "emitted_prefix_law", "iid_expected_accepted", "iid_block_efficiency", "acceptance_rate",
    "paper_toy",
    # estimators
    "Estimate", "DraftSample", "clipped_ratio", "token_weights", "block_weights", "rao_blackwell_accepted",
    "counting_estimate", "sample_drafts",
    # stats
    "Chi2Result", "chi2_gof",
    # trees
    "TREE_LAWS", "TreeLaw", "tree_law", "TREE_RULE_SAMPLING", "MAX_ENUMERATED_TREES", "TreeDraws", "branching_parents",
    "check_parents", "tree_depths",
    "enumerate_trees", "sample_trees", "tree_conditional_law", "spectr_rho_f64", "tree_outcome_law", "tree_tau_law",
    "tree_expected_accepted", "tree_emitted_prefix_law", "tree_lossless_error",
]
