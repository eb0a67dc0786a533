"""Verification rules for speculative decoding (see rules.py for the single-block contract, tree.py for trees).

A rule is a :class:`Verifier` subclass registered by ``@verify.register`` (verifiers.py): the registry
:data:`VERIFIERS` is what the jobs, ``methods`` and the registry-wide tests read.
"""

from blockspec_jax.verify.rules import (LENIENT_FUNCTIONS, VerifyResult, block_acceptance_thresholds, block_verify,
                                        block_verify_eager, block_weights, clipped_ratio, exact_match_verify,
                                        greedy_verify, joint_verify, lenient_verify, token_verify)
from blockspec_jax.verify.validation import (BAD_SUM, NEGATIVE, NOT_FINITE, check_block_shapes, describe_errors,
                                             distribution_errors, validate_block, validate_distributions)
from blockspec_jax.verify.verifiers import (CHAIN, DEFAULT_TREE_DRAFTERS, DEFAULT_VERIFIER, TREE, VERIFIERS,
                                            BlockVerifier, ExactMatchVerifier, GreedyVerifier, JointVerifier,
                                            LenientVerifier, SprinterVerifier, TokenVerifier, TreeVerifier, Verdict,
                                            Verifier, get_verifier, register, row_keys, warn_if_inexact)
from blockspec_jax.verify.tree import (TREE_RULES, WITH_REPLACEMENT, WITHOUT_REPLACEMENT, TreeVerifyResult,
                                       chain_parents, check_tree, tree_sampling, tree_verify)
from blockspec_jax.verify.traversal import traversal_verify

import jax as _jax

#: Batched forms: the single-block rules mapped over a leading batch axis (one key per row).
token_verify_batch = _jax.vmap(token_verify)
block_verify_batch = _jax.vmap(block_verify)
greedy_verify_batch = _jax.vmap(greedy_verify)
exact_match_verify_batch = _jax.vmap(exact_match_verify)
