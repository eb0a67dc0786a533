"""The decoding engine: greedy equality, ragged rows, stop tokens, budgets, keys, errors (the model pair, prompts and
runs: tests/helpers.py; the law at T = 1 for every registered rule and drafter: tests/test_engine_trees.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter

from helpers import PROMPTS, init_params, model_pair, run_ar, run_spec, tiny_config


# γ = 2 for every registered rule with every registered drafter, and the law at T = 1 for every lossless rule:
# tests/test_engine_trees.py (registry-wide).
@pytest.mark.parametrize("gamma,verifier", [(1, "token"), (8, "block")])
def test_greedy_speculative_equals_autoregressive(gamma, verifier):
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, PROMPTS, keys, 20)
  out = run_spec(config, target, drafter, PROMPTS, keys, 20, gamma, verifier)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  np.testing.assert_array_equal(out.num_tokens_B, [20] * 4)
  m = out.metrics
  accepted = int(m.num_accepted_tokens.sum())
  assert 0 < accepted < int(m.num_draft_tokens.sum())  # some but not all drafts accepted: a real test
  np.testing.assert_array_equal(m.num_draft_tokens, gamma * m.num_drafts)
  np.testing.assert_array_equal(m.accepted_per_position_BxG[:, 0] >= m.accepted_per_position_BxG[:, -1], True)


def test_greedy_with_a_smaller_drafter():
  config, target, _ = model_pair()
  small = tiny_config(vocab_size=64, num_layers=1)
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, PROMPTS, keys, 12)
  out = run_spec(config, target, init_params(small, 5), PROMPTS, keys, 12, 3, drafter_config=small)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)


def test_row_output_does_not_depend_on_the_batch():
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(7), 4)
  t1 = sampling.Sampler(1.0)
  full = run_spec(config, target, drafter, PROMPTS, keys, 16, 3, "block", t1)
  for b in (0, 1, 3):
    alone = run_spec(config, target, drafter, [PROMPTS[b]], keys[b:b + 1], 16, 3, "block", t1)
    np.testing.assert_array_equal(full.tokens_BxN[b], alone.tokens_BxN[0])
  ar_full = run_ar(config, target, PROMPTS, keys, 10, t1)
  ar_alone = run_ar(config, target, [PROMPTS[2]], keys[2:3], 10, t1)
  np.testing.assert_array_equal(ar_full.tokens_BxN[2], ar_alone.tokens_BxN[0])


def test_same_key_same_output():
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(9), 4)
  a = run_spec(config, target, drafter, PROMPTS, keys, 16, 4, "block", sampling.Sampler(1.0))
  b = run_spec(config, target, drafter, PROMPTS, keys, 16, 4, "block", sampling.Sampler(1.0))
  np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
  c = run_spec(config, target, drafter, PROMPTS, jax.random.split(jax.random.key(10), 4), 16, 4, "block",
               sampling.Sampler(1.0))
  assert not np.array_equal(a.tokens_BxN, c.tokens_BxN)


def test_stop_token_inside_an_accepted_block():
  """Drafter = target at T = 0: every block is accepted whole, so the stop token lands inside one."""
  config, target, _ = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = np.asarray(run_ar(config, target, PROMPTS, keys, 20).tokens_BxN)
  stop = int(ar[0, 7])  # the 8th token of row 0: inside the second block of γ + 1 = 5
  out = run_spec(config, target, target, PROMPTS, keys, 20, 4, stop_ids=(stop,))
  ar_stop = run_ar(config, target, PROMPTS, keys, 20, stop_ids=(stop,))
  np.testing.assert_array_equal(out.tokens_BxN, ar_stop.tokens_BxN)
  np.testing.assert_array_equal(out.num_tokens_B, ar_stop.num_tokens_B)
  first = int(np.argmax(ar[0] == stop))
  assert int(out.num_tokens_B[0]) == first + 1 and bool(out.stopped_B[0])
  assert np.all(np.asarray(out.tokens_BxN[0, first + 1:]) == 0)  # pad after the row's end
  assert int(out.metrics.num_accepted_tokens[0]) == 4 * int(out.metrics.num_drafts[0])


def test_budget_reached_mid_block():
  config, target, _ = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, PROMPTS, keys, 13)
  out = run_spec(config, target, target, PROMPTS, keys, 13, 4)  # 13 = 5 + 5 + 3: the third block is cut
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  np.testing.assert_array_equal(out.num_tokens_B, [13] * 4)
  np.testing.assert_array_equal(out.metrics.num_emitted_tokens, [13] * 4)
  assert int(out.iterations) == 3 and not bool(np.any(out.stopped_B))


def test_prefill_then_decode_equals_one_program():
  """The phases compiled apart (as the main job times them) give exactly the one-program output, metrics included;
  a decode phase refuses a state prefilled for another budget or γ, and keys that are not one per row."""
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(3), 4)
  t1 = sampling.Sampler(1.0)
  tokens, lens = spec.prepare_prompts(PROMPTS)
  common = dict(target=config, drafter=ModelDrafter(config), gamma=3, max_new_tokens=14)
  for verifier in ("token", "block"):
    whole = run_spec(config, target, drafter, PROMPTS, keys, 14, 3, verifier, t1)
    state = spec.prefill_speculative(target, drafter, tokens, lens, **common)
    split = spec.decode_speculative(target, drafter, keys, state, verifier=verifier, sampler=t1, **common)
    chex.assert_trees_all_equal(split, whole)
  whole = run_ar(config, target, PROMPTS, keys, 9, t1)
  state = spec.prefill_autoregressive(target, tokens, lens, target=config, max_new_tokens=9)
  split = spec.decode_autoregressive(target, keys, state, target=config, max_new_tokens=9, sampler=t1)
  chex.assert_trees_all_equal(split, whole)
  # Raw uint32 keys (jax.random.PRNGKey style, [B, 2]) are the same keys: the same output.
  raw = spec.decode_autoregressive(target, jax.random.key_data(keys), state, target=config, max_new_tokens=9,
                                   sampler=t1)
  chex.assert_trees_all_equal(raw, whole)
  state = spec.prefill_speculative(target, drafter, tokens, lens, **common)
  with pytest.raises(ValueError, match="prefilled for 14 new tokens, decoding asks for 20"):
    spec.decode_speculative(target, drafter, keys, state, **dict(common, max_new_tokens=20))
  with pytest.raises(ValueError, match="prefilled for gamma = 3, decoding with gamma = 2"):
    spec.decode_speculative(target, drafter, keys, state, **dict(common, gamma=2, max_new_tokens=15))
  with pytest.raises(ValueError, match=r"keys_B must hold one key per row: shape \(4,\) .* got \(2,\)"):
    spec.decode_speculative(target, drafter, keys[:2], state, **common)
  with pytest.raises(ValueError, match=r"one key per row.*got \(3, 2\)"):
    spec.generate_autoregressive(target, jax.random.key_data(keys[:3]), tokens, lens, target=config,
                                 max_new_tokens=9)
  with pytest.raises(ValueError, match="one key per row"):
    spec.generate_autoregressive(target, keys[:3], tokens, lens, target=config, max_new_tokens=9)


def test_errors():
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  with pytest.raises(ValueError, match="gamma must be >= 1"):
    run_spec(config, target, drafter, PROMPTS, keys, 8, 0)
  other = tiny_config(vocab_size=32)
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    run_spec(config, target, init_params(other, 0), PROMPTS, keys, 8, 2, drafter_config=other)
  short = tiny_config(vocab_size=64, max_len=16)
  with pytest.raises(ValueError, match="prompt too long for the cache"):
    run_spec(short, target, drafter, PROMPTS, keys, 8, 2)
  with pytest.raises(ValueError, match="prompt too long for the cache"):
    run_ar(short, target, PROMPTS, keys, 10)
  with pytest.raises(ValueError, match="at least one token"):
    spec.prepare_prompts([[1, 2], []])
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    run_ar(config, target, PROMPTS, keys, 0)


def test_summarize_metrics_names_and_values():
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  out = run_spec(config, target, drafter, PROMPTS, keys, 12, 3)
  s = spec.summarize_metrics(out.metrics)
  m = out.metrics
  assert s["num_drafts"] == int(m.num_drafts.sum()) and s["num_draft_tokens"] == 3 * s["num_drafts"]
  assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
  assert s["draft_acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
  assert s["acceptance_per_position"][0] >= s["acceptance_per_position"][-1]
  assert sum(s["acceptance_per_position"]) == pytest.approx(s["num_accepted_tokens"] / s["num_drafts"])
  assert s["num_emitted_tokens"] == 48 and s["invalid_prob_rows"] == 0


def test_prompt_values_are_checked_before_decoding():
  """Lengths outside [1, P] and ids outside [0, V) are refused with the offending row named (not decoded)."""
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 2)
  tokens = jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)
  common = dict(target=config, max_new_tokens=4)
  for lens, message in (([3, 0], r"rows \[1\] have lengths \[0\]"), ([3, -2], r"rows \[1\] have lengths \[-2\]"),
                        ([4, 2], r"rows \[0\] have lengths \[4\]")):
    with pytest.raises(ValueError, match=message):
      spec.generate_autoregressive(target, keys, tokens, jnp.asarray(lens, jnp.int32), **common)
    with pytest.raises(ValueError, match=message):
      spec.prefill_speculative(target, drafter, tokens, jnp.asarray(lens, jnp.int32), drafter=ModelDrafter(config),
                               gamma=2, **common)
  lens = jnp.asarray([3, 2], jnp.int32)
  for bad, message in ((64, "row 1 position 1 holds 64"), (-1, "row 1 position 1 holds -1")):
    with pytest.raises(ValueError, match=message):
      spec.generate_speculative(target, drafter, keys, tokens.at[1, 1].set(bad), lens, drafter=ModelDrafter(config),
                                gamma=2, **common)
  # Padding past a row's length is not a prompt id: any value there is fine.
  spec.generate_autoregressive(target, keys, tokens.at[1, 2].set(999), lens, **common)


@pytest.mark.parametrize("method,temperature", [("autoregressive", 0.0), ("autoregressive", 1.0), ("block", 0.0),
                                                ("greedy", 1.0)])
def test_garbage_rows_are_counted_and_ids_stay_in_the_vocabulary(method, temperature):
  """A target whose logits are NaN (here: an out-of-vocabulary id reaching the embedding under jit, where values
  cannot be checked) must not commit ids outside [0, V), and every bad row is counted, at T = 0 as at T = 1."""
  config, target, drafter = model_pair()
  nan_target = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), target)
  keys = jax.random.split(jax.random.key(1), 4)
  sampler = sampling.Sampler(temperature)
  if method == "autoregressive":
    out = run_ar(config, nan_target, PROMPTS, keys, 6, sampler)
  else:
    with pytest.warns(UserWarning, match="greedy") if method == "greedy" and temperature > 0 else _no_warning():
      out = run_spec(config, nan_target, drafter, PROMPTS, keys, 6, 3, method, sampler)
  tokens = np.asarray(out.tokens_BxN)
  assert ((tokens >= 0) & (tokens < config.vocab_size)).all()
  assert (np.asarray(out.metrics.invalid_prob_rows) > 0).all()
  assert spec.summarize_metrics(out.metrics)["invalid_prob_rows"] > 0


class _no_warning:
  def __enter__(self):
    import warnings
    self._ctx = warnings.catch_warnings()
    self._ctx.__enter__()
    warnings.simplefilter("error", UserWarning)

  def __exit__(self, *exc):
    return self._ctx.__exit__(*exc)
