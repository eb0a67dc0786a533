"""The contract for drafters that read the target (BPD heads, SD² steering): the decoder's layer taps and MLP deltas,
the scorer's taps, the prefill's prompt commit and every iteration's commit carry the target's states at the
position before the last committed token, on chains and on trees."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling
from blockspec_jax import contracts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.models import decoder as dec
from blockspec_jax.models.scorer import DecoderScorer, as_scorer

T1 = sampling.Sampler(temperature=1.0)
CONFIG = dec.DecoderConfig.tiny(vocab_size=32, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
                                ffn_dim=24, max_len=128)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]


def params(seed):
  return dec.init_params(CONFIG, seed)


def full_pass(target_params, tokens, layers):
  """hidden [T, D] and taps [T, L', D] of one causal pass over ``tokens``."""
  scorer = DecoderScorer(CONFIG, layers)
  positions = jnp.arange(len(tokens))[None]
  scored = scorer.score(target_params, jnp.asarray([tokens], jnp.int32), positions, positions,
                        dec.causal_mask(positions, 64), dec.init_cache(CONFIG, 1, 64))
  return np.asarray(scored.hidden_BxTxD[0]), np.asarray(scored.taps_BxTxLxD[0])


def test_taps_are_the_residual_stream_and_the_last_tap_normed_is_the_hidden_state():
  tp = params(0)
  tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
  positions = jnp.arange(5)[None]
  mask = dec.causal_mask(positions, 8)
  module = dec.Decoder(CONFIG)
  logits, _, hidden, taps = module.apply({"params": tp}, tokens, positions, dec.init_cache(CONFIG, 1, 8), mask,
                                         return_hidden=True, tap_layers=(2, 0))
  plain, _ = module.apply({"params": tp}, tokens, positions, dec.init_cache(CONFIG, 1, 8), mask)
  np.testing.assert_array_equal(logits, plain)  # taps change nothing else
  assert taps.shape == (1, 5, 2, CONFIG.d_model)
  normed = dec.RMSNorm(CONFIG.rms_eps).apply({"params": tp["final_norm"]}, taps[:, :, 0])
  np.testing.assert_allclose(normed, hidden, rtol=1e-5, atol=1e-5)  # tap after the last layer, normed = hidden
  one, _, _, tap0 = dec.Decoder(dataclasses.replace(CONFIG, num_layers=1)).apply(
      {"params": {k: v for k, v in tp.items() if k not in ("layers_1", "layers_2")}}, tokens, positions,
      dec.init_cache(dataclasses.replace(CONFIG, num_layers=1), 1, 8), mask, return_hidden=True, tap_layers=(0,))
  np.testing.assert_allclose(taps[:, :, 1], tap0[:, :, 0], rtol=1e-6, atol=1e-6)
  for bad in ((3,), (-1,), (True,), (0.0,)):
    with pytest.raises(ValueError, match="tap_layers"):
      module.apply({"params": tp}, tokens, positions, dec.init_cache(CONFIG, 1, 8), mask, tap_layers=bad)


def test_zero_mlp_deltas_change_no_bit_and_a_delta_enters_the_up_projection():
  tp = params(0)
  tokens = jnp.asarray([[3, 1, 4], [2, 7, 1]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(3), (2, 3))
  mask = dec.causal_mask(positions, 8)
  module = dec.Decoder(CONFIG)
  run = lambda delta: module.apply({"params": tp}, tokens, positions, dec.init_cache(CONFIG, 2, 8), mask,
                                   mlp_delta_LxBxTxF=delta)[0]
  plain = run(None)
  np.testing.assert_array_equal(run(jnp.zeros((3, 2, 1, CONFIG.ffn_dim))), plain)
  np.testing.assert_array_equal(run(jnp.zeros((3, 2, 3, CONFIG.ffn_dim))), plain)
  delta = jnp.zeros((3, 2, 1, CONFIG.ffn_dim)).at[1, 0].set(0.5)  # layer 1, row 0 only
  moved = run(delta)
  np.testing.assert_array_equal(moved[1], plain[1])
  assert np.abs(np.asarray(moved[0] - plain[0])).max() > 1e-3
  for bad in ((3, 2, 2, CONFIG.ffn_dim), (2, 2, 1, CONFIG.ffn_dim), (3, 2, 1, CONFIG.ffn_dim + 1)):
    with pytest.raises(ValueError, match="mlp_delta_LxBxTxF"):
      run(jnp.zeros(bad))


@dataclasses.dataclass(frozen=True)
class RecordingDrafter(ModelDrafter):
  """The model drafter, reading the target: it records every commit's states at row τ in its state (so the test can
  read them after the loop), and drafts exactly as the plain drafter does."""
  reads_target = True
  target_layers = (0, 2)

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    cache = super().init_state(params, tokens_BxP, prompt_len_B, max_len)
    batch = tokens_BxP.shape[0]
    log = dict(hidden=jnp.zeros((batch, 16, CONFIG.d_model)), taps=jnp.zeros((batch, 16, 2, CONFIG.d_model)),
               length=jnp.zeros((batch, 16), jnp.int32), count=jnp.zeros((), jnp.int32))
    return cache, log

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler):
    cache, log = state
    cache, draft = super().propose(params, cache, tokens_BxS, length_B, key_B, gamma, sampler)
    return (cache, log), draft

  def commit(self, params, state, commit):
    cache, log = state
    hidden_BxD, taps_BxLxD = commit.last_states()
    i = log["count"]
    log = dict(hidden=log["hidden"].at[:, i].set(hidden_BxD), taps=log["taps"].at[:, i].set(taps_BxLxD),
               length=log["length"].at[:, i].set(commit.new_length_B), count=i + 1)
    return cache, log


def test_the_prompt_commit_and_every_commit_carry_the_states_before_the_last_committed_token():
  tp, dp = params(0), params(1)
  tokens, lens = spec.prepare_prompts(PROMPTS)
  keys = jax.random.split(jax.random.key(0), 3)
  state = spec.prefill_speculative(tp, dp, tokens, lens, target=CONFIG, drafter=RecordingDrafter(CONFIG), gamma=3,
                                   max_new_tokens=8)
  (_, log) = state.drafter_state
  assert int(log["count"]) == 1  # the prompt commit
  np.testing.assert_array_equal(log["length"][:, 0], [3, 1, 5])
  np.testing.assert_array_equal(log["hidden"][1, 0], 0)  # a one-token prompt: no query produced its law
  out = spec.decode_speculative(tp, dp, keys, state, target=CONFIG, drafter=RecordingDrafter(CONFIG), gamma=3,
                                max_new_tokens=8, sampler=T1)
  plain = spec.generate_speculative(tp, dp, keys, tokens, lens, target=CONFIG, drafter=ModelDrafter(CONFIG),
                                    gamma=3, max_new_tokens=8, sampler=T1)
  np.testing.assert_array_equal(out.tokens_BxN, plain.tokens_BxN)  # reading the target changes no draft
  # Run the recording drafter again to get its final state: decode_speculative returns only the output.
  final = _final_log(tp, dp, tokens, lens, keys)
  checked = 0
  for b, prompt in enumerate(PROMPTS):
    text = list(prompt) + np.asarray(out.tokens_BxN[b])[:int(out.num_tokens_B[b])].tolist()
    hidden_TxD, taps_TxLxD = full_pass(tp, text, (0, 2))
    for i in range(int(final["count"])):
      length = int(final["length"][b, i])
      if length < 2 or length - len(prompt) >= 8:
        continue  # a one-token prompt, or a row that finished: its budget cut the block after τ
      np.testing.assert_allclose(final["hidden"][b, i], hidden_TxD[length - 2], rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(final["taps"][b, i], taps_TxLxD[length - 2], rtol=2e-5, atol=2e-5)
      checked += 1
  assert checked >= 6


def _final_log(tp, dp, tokens, lens, keys):
  """The recording drafter's log after the loop (the loop's state, read by running the body to the end)."""
  logs = []

  @dataclasses.dataclass(frozen=True)
  class Keeper(RecordingDrafter):
    def commit(self, params, state, commit):
      state = super().commit(params, state, commit)
      jax.debug.callback(lambda log: logs.append(jax.tree.map(np.asarray, log)), state[1], ordered=True)
      return state

  spec.generate_speculative(tp, dp, keys, tokens, lens, target=CONFIG, drafter=Keeper(CONFIG), gamma=3,
                            max_new_tokens=8, sampler=T1)
  return max(logs, key=lambda log: int(log["count"]))


def test_scorers_tap_the_layers_a_drafter_declares():
  assert as_scorer(CONFIG, (0, 2)) == DecoderScorer(CONFIG, (0, 2))
  assert as_scorer(DecoderScorer(CONFIG), (1,)).tap_layers == (1,)
  assert as_scorer(DecoderScorer(CONFIG, (1,)), ()).tap_layers == (1,)

  @dataclasses.dataclass(frozen=True)
  class Opaque:
    vocab_size: int = 32
    max_len: int = 64

    def init_cache(self, *a):
      pass

    def score(self, *a):
      pass

    def move_slots(self, *a):
      pass

  with pytest.raises(TypeError, match="with_taps"):
    as_scorer(Opaque(), (0,))
  assert contracts.target_layers(ModelDrafter(CONFIG)) == () and not contracts.reads_target(ModelDrafter(CONFIG))
