"""SD² (blockspec_jax.drafters.steer, blockspec_jax.train.steer, blockspec_jax.train.steer_job): a zero map is the
plain drafter bit for bit through the loop, a random map keeps every lossless rule lossless (χ² against the exact law)
and greedy decoding equal to the autoregressive tokens, the biases after a commit are the map of the target's taps at
the last accepted position and drive every draft law, the loss trains the map alone, storage is checked, and the
smoke job runs and resumes.

Tiny random models only (V = 6 for the exact laws); every seed fixed."""

import dataclasses
import functools
import itertools
import json
import os
import types

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blockspec_jax import sampling, theory, verify
from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax import contracts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.drafters.steer import (SteeredDrafter, default_target_layers, init_steer, steer_dims,
                                          steering_deltas, steering_vectors)
from blockspec_jax.models import decoder as dec
from blockspec_jax.train import distill, divergences, recipe as recipe_lib, steer as steer_lib, trainer
from blockspec_jax.train.steer_job import steer_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T1 = sampling.Sampler(temperature=1.0)
GREEDY = sampling.Sampler(temperature=0.0)
VOCAB = 6
PROMPT = [1, 4]
RAGGED = [[1, 2, 3, 4, 5, 0, 1], [3, 4], [5, 1, 2, 1], [2]]
N_LAW = 16_000  # rows of PROMPT in the law batch (then the RAGGED rows)
GAMMA_LAW, NEW_LAW = 2, 3  # 3 emitted tokens with γ = 2: the first block, then a block after a loop commit
GAMMA_GREEDY, NEW_GREEDY = 3, 12


@functools.lru_cache(maxsize=None)
def target_sequence_law(n):
  """The target's exact law of the ``n`` tokens after PROMPT at T = 1: all ``V^n`` continuations in one forward,
  the product of their conditional probabilities (float64, renormalised)."""
  target, tp, _, _ = pair()
  conts = np.array(list(itertools.product(range(VOCAB), repeat=n)), np.int32)
  logits, _ = full_forward(target, tp, [PROMPT + c for c in conts.tolist()])
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
  p0 = len(PROMPT)
  total = sum(logp[np.arange(len(conts)), p0 - 1 + j, conts[:, j]] for j in range(n))
  probs = np.exp(total)
  return {tuple(c): float(x) for c, x in zip(conts.tolist(), probs / probs.sum())}


@functools.lru_cache(maxsize=None)
def pair():
  """A 4-layer target (read at default_target_layers(4) = (0, 1, 2)) and a smaller 2-layer drafter (D 16, F 32)."""
  target = dec.DecoderConfig.tiny(vocab_size=VOCAB, num_layers=4)
  drafter = dec.DecoderConfig.tiny(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, num_kv_heads=1,
                                   ffn_dim=32)
  return target, dec.init_params(target, 0), drafter, dec.init_params(drafter, 1)


def random_map(target, drafter, seed=3, scale=1.0, steered_layers=None, rank=None):
  """A nonzero map: every leaf of the untrained map plus Gaussian noise (the guide of std ``scale``: biases of
  order ``scale`` on the drafter's up-projections)."""
  steer = init_steer(target.d_model, 3, drafter, steered_layers, rank=rank)
  paths, tree = jax.tree_util.tree_flatten_with_path(steer)
  keys = jax.random.split(jax.random.key(seed), len(paths))
  noisy = [x + (scale if path[0].key == "guide" else 0.1) * jax.random.normal(k, x.shape)
           for (path, x), k in zip(paths, keys)]
  return jax.tree.unflatten(tree, noisy)


def steered_drafter(drafter, target):
  return SteeredDrafter(drafter, target_layers=default_target_layers(target.num_layers))


def law_batch():
  """N_LAW rows of PROMPT then the RAGGED rows (right-padded to width 7)."""
  return spec.prepare_prompts([PROMPT] * N_LAW + RAGGED)


def run(target_params, drafter_params, prompts, keys, *, drafter, gamma, max_new, verifier="block", sampler=T1):
  target = pair()[0]
  tokens, lens = prompts
  return spec.generate_speculative(target_params, drafter_params, keys, tokens, lens, target=target, drafter=drafter,
                                   gamma=gamma, max_new_tokens=max_new, verifier=verifier, sampler=sampler)


def assert_same_output(a, b):
  np.testing.assert_array_equal(np.asarray(a.tokens_BxN), np.asarray(b.tokens_BxN))
  np.testing.assert_array_equal(np.asarray(a.num_tokens_B), np.asarray(b.num_tokens_B))
  for name, x, y in zip(spec.DecodeMetrics.__dataclass_fields__, jax.tree.leaves(a.metrics),
                        jax.tree.leaves(b.metrics)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "sampler"))
def one_iteration(target_params, drafter_params, tokens_BxP, prompt_len_B, key, *, drafter, gamma, sampler):
  """The prefill, then one iteration of the loop's body for a chain drafter (block verification, no stop token or
  budget cut): ``(prefill drafter state, ScoredDraft, verdict, emitted block [B, γ + 1], committed drafter state)``."""
  target = pair()[0]
  state = spec.speculative_prefill(target_params, drafter_params, tokens_BxP, prompt_len_B, target=target,
                                   drafter=drafter, gamma=gamma, max_new_tokens=4 * gamma)
  batch = tokens_BxP.shape[0]
  draft_key_B, verify_key_B = jax.random.split(key, (2, batch))
  scored = spec.draft_and_score(target_params, drafter_params, state, draft_key_B, target=target, drafter=drafter,
                                gamma=gamma, sampler=sampler)
  verdict = verify.get_verifier("block").verify_draft(verify_key_B, scored.draft, scored.p_BxN1xV, scored.depth_BxN,
                                                       gamma)
  tau_B = verdict.num_accepted_B
  block_BxG1 = jnp.concatenate([scored.draft.tokens_BxN, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  block_BxG1 = block_BxG1.at[jnp.arange(batch), tau_B].set(verdict.next_token_B)
  # a chain's accepted path is its first τ nodes: the commit's rows are the queries [last committed, nodes] as scored
  commit = contracts.Commit(old_length_B=state.length_B, new_length_B=state.length_B + tau_B + 1,
                            num_accepted_B=tau_B, path_BxG=verdict.path_BxG, tokens_BxG1=block_BxG1,
                            hidden_BxG1xD=scored.hidden_BxN1xD, taps_BxG1xLxD=scored.taps_BxN1xLxD)
  committed = drafter.commit(drafter_params, scored.drafter_state, commit)
  return state.drafter_state, scored, verdict, block_BxG1, committed


@functools.partial(jax.jit, static_argnames=("config", "tap_layers"))
def _forward(config, params, tokens_BxT, delta_LxBxTxF, *, tap_layers):
  positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
  out = dec.Decoder(config).apply({"params": params}, tokens_BxT, positions,
                                  dec.init_cache(config, tokens_BxT.shape[0], tokens_BxT.shape[1]),
                                  dec.causal_mask(positions, tokens_BxT.shape[1]), return_hidden=True,
                                  tap_layers=tap_layers, mlp_delta_LxBxTxF=delta_LxBxTxF)
  return out[0], (out[3] if tap_layers else None)


def full_forward(config, params, rows, tap_layers=(), delta_from=None, delta_LxBx1xF=None):
  """One causal pass over right-padded ``rows`` (f32 logits [B, T, V], taps [B, T, K, D] or None); with
  ``delta_LxBx1xF`` the MLP biases on the positions ``t ≥ delta_from[b]`` of each row."""
  width = max(len(r) for r in rows)
  tokens = jnp.asarray([list(r) + [0] * (width - len(r)) for r in rows], jnp.int32)
  delta = None
  if delta_LxBx1xF is not None:
    on_BxT = (np.arange(width)[None, :] >= np.asarray(delta_from)[:, None]).astype(np.float32)
    delta = delta_LxBx1xF * jnp.asarray(on_BxT)[None, :, :, None]
  return _forward(config, params, tokens, delta, tap_layers=tuple(tap_layers))


# --- the zero map is the plain drafter --------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler,prompts,gamma,max_new", [(T1, "law", GAMMA_LAW, NEW_LAW),
                                                          (GREEDY, "ragged", GAMMA_GREEDY, NEW_GREEDY)])
def test_a_zero_map_is_the_plain_drafter_bit_for_bit(sampler, prompts, gamma, max_new):
  """W_guide = 0: tokens and every metric of the loop equal the plain ModelDrafter's exactly (T = 1: 16 004 rows,
  ragged ones included; T = 0: the ragged batch)."""
  target, tp, drafter, dp = pair()
  batch = law_batch() if prompts == "law" else spec.prepare_prompts(RAGGED)
  keys = jax.random.split(jax.random.key(5), batch[0].shape[0])
  plain = run(tp, dp, batch, keys, drafter=ModelDrafter(drafter), gamma=gamma, max_new=max_new, sampler=sampler)
  zero = {"model": dp, "steer": init_steer(target.d_model, 3, drafter)}
  steered = run(tp, zero, batch, keys, drafter=steered_drafter(drafter, target), gamma=gamma, max_new=max_new,
                sampler=sampler)
  assert_same_output(plain, steered)
  assert 0 < int(plain.metrics.num_accepted_tokens.sum()) < int(plain.metrics.num_draft_tokens.sum())


def test_a_zero_map_drafts_the_plain_q_rows():
  """The first draft after the prefill (ragged rows, one-token prompt included): the steered drafter's q rows, tokens
  and the target's p rows equal the plain drafter's bit for bit."""
  target, tp, drafter, dp = pair()
  tokens, lens = spec.prepare_prompts(RAGGED)
  zero = {"model": dp, "steer": init_steer(target.d_model, 3, drafter)}
  _, plain, *_ = one_iteration(tp, dp, tokens, lens, jax.random.key(2), drafter=ModelDrafter(drafter),
                               gamma=GAMMA_GREEDY, sampler=T1)
  _, steered, *_ = one_iteration(tp, zero, tokens, lens, jax.random.key(2), drafter=steered_drafter(drafter, target),
                                 gamma=GAMMA_GREEDY, sampler=T1)
  np.testing.assert_array_equal(np.asarray(plain.draft.q_BxNxV), np.asarray(steered.draft.q_BxNxV))
  np.testing.assert_array_equal(np.asarray(plain.draft.tokens_BxN), np.asarray(steered.draft.tokens_BxN))
  np.testing.assert_array_equal(np.asarray(plain.p_BxN1xV), np.asarray(steered.p_BxN1xV))


# --- a random map stays lossless --------------------------------------------------------------------------------------

def test_a_random_map_changes_the_draft_law():
  """The law test below is not vacuous: the random map moves the first draft law of PROMPT by TV > 0.1."""
  target, tp, drafter, dp = pair()
  steer = random_map(target, drafter)
  _, taps = full_forward(target, tp, [PROMPT], default_target_layers(target.num_layers))
  delta = steering_deltas(steer, taps[:, len(PROMPT) - 2], drafter)
  plain, _ = full_forward(drafter, dp, [PROMPT])
  steered, _ = full_forward(drafter, dp, [PROMPT], delta_from=[0], delta_LxBx1xF=delta)
  tv = 0.5 * float(jnp.sum(jnp.abs(jax.nn.softmax(plain[0, -1]) - jax.nn.softmax(steered[0, -1]))))
  assert tv > 0.1, tv


@pytest.mark.parametrize("rule", ["block", "token"])
def test_a_random_map_keeps_the_target_law(rule):
  """T = 1, V = 6, γ = 2, a random map: the first 3 emitted tokens after PROMPT (a block after the prefill's commit,
  then one after a loop commit) follow the target's exact law (χ², 16 000 seeded rows), for block and token
  verification; no invalid probability row."""
  target, tp, drafter, dp = pair()
  params = {"model": dp, "steer": random_map(target, drafter)}
  batch = law_batch()
  out = run(tp, params, batch, jax.random.split(jax.random.key(11), batch[0].shape[0]),
            drafter=steered_drafter(drafter, target), gamma=GAMMA_LAW, max_new=NEW_LAW, verifier=rule)
  counts = {}
  for row in map(tuple, np.asarray(out.tokens_BxN[:N_LAW]).tolist()):
    counts[row] = counts.get(row, 0) + 1
  res = theory.chi2_gof(counts, target_sequence_law(NEW_LAW))
  print(f"{rule}: χ² p = {res.p_value:.4g} (dof {res.dof})")
  assert res.p_value > 1e-3
  assert int(np.sum(out.metrics.invalid_prob_rows)) == 0
  assert int(np.sum(out.metrics.num_drafts[:N_LAW] > 1)) > N_LAW // 4  # many rows reach a loop commit


def test_greedy_with_a_random_map_is_autoregressive():
  """T = 0, a random map, the ragged batch: exactly the target's autoregressive tokens."""
  target, tp, drafter, dp = pair()
  params = {"model": dp, "steer": random_map(target, drafter)}
  batch = spec.prepare_prompts(RAGGED)
  keys = jax.random.split(jax.random.key(5), len(RAGGED))
  out = run(tp, params, batch, keys, drafter=steered_drafter(drafter, target), gamma=GAMMA_GREEDY,
            max_new=NEW_GREEDY, sampler=GREEDY)
  ar = spec.generate_autoregressive(tp, keys, *batch, target=target, max_new_tokens=NEW_GREEDY, sampler=GREEDY)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(ar.tokens_BxN))
  np.testing.assert_array_equal(np.asarray(out.num_tokens_B), [NEW_GREEDY] * len(RAGGED))


# --- the steering a commit sets ---------------------------------------------------------------------------------------

def test_steering_after_a_commit_is_the_map_of_the_last_accepted_position():
  """Ragged rows (a one-token prompt included), a random map: after the prefill the biases are the map of a full
  target forward's taps at position P − 2 (zero taps for P = 1), every q row of the first draft is the drafter's law
  under those biases from position P − 2 on, and after a verified block of τ + 1 tokens the biases are the map of
  the taps at new_length − 2."""
  target, tp, drafter, dp = pair()
  layers = default_target_layers(target.num_layers)
  steer = random_map(target, drafter)
  tokens, lens = spec.prepare_prompts(RAGGED)
  prefill, scored, verdict, block, committed = one_iteration(
      tp, {"model": dp, "steer": steer}, tokens, lens, jax.random.key(2), drafter=SteeredDrafter(drafter, layers),
      gamma=GAMMA_GREEDY, sampler=T1)
  _, taps = full_forward(target, tp, RAGGED, layers)
  lens = np.asarray(lens)
  at_BxKxD = jnp.stack([taps[b, p - 2] if p >= 2 else jnp.zeros_like(taps[b, 0]) for b, p in enumerate(lens)])
  expected = steering_deltas(steer, at_BxKxD, drafter)
  np.testing.assert_allclose(np.asarray(prefill.delta_LxBx1xF), np.asarray(expected), rtol=1e-5, atol=1e-5)
  # every q row: the drafter over prompt + draft, biased from position P − 2 on (K/V and queries alike)
  draft = np.asarray(scored.draft.tokens_BxN)
  rows = [list(r) + draft[b].tolist() for b, r in enumerate(RAGGED)]
  logits, _ = full_forward(drafter, dp, rows, delta_from=lens - 2, delta_LxBx1xF=expected)
  for b, p in enumerate(lens):
    q_GxV = jax.nn.softmax(logits[b, p - 1:p - 1 + GAMMA_GREEDY], axis=-1)
    np.testing.assert_allclose(np.asarray(scored.draft.q_BxNxV[b]), np.asarray(q_GxV), rtol=1e-4, atol=1e-5)
  # after the block: the taps at the query that produced the last committed token
  tau = np.asarray(verdict.num_accepted_B)
  committed_rows = [list(r) + np.asarray(block[b, :tau[b] + 1]).tolist() for b, r in enumerate(RAGGED)]
  _, taps = full_forward(target, tp, committed_rows, layers)
  at_BxKxD = jnp.stack([taps[b, len(r) - 2] for b, r in enumerate(committed_rows)])
  np.testing.assert_allclose(np.asarray(committed.delta_LxBx1xF), np.asarray(steering_deltas(steer, at_BxKxD, drafter)),
                             rtol=1e-5, atol=1e-5)
  assert set(tau.tolist()) != {GAMMA_GREEDY}  # some rows were cut short: the position really depends on τ


def decoded_history_state(tp, params, drafter, prompt, history, stride, gamma):
  """One row, the way the loop fills a steered drafter's cache: the prompt prefilled, then rounds that each re-feed
  the last two committed tokens and draft from there under the vector of the taps at ``length − 2``, committing
  ``stride`` tokens of ``history`` (``stride − 1`` drafted and accepted, then the bonus token; the last round
  fewer) — the draft positions past a round's commit hold junk until the next round overwrites them."""
  target = pair()[0]
  context = list(prompt) + list(history)
  state = jax.jit(functools.partial(spec.speculative_prefill, target=target, drafter=drafter, gamma=gamma,
                                    max_new_tokens=len(history) + gamma))(tp, params, *spec.prepare_prompts([prompt]))
  taps = full_forward(target, tp, [context], drafter.target_layers)[1]
  tokens_1xS = state.tokens_BxS.at[0, :len(context)].set(jnp.asarray(context, jnp.int32))
  ds, length = state.drafter_state, len(prompt)
  # Jitted (one program each, lengths passed as arrays): the same functions, far fewer dispatches than op by op.
  begin = jax.jit(lambda ds, length_1: drafter.begin(params, ds, tokens_1xS, length_1, T1)[0])
  step = jax.jit(lambda ds, x_1, pos_1: drafter.step(params, ds, x_1, pos_1, T1)[0])
  commit = jax.jit(lambda ds, length_1: drafter.commit(params, ds, contracts.prompt_commit(
      jnp.zeros((1, len(context), 1)), taps, jnp.asarray([context], jnp.int32), length_1, gamma)))
  while length < len(context):
    ds = begin(ds, jnp.asarray([length]))
    for j in range(stride - 1):  # drafted tokens, fed; those past the commit are junk (token 0)
      x = context[length + j] if length + j < len(context) else 0
      ds = step(ds, jnp.asarray([x]), jnp.asarray([length + j]))
    length = min(length + stride, len(context))
    ds = commit(ds, jnp.asarray([length]))
  return state.replace(tokens_BxS=tokens_1xS, length_B=jnp.asarray([length]), drafter_state=ds)


@pytest.mark.parametrize("stride", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_replayed_history_is_the_state_decoding_leaves(stride):
  """speculative_prefill(history_B=h, replay_stride=s) on prompt + history: a steered drafter's first draft has the
  q rows of the drafter that decoded the history in rounds of s committed tokens (its cache written under each
  round's vector), one-token prompts, empty and partial last rounds included; the plain prefill of the same context
  drafts other rows, and a plain drafter ignores history_B bit for bit."""
  target, tp, drafter_cfg, dp = pair()
  drafter = steered_drafter(drafter_cfg, target)
  params = {"model": dp, "steer": random_map(target, drafter_cfg)}
  gamma = 3
  prompts = [[1, 2, 3, 4], [3], [5, 1, 2], [2, 5]]
  histories = [[0, 5, 2, 2, 1, 3, 4], [4, 4, 0, 1], [], [1, 3, 5, 0, 2]]
  contexts = [p + h for p, h in zip(prompts, histories)]
  tokens, lens = spec.prepare_prompts(contexts)
  history_B = jnp.asarray([len(h) for h in histories], jnp.int32)
  key_B = jax.random.split(jax.random.key(7), len(contexts))

  @jax.jit  # one program per state shape instead of thousands of single operations
  def first_draft(params, state, key_B):
    return spec.draft_and_score(tp, params, state, key_B, target=target, drafter=drafter, gamma=gamma, sampler=T1)

  replayed = jax.jit(functools.partial(spec.speculative_prefill, target=target, drafter=drafter, gamma=gamma,
                                       max_new_tokens=1, replay_stride=stride))(
      tp, params, tokens, lens, history_B=history_B)
  plain = jax.jit(functools.partial(spec.speculative_prefill, target=target, drafter=drafter, gamma=gamma,
                                    max_new_tokens=1))(tp, params, tokens, lens)
  got, flat = first_draft(params, replayed, key_B), first_draft(params, plain, key_B)
  for b, (p, h) in enumerate(zip(prompts, histories)):
    decoded = decoded_history_state(tp, params, drafter, p, h, stride, gamma)
    want = first_draft(params, decoded, key_B[b:b + 1])
    np.testing.assert_array_equal(np.asarray(got.draft.tokens_BxN[b]), np.asarray(want.draft.tokens_BxN[0]))
    np.testing.assert_allclose(np.asarray(got.draft.q_BxNxV[b]), np.asarray(want.draft.q_BxNxV[0]), rtol=1e-4,
                               atol=1e-6)
    gap = float(np.abs(np.asarray(flat.draft.q_BxNxV[b, 0]) - np.asarray(want.draft.q_BxNxV[0, 0])).max())
    assert (gap < 1e-6) == (len(h) == 0), (b, gap)  # the plain prefill differs exactly where there is a history
  plain_drafter = ModelDrafter(drafter_cfg)
  plain_prefill = functools.partial(spec.speculative_prefill, target=target, drafter=plain_drafter, gamma=gamma,
                                    max_new_tokens=1)
  a = jax.jit(functools.partial(plain_prefill, replay_stride=stride))(tp, dp, tokens, lens, history_B=history_B)
  b_ = jax.jit(plain_prefill)(tp, dp, tokens, lens)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b_)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="replay_stride"):
    spec.speculative_prefill(tp, params, tokens, lens, target=target, drafter=drafter, gamma=gamma,
                             max_new_tokens=1, history_B=history_B, replay_stride=0)


def test_paired_takes_a_steered_entry_with_its_replay_setting_and_refuses_other_unknown_settings(
    tmp_path, capsys, monkeypatch):
  """``eval.paired --drafters base,steered:DIR?replay=8`` passes the option checks (``replay`` is the job's setting,
  not the drafter's: a regression refused it before any model loaded), while a setting neither knows is still one
  line naming it, before any model loads."""
  from blockspec_jax import sources
  from blockspec_jax.eval import paired
  target, _, drafter_cfg, _ = pair()
  steer_lib.save_steer(tmp_path, random_map(target, drafter_cfg),
                       {"target_layers": [0, 1, 2], "steered_layers": list(range(drafter_cfg.num_layers)),
                        "drafter_layers": drafter_cfg.num_layers, "ffn_dim": drafter_cfg.ffn_dim})

  class Loaded(Exception):
    pass

  def load_model(*a, **k):
    raise Loaded

  monkeypatch.setattr(sources, "load_model", load_model)
  common = ["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--drafters"]
  with pytest.raises(Loaded):  # every check passed: the first model is being loaded
    paired.main([*common, f"smollm2-135m,steered:{tmp_path}?replay=8"])
  with pytest.raises(SystemExit) as exit_info:
    paired.main([*common, f"smollm2-135m,steered:{tmp_path}?replay=8&stride=2"])
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2 and len(err) == 1 and "has no settings ['stride']" in err[0], err


@pytest.mark.slow  # a paired table over a steered drafter; the replay itself is tested by default (stride 1)
def test_paired_acceptance_replays_a_steered_drafter_history(tmp_path):
  """eval.paired with each context's offset: a steered drafter's rows change exactly where a context has tokens past
  its prompt (and with the stride), stride 0 or no offsets is the prompt prefill, a plain drafter's table does not
  move; bad offsets, strides and `?replay=` settings are refused."""
  import argparse
  from blockspec_jax.eval import paired
  target, tp, drafter_cfg, dp = pair()
  drafter = steered_drafter(drafter_cfg, target)
  params = {"model": dp, "steer": random_map(target, drafter_cfg)}
  contexts = [[1, 2, 3, 4, 0, 5, 2, 2, 1], [3, 4, 4, 0], [5, 1, 2], [2, 5, 1, 3, 5]]
  offsets = [5, 3, 0, 3]

  def table(drafter, params, **kw):
    return paired.paired_acceptance(tp, params, contexts, target=target, drafter=drafter, gamma=3, temperature=1.0,
                                    draws=2, **kw)

  prompt = table(drafter, params)
  np.testing.assert_array_equal(prompt, table(drafter, params, offsets=offsets, replay_stride=0))
  by_stride = {s: table(drafter, params, offsets=offsets, replay_stride=s) for s in (1, 3)}
  for replayed in by_stride.values():
    moved_B = np.abs(replayed - prompt).max(axis=(0, 2, 3)) > 1e-6
    np.testing.assert_array_equal(moved_B, np.asarray(offsets) > 0)
  assert np.abs(by_stride[1] - by_stride[3]).max() > 1e-4
  plain = ModelDrafter(drafter_cfg)
  np.testing.assert_array_equal(table(plain, dp), table(plain, dp, offsets=offsets, replay_stride=3))
  with pytest.raises(ValueError, match="offsets must give each"):
    table(drafter, params, offsets=[5, 3, 0, 5], replay_stride=1)  # 5 tokens past a 5-token context's prompt
  with pytest.raises(ValueError, match="replay_stride must be an integer >= 0"):
    table(drafter, params, offsets=offsets, replay_stride=-1)
  steer_lib.save_steer(tmp_path, params["steer"], {"target_layers": list(drafter.target_layers),
                                                    "steered_layers": list(range(drafter_cfg.num_layers)),
                                                    "drafter_layers": drafter_cfg.num_layers,
                                                    "ffn_dim": drafter_cfg.ffn_dim})
  with pytest.raises(checks.UsageError, match="replay must be an integer >= 0"):
    paired._paired_drafter(f"steered:{tmp_path}?replay=-2", None, argparse.Namespace(replay_stride=8))
  with pytest.raises(checks.UsageError, match="SD² steering map directory results/train/none does not exist"):
    paired._paired_drafter("steered:results/train/none?replay=2", None, argparse.Namespace(replay_stride=8))
  assert paired._shown("steer_qwen", 8) == "steer_qwen (replay 8)" and paired._shown("base", None) == "base"
  assert paired._shown("steer_qwen", 0) == "steer_qwen (prefilled as prompt)"
  # a label whose settings name the stride already says it: not twice
  assert paired._shown("steer_qwen?replay=0", 0) == "steer_qwen?replay=0"
  assert paired._shown("steer_qwen?rank=4&replay=8", 8) == "steer_qwen?rank=4&replay=8"


def test_map_shapes_subsets_and_low_rank():
  """Unsteered layers get exact zeros; the initial W_hml sums the taps; a low-rank map starts at zero too."""
  target, _, drafter, _ = pair()
  taps = jax.random.normal(jax.random.key(0), (3, 3, target.d_model))
  steer = random_map(target, drafter, steered_layers=(1,))
  delta = steering_deltas(steer, taps, drafter, steered_layers=(1,))
  assert delta.shape == (drafter.num_layers, 3, 1, drafter.ffn_dim) and delta.dtype == jnp.float32
  assert np.all(np.asarray(delta[0]) == 0) and np.any(np.asarray(delta[1]) != 0)
  np.testing.assert_array_equal(np.asarray(delta[1, :, 0]), np.asarray(steering_vectors(steer, taps,
                                                                                         drafter.ffn_dim)[:, 0]))
  with pytest.raises(ValueError, match="1 layer biases, but 2 drafter layers"):
    steering_deltas(steer, taps, drafter)
  zero = init_steer(target.d_model, 3, drafter)
  np.testing.assert_allclose(np.asarray(zero["hml"]["weight"]) @ np.asarray(taps.reshape(3, -1)).T,
                             np.asarray(taps.sum(axis=1)).T, rtol=1e-6, atol=1e-6)
  low = init_steer(target.d_model, 3, drafter, rank=4, seed=1)
  assert steer_dims(low) == {"target_d_model": 32, "num_taps": 3, "width": 64, "rank": 4}
  assert np.all(np.asarray(steering_deltas(low, taps, drafter)) == 0)
  # the authors' taps: the inputs of layers 3, L/2 and L − 3 (layers 3, 16, 29 of 32 in their code)
  assert default_target_layers(32) == (2, 15, 28) and default_target_layers(28) == (2, 13, 24)
  assert default_target_layers(4) == (0, 1, 2)
  assert default_target_layers(1) == (0, 0, 0)
  with pytest.raises(ValueError, match="no taps"):
    SteeredDrafter(drafter).commit({"steer": zero}, None, contracts.prompt_commit(
        jnp.zeros((1, 2, 4)), None, jnp.zeros((1, 2), jnp.int32), jnp.asarray([2]), 2))


# --- training ---------------------------------------------------------------------------------------------------------

def tiny_batch(vocab, length=12, prompt=4, batch=8, seed=0):
  """Random sequences (the loss is defined on any sequence; the teacher is the target's law there): prompts of
  ``prompt`` tokens, all later positions in the loss window."""
  tokens = np.random.default_rng(seed).integers(1, vocab, size=(batch, length)).astype(np.int32)
  lens = np.full((batch,), prompt, np.int32)
  mask = (np.arange(length)[None, :] >= prompt - 1).astype(np.float32) * np.ones((batch, 1), np.float32)
  mask[:, -1] = 0.0
  positions, mask_n = distill.loss_window(mask, lens, length - prompt)
  return {"tokens_BxT": jnp.asarray(tokens), "prompt_len_B": jnp.asarray(lens),
          "positions_BxN": jnp.asarray(positions), "mask_BxN": jnp.asarray(mask_n)}


def test_training_lowers_the_loss_and_trains_the_map_only():
  """60 Adam steps of the SD² loss on a fixed batch (offsets drawn per step): the loss at every offset drops; at
  initialisation the steered loss IS the plain drafter's divergence; the gradient has exactly the map's leaves."""
  target, tp, drafter, dp = pair()
  layers = default_target_layers(target.num_layers)
  loss_fn = steer_lib.SteerLoss(target, drafter, layers, gamma=3)
  batch = tiny_batch(target.vocab_size)
  frozen = {"target": tp, "drafter": dp}
  steer0 = init_steer(target.d_model, 3, drafter)
  by_offset = {}
  for k in jax.random.split(jax.random.key(9), 16):  # a key for each offset 1..3
    by_offset.setdefault(int(jax.random.randint(k, (), 1, 4)), k)
  assert sorted(by_offset) == [1, 2, 3]

  @jax.jit
  def evaluate(steer, key):
    loss, grads = jax.value_and_grad(lambda s: loss_fn(s, frozen, batch, key)[0])(steer)
    target_logits, _ = steer_lib.target_window(target, tp, batch["tokens_BxT"], batch["positions_BxN"], layers)
    plain_logits = steer_lib.steered_window_logits(drafter, dp, None, batch["tokens_BxT"], batch["positions_BxN"],
                                                   batch["prompt_len_B"], None, None, None, None)
    return loss, grads, divergences.token_divergence("fkl", target_logits, plain_logits, batch["mask_BxN"])

  before = {}
  for o, k in by_offset.items():
    before[o], grads, plain = evaluate(steer0, k)
    assert float(before[o]) == pytest.approx(float(plain), rel=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(steer0)
    assert float(jnp.abs(grads["guide"]["weight"]).max()) > 0
  optimizer = optax.adam(3e-3)  # the trainer's step is the smoke job's; here the compiled gradient above is reused

  @jax.jit
  def update(steer, grads, opt):
    updates, opt = optimizer.update(grads, opt, steer)
    return optax.apply_updates(steer, updates), opt

  steer, opt = steer0, optimizer.init(steer0)
  for i in range(60):  # a fresh offset every step, as in training
    _, grads, _ = evaluate(steer, jax.random.fold_in(jax.random.key(1), i))
    steer, opt = update(steer, grads, opt)
  after = {o: float(evaluate(steer, k)[0]) for o, k in by_offset.items()}
  print(f"loss by offset: { {o: float(v) for o, v in before.items()} } -> {after}")
  assert all(after[o] < float(before[o]) - 0.01 for o in before)


def test_window_sources_match_decoding():
  """Training offsets: src(t) = max(t − o, P − 2); held-out tiling: the j-th window position reads the start of
  its block of γ, offset (j mod γ) + 1; positions before P − 2 and after the window get no bias."""
  lens = jnp.asarray([5, 1])
  src, active = steer_lib.window_sources(lens, 12, 5, offset=2)
  np.testing.assert_array_equal(np.asarray(active[0]), [t in range(3, 8) for t in range(12)])
  np.testing.assert_array_equal(np.asarray(src[0, 3:8]), [0, 0, 0, 1, 2])  # positions 3..7 read 3, 3, 3, 4, 5
  np.testing.assert_array_equal(np.asarray(active[1]), [t in range(0, 4) for t in range(12)])  # w0 = −1
  src, _ = steer_lib.window_sources(lens, 12, 7, gamma=3)
  np.testing.assert_array_equal(np.asarray(src[0, 3:10]), [0, 0, 0, 0, 3, 3, 3])  # offsets of t = 4..9: 1 2 3 1 2 3
  # The blocks training scheme at phase 1: the first block is 2 long, then blocks of 3, each reading the position
  # just before it (window indices k = 1..8 read 0 0 | 2 2 2 | 5 5 5: offsets 1 2 1 2 3 1 2 3).
  src, _ = steer_lib.window_sources(lens, 12, 9, gamma=3, phase=1)
  np.testing.assert_array_equal(np.asarray(src[0, 4:12]), [0, 0, 2, 2, 2, 5, 5, 5])
  for phase in range(3):  # every phase covers offsets 1..γ, never more than γ past the source
    src, active = steer_lib.window_sources(lens, 12, 9, gamma=3, phase=phase)
    offsets = (np.arange(12) - 3 - np.asarray(src[0]))[4:12]
    assert set(offsets) <= {1, 2, 3} and 3 in offsets
  np.testing.assert_array_equal(steer_lib.window_sources(lens, 12, 7, gamma=3, phase=0)[0],
                                steer_lib.window_sources(lens, 12, 7, gamma=3)[0])


def test_blocks_scheme_trains_every_offset_in_one_pass():
  """SteerLoss(scheme="blocks"): at the zero map the loss is the plain drafter's divergence; its positions read the
  sources of window_sources at the step's phase (checked through the loss of a hand-built source table); an
  unknown scheme is refused."""
  target, tp, drafter, dp = pair()
  layers = default_target_layers(target.num_layers)
  batch = tiny_batch(target.vocab_size)
  frozen = {"target": tp, "drafter": dp}
  steer0 = init_steer(target.d_model, 3, drafter)
  loss_fn = steer_lib.SteerLoss(target, drafter, layers, gamma=3, scheme="blocks")
  target_logits, taps = steer_lib.target_window(target, tp, batch["tokens_BxT"], batch["positions_BxN"], layers)
  plain = steer_lib.steered_window_logits(drafter, dp, None, batch["tokens_BxT"], batch["positions_BxN"],
                                          batch["prompt_len_B"], None, None, None, None)
  key = jax.random.key(3)
  loss0, aux = loss_fn(steer0, frozen, batch, key)
  assert float(loss0) == pytest.approx(float(divergences.token_divergence("fkl", target_logits, plain,
                                                                          batch["mask_BxN"])), rel=1e-6)
  phase = int(aux["phase"])
  assert phase == int(jax.random.randint(key, (), 0, 3)) and "offset" not in aux
  # A non-zero map: the loss equals the divergence of the logits steered by the phase's block sources.
  steer1 = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape, x.dtype), steer0)
  src, active = steer_lib.window_sources(batch["prompt_len_B"], batch["tokens_BxT"].shape[1],
                                         batch["positions_BxN"].shape[1] + 1, gamma=3, phase=phase)
  steered = steer_lib.steered_window_logits(drafter, dp, steer1, batch["tokens_BxT"], batch["positions_BxN"],
                                            batch["prompt_len_B"], taps, src, active, loss_fn.steered_layers)
  expected = divergences.token_divergence("fkl", target_logits, steered, batch["mask_BxN"])
  assert float(loss_fn(steer1, frozen, batch, key)[0]) == pytest.approx(float(expected), rel=1e-5)
  other = (phase + 1) % 3
  src2, active2 = steer_lib.window_sources(batch["prompt_len_B"], batch["tokens_BxT"].shape[1],
                                           batch["positions_BxN"].shape[1] + 1, gamma=3, phase=other)
  shifted = steer_lib.steered_window_logits(drafter, dp, steer1, batch["tokens_BxT"], batch["positions_BxN"],
                                            batch["prompt_len_B"], taps, src2, active2, loss_fn.steered_layers)
  assert float(divergences.token_divergence("fkl", target_logits, shifted, batch["mask_BxN"])) != pytest.approx(
      float(expected), rel=1e-5)  # the phase matters, so the check above can fail
  with pytest.raises(ValueError, match="scheme must be one of"):
    steer_lib.SteerLoss(target, drafter, layers, gamma=3, scheme="tiles")


# --- storage ----------------------------------------------------------------------------------------------------------

def record_for(target, drafter, layers, steered=None):
  return {"target": "tiny", "drafter": "tiny", "target_layers": list(layers),
          "steered_layers": list(steered or range(drafter.num_layers)), "drafter_layers": drafter.num_layers,
          "ffn_dim": drafter.ffn_dim}


def test_a_map_refuses_a_drafter_it_was_not_trained_on(tmp_path):
  """The record's drafter against the loaded model's identity: a registry name, a training run's directory (any
  step, relative or absolute), a local checkpoint; unknown sides (random tiny models, no spec) are not judged."""
  from blockspec_jax.drafters.steer import check_trained_on, model_identity
  from blockspec_jax.models import hub
  run = tmp_path / "distill_run"
  run.mkdir()
  trained = hub.LocalSource(name=f"{run.resolve()}@120", kind="trained", path=run.resolve())
  registry = types.SimpleNamespace(name="qwen2.5-coder-0.5b")
  assert model_identity("qwen2.5-coder-0.5b") == model_identity(registry) == "qwen2.5-coder-0.5b"
  assert model_identity(str(run)) == model_identity(f"{run}@64") == model_identity(trained) == str(run.resolve())
  assert model_identity("random tiny decoder (seed 1, V = 64, D = 32, 2 layers)") is None
  assert model_identity("results/moved/elsewhere") is None and model_identity(None) is None
  loaded = lambda spec: types.SimpleNamespace(spec=spec)
  check_trained_on({"drafter": "qwen2.5-coder-0.5b"}, loaded(registry), "m")
  check_trained_on({"drafter": f"{run}@120"}, loaded(trained), "m")
  check_trained_on({"drafter": "random tiny decoder (seed 1)"}, loaded(registry), "m")  # unknown: not judged
  check_trained_on({"drafter": "qwen2.5-coder-0.5b"}, types.SimpleNamespace(), "m")  # no spec: not judged
  with pytest.raises(ValueError, match=r"trained on the drafter 'qwen2.5-coder-0.5b'; this drafter is '/"):
    check_trained_on({"drafter": "qwen2.5-coder-0.5b"}, loaded(trained), "m")
  with pytest.raises(ValueError, match="this drafter is 'qwen2.5-coder-0.5b'"):
    check_trained_on({"drafter": str(run)}, loaded(registry), "m")
  joint = {"drafter": str(run), "drafter_step": 120}  # a map tuned with its drafter: that checkpoint only
  check_trained_on(joint, loaded(trained), "m")
  with pytest.raises(ValueError, match=r"trained jointly with its drafter's step 120; this drafter is '.*@init'"):
    check_trained_on(joint, loaded(hub.LocalSource(name=f"{run.resolve()}@init", kind="trained", path=run)), "m")


def test_save_load_round_trip_and_errors(tmp_path):
  """Bit-exact round trip (full and low rank) with the record; load_params gives {"model", "steer"} and the drafter
  takes its layers from the record; a corrupted npz, a tampered record, other models or other layers are clear
  errors, and a drafter without a map says how to train one."""
  target, tp, drafter, dp = pair()
  layers = default_target_layers(target.num_layers)
  for rank in (None, 4):
    steer = random_map(target, drafter, rank=rank, steered_layers=(1,))
    workdir = tmp_path / f"rank_{rank}"
    steer_lib.save_steer(workdir, steer, record_for(target, drafter, layers, (1,)))
    loaded, info = steer_lib.load_steer(workdir, target_config=target, drafter_config=drafter)
    for a, b in zip(jax.tree.leaves(steer), jax.tree.leaves(loaded)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(steer) == jax.tree.structure(loaded)
    assert info["rank"] == rank and info["target_layers"] == layers and info["steered_layers"] == (1,)
  workdir = tmp_path / "rank_None"
  model = lambda config, params: types.SimpleNamespace(config=config, params={"params": params})
  d = SteeredDrafter(drafter, steer=str(workdir))
  assert d.target_layers == layers and d.steered_layers == (1,) and d.name == "steered" and d.reads_target
  params = d.load_params(model(drafter, dp), model(target, tp))
  assert set(params) == {"model", "steer"} and params["model"] is dp
  with pytest.raises(ValueError, match="steers drafter layers"):
    SteeredDrafter(drafter, steered_layers=(0, 1), steer=str(workdir)).load_params(model(drafter, dp),
                                                                                   model(target, tp))
  with pytest.raises(ValueError, match="reads target states of Dt = 32"):
    steer_lib.load_steer(workdir, target_config=dataclasses.replace(target, d_model=64, num_heads=8))
  with pytest.raises(ValueError, match="MLP width"):
    steer_lib.load_steer(workdir, drafter_config=dataclasses.replace(drafter, ffn_dim=16))
  with pytest.raises(ValueError, match="trained on target layers"):
    steer_lib.load_steer(workdir, target_layers=(1, 2, 3))
  with pytest.raises(checks.UsageError, match="needs a trained steering map"):
    methods.drafter_params(SteeredDrafter(drafter), model(drafter, dp), model(target, tp))
  with pytest.raises(checks.UsageError, match="does not exist"):
    methods.drafter_params(SteeredDrafter(drafter, steer=str(tmp_path / "nowhere")), model(drafter, dp),
                        model(target, tp))
  npz = workdir / steer_lib.STEER_NPZ
  data = bytearray(npz.read_bytes())
  data[len(data) // 2] ^= 0xFF
  npz.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="corrupted: its SHA-256"):
    steer_lib.load_steer(workdir)
  with pytest.raises(checks.UsageError, match="corrupted"):
    methods.drafter_params(d, model(drafter, dp), model(target, tp))
  record = json.loads((tmp_path / "rank_4" / steer_lib.STEER_JSON).read_text())
  record["width"] = 64
  (tmp_path / "rank_4" / steer_lib.STEER_JSON).write_text(json.dumps(record))
  with pytest.raises(ValueError, match="width"):
    steer_lib.load_steer(tmp_path / "rank_4")
  (tmp_path / "rank_4" / steer_lib.STEER_JSON).write_text("{not json")
  with pytest.raises(ValueError, match="corrupted"):
    steer_lib.load_steer(tmp_path / "rank_4")
  with pytest.raises(ValueError, match="info must name"):
    steer_lib.save_steer(tmp_path / "bad", steer, {"target_layers": [1, 2, 2]})


# --- the smoke job ----------------------------------------------------------------------------------------------------

def test_smoke_job_runs_and_resumes(tmp_path):
  """gin/train/steer_smoke.gin (40 steps here): a run stopped after 20 steps writes only its checkpoints; run again
  it resumes from step 20, and the held-out TV of the steered drafter drops below the plain drafter's (equal to the
  untrained map's); the saved map loads into a SteeredDrafter that names its layers. (The trainer's resume is
  bit-exact: tests/test_train.py.)"""
  gin.clear_config()
  try:
    gin.parse_config_file(os.path.join(REPO, "gin/train/steer_smoke.gin"))
    common = dict(num_steps=40, checkpoint_every=20, progress=False)
    stopped = steer_job(tmp_path, stop_after=20, **common)
    assert stopped["stopped_after"] == 20 and not (tmp_path / "steer.json").exists()
    summary = steer_job(tmp_path, **common)
  finally:
    gin.clear_config()
  assert summary["resumed_from"] == 20 and summary["steps"] == 40
  assert [r["step"] for r in trainer.read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 41))
  assert summary["heldout_tv_before"] == summary["heldout_tv_plain"]
  assert summary["heldout_tv_after"] < summary["heldout_tv_before"] - 0.01
  assert len(summary["heldout_tv_after_by_offset"]) == 4
  assert json.loads((tmp_path / "metrics.json").read_text()) == summary
  steer, info = steer_lib.load_steer(tmp_path)
  assert info["steps"] == 40 and info["target_layers"] == (0, 1, 2) and info["rank"] is None
  assert info["heldout_tv_after"] == summary["heldout_tv_after"]
  d = SteeredDrafter(dec.DecoderConfig.tiny(vocab_size=128, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                            ffn_dim=32, max_len=512), steer=str(tmp_path))
  assert d.target_layers == (0, 1, 2) and d.layers == (0, 1)
  assert steer_dims(steer) == {"target_d_model": 32, "num_taps": 3, "width": 64, "rank": None}


@pytest.mark.slow  # the blocks scheme's training step is tested by default (test_blocks_scheme_trains_every_offset_in_one_pass)
def test_smoke_job_trains_with_the_blocks_scheme(tmp_path):
  """steer_job(scheme="blocks") on the smoke job: recorded in metrics.json and the map's record, the steered held-out
  TV drops below the plain drafter's; an unknown scheme is a usage error naming the setting's values. A second run
  with reuse_samples = the first's work directory takes every continuation from it (the same prompts: nothing is
  sampled); one whose sampling settings differ is a usage error."""
  gin.clear_config()
  try:
    gin.parse_config_file(os.path.join(REPO, "gin/train/steer_smoke.gin"))
    summary = steer_job(tmp_path, num_steps=40, checkpoint_every=20, progress=False, scheme="blocks")
    with pytest.raises(checks.UsageError, match="scheme must be one of"):
      steer_job(tmp_path / "bad", num_steps=2, progress=False, scheme="tiles")
    reused = steer_job(tmp_path / "reused", num_steps=12, progress=False, reuse_samples=str(tmp_path))
    with pytest.raises(checks.UsageError, match=r"reuse_samples: .*other settings \(max_new_tokens differ\)"):
      steer_job(tmp_path / "other", num_steps=12, progress=False, reuse_samples=str(tmp_path),
                max_new_tokens=gin.query_parameter("steer_job.max_new_tokens") + 1)
  finally:
    gin.clear_config()
  assert summary["scheme"] == "blocks" and steer_lib.load_steer(tmp_path)[1]["scheme"] == "blocks"
  assert summary["heldout_tv_after"] < summary["heldout_tv_plain"] - 0.01
  assert reused["heldout_tv_plain"] == summary["heldout_tv_plain"]  # the same held-out continuations
  with np.load(tmp_path / "samples.npz") as a, np.load(tmp_path / "reused" / "samples.npz") as b:
    np.testing.assert_array_equal(a["tokens_NxT"], b["tokens_NxT"])
    np.testing.assert_array_equal(a["mask_NxT"], b["mask_NxT"])


# --- joint training: the drafter tuned with the map (the authors' default) -----------------------------------------

def test_joint_loss_at_init_is_the_map_only_loss_and_trains_both_parts():
  """SteerLoss(assemble_drafter=LoRA): zero-initialised adapters and a zero map give the map-only loss bit for bit
  (both are the plain drafter's divergence); one gradient reaches the map and the adapters, nothing else."""
  target, tp, drafter, dp = pair()
  layers = default_target_layers(target.num_layers)
  parts = recipe_lib.DrafterRecipe("tiny", lora_rank=2, lora_targets=("q", "up", "down")).split(drafter, dp)
  alone = steer_lib.SteerLoss(target, drafter, layers, gamma=3, scheme="blocks")
  joint = dataclasses.replace(alone, assemble_drafter=parts.assemble)
  batch, key = tiny_batch(target.vocab_size), jax.random.key(2)
  steer0 = init_steer(target.d_model, 3, drafter)
  loss_alone = alone(steer0, {"target": tp, "drafter": dp}, batch, key)[0]
  trainable = {"steer": steer0, "drafter": parts.trainable}
  (loss_joint, aux), grads = jax.value_and_grad(joint, has_aux=True)(
      trainable, {"target": tp, "drafter": parts.frozen}, batch, key)
  assert float(loss_joint) == float(loss_alone) and "phase" in aux
  assert jax.tree.structure(grads) == jax.tree.structure(trainable)
  assert float(jnp.abs(grads["steer"]["guide"]["weight"]).max()) > 0
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads["drafter"])) > 0
  steer, drafter_params = joint.parts(trainable, {"target": tp, "drafter": parts.frozen})
  assert steer is steer0
  for a, b in zip(jax.tree.leaves(drafter_params), jax.tree.leaves(dp)):  # B = 0: the base exactly
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_smoke_job_trains_the_drafter_jointly_and_resumes(tmp_path):
  """steer_job(finetune_drafter=LoRA) on the smoke job, stopped at step 20 and resumed: the checkpoints hold
  {"steer", "drafter"}, drafter.json names the drafter's part (restore_trainable returns the trained adapters),
  the map's record names the run and its step, and both the tuned drafter alone and with its map are closer to the
  target than the plain drafter on held-out prompts."""
  smoke_drafter = dec.DecoderConfig.tiny(vocab_size=128, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                         ffn_dim=32, max_len=512)
  common = dict(num_steps=40, checkpoint_every=20, progress=False, scheme="blocks",
                finetune_drafter={"lora_rank": 4, "lora_alpha": 8.0},
                drafter_optimizer={"name": "adamw", "learning_rate": 3e-3, "schedule": "cosine", "warmup_steps": 4})
  gin.clear_config()
  try:
    gin.parse_config_file(os.path.join(REPO, "gin/train/steer_smoke.gin"))
    stopped = steer_job(tmp_path, stop_after=20, **common)
    assert stopped["stopped_after"] == 20 and not (tmp_path / "steer.json").exists()
    summary = steer_job(tmp_path, **common)
  finally:
    gin.clear_config()
  print({k: v for k, v in summary.items() if k.startswith("heldout_tv") and "offset" not in k})
  assert summary["resumed_from"] == 20 and summary["steps"] == 40
  assert summary["heldout_tv_before"] == summary["heldout_tv_plain"]
  assert summary["heldout_tv_after"] < summary["heldout_tv_plain"] - 0.01
  assert summary["heldout_tv_drafter_only"] < summary["heldout_tv_plain"] - 0.005
  assert summary["finetune_drafter"]["lora_rank"] == 4 and summary["drafter_optimizer"]["learning_rate"] == 3e-3
  record = json.loads((tmp_path / "drafter.json").read_text())
  assert record["checkpoint_subtree"] == "drafter" and record["base"].startswith("random tiny decoder")
  recipe = recipe_lib.read_recipe(tmp_path)
  assert recipe.lora_rank == 4 and recipe_lib.checkpoint_subtree(tmp_path) == "drafter"
  template = recipe.split(smoke_drafter, dec.init_params(smoke_drafter, 1)).trainable
  adapters, step = recipe_lib.restore_trainable(tmp_path, template)
  assert step == 40 and jax.tree.structure(adapters) == jax.tree.structure(template)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(template))) > 0
  _, info = steer_lib.load_steer(tmp_path)
  assert info["drafter_step"] == 40 and info["drafter"].startswith("random tiny decoder")
  assert info["heldout_tv_drafter_only"] == summary["heldout_tv_drafter_only"]


def test_joint_training_settings_are_checked(tmp_path):
  run = tmp_path / "distilled"  # a drafter training run: joint training tunes a base model, not a run
  run.mkdir()
  recipe_lib.save_recipe(run, recipe_lib.DrafterRecipe("smollm2-135m", lora_rank=2))
  with pytest.raises(checks.UsageError, match="finetune_drafter tunes a base model; steer_job.drafter = .* is a training"):
    steer_job(tmp_path / "never_written", target="smollm2-135m", drafter=str(run), finetune_drafter={"lora_rank": 2},
              progress=False)
  assert not (tmp_path / "never_written").exists()
  gin.clear_config()
  try:
    gin.parse_config_file(os.path.join(REPO, "gin/train/steer_smoke.gin"))
    for bad, message in (({"finetune_drafter": "lora"}, "finetune_drafter must be None or a dict"),
                         ({"finetune_drafter": {"base": "x", "lora_rank": 2}}, "must not set base"),
                         ({"finetune_drafter": {"lora_rank": -1}}, "lora_rank must be an integer >= 0"),
                         ({"finetune_drafter": {"rank": 2}}, "finetune_drafter: .*unexpected keyword"),
                         ({"drafter_optimizer": {"learning_rate": 1e-3}}, "the drafter is frozen"),
                         ({"finetune_drafter": {"lora_rank": 2}, "drafter_optimizer": {"total_steps": 3}},
                          "drafter_optimizer must not set total_steps")):
      with pytest.raises(checks.UsageError, match=message):
        steer_job("/nonexistent/never_written", num_steps=2, progress=False, **bad)
  finally:
    gin.clear_config()
