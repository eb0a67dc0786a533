"""BPD heads (blockspec_jax.drafters.heads, blockspec_jax.train.heads, the heads_job): the heads' rows, the offset of
the target's hidden state they read (prefill and every commit, against a full forward), greedy = autoregressive for
every rescorer on ragged batches, the exact law at T = 1 under token and block verification, the p-best tree search
of the neural LM = brute force (and its cache left as an autoregressive pass leaves it), the training data's
positions and labels, checkpoints, the smoke job with resume, and the errors for bad settings."""

import dataclasses
import functools
import itertools
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import contracts, sampling
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import heads as heads_lib, lattice
from blockspec_jax.models import decoder as dec
from blockspec_jax.train import __main__ as train_main  # registers tiny_decoder for the smoke gin file
from blockspec_jax.train import heads as heads_train
from blockspec_jax.train import heads_job as heads_job_lib

from helpers import (GREEDY, PROMPTS as RAGGED, T1, check_drafter_greedy, check_drafter_law_at_t1, model_pair, run_ar,
                     small_config)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "gin/train/heads_smoke.gin")


def random_heads(config, num_heads, seed=7, scale=1.0):
  """Heads with a non-zero W2 (an untrained head would just copy the target's next-token head)."""
  heads = heads_lib.init_heads(config.d_model, num_heads, jax.random.key(seed))
  heads["w2_HxDxD"] = scale * jax.random.normal(jax.random.key(seed + 1), heads["w2_HxDxD"].shape) / np.sqrt(
      config.d_model)
  heads["b1_HxD"] = 0.1 * jax.random.normal(jax.random.key(seed + 2), heads["b1_HxD"].shape)
  return heads


@functools.partial(jax.jit, static_argnums=0)
def _hidden_pass(config, params, seqs_BxT):
  batch, width = seqs_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  return dec.Decoder(config).apply({"params": params}, seqs_BxT, positions, dec.init_cache(config, batch, width),
                                   dec.causal_mask(positions, width), return_hidden=True)[2]


def full_hidden(config, params, seqs_BxT):
  """The target's final-norm hidden states of a full causal forward (f32 [B, T, D])."""
  return np.asarray(_hidden_pass(config, params, jnp.asarray(seqs_BxT, jnp.int32)), np.float32)


def test_heads_rows_and_the_untrained_head_is_the_targets_own():
  config, target, _ = model_pair()
  hidden = jax.random.normal(jax.random.key(0), (3, config.d_model))
  w = heads_lib.lm_head_weight(config, target)
  fresh = {"heads": heads_lib.init_heads(config.d_model, 4, jax.random.key(1)), "lm_head": w}
  logits = heads_lib.heads_logits(fresh, config, hidden, 4)
  assert logits.shape == (3, 4, config.vocab_size) and logits.dtype == jnp.float32
  own = dec.head_logits(config, target, hidden[:, None, :])
  np.testing.assert_allclose(logits, jnp.broadcast_to(own, logits.shape), rtol=1e-5, atol=1e-5)
  trained = {"heads": random_heads(config, 4), "lm_head": w}
  logits = heads_lib.heads_logits(trained, config, hidden, 3)
  assert logits.shape == (3, 3, config.vocab_size)
  assert not np.allclose(logits[:, 0], logits[:, 1])
  for sampler in (T1, sampling.Sampler(0.7, top_k=5), GREEDY):
    q = np.asarray(sampler.probs(logits))
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert np.all(q >= 0)


# --- the offset: what the drafter reads after the prefill and after every commit --------------------------------------

_RECORDS = []


def _record(old_B, new_B, tau_B, hidden_BxD):
  _RECORDS.append(tuple(np.asarray(x) for x in (old_B, new_B, tau_B, hidden_BxD)))


@dataclasses.dataclass(frozen=True)
class SpyHeads(heads_lib.HeadsDrafter):
  """The heads drafter, reporting every commit (lengths, τ, the hidden state it keeps) to the host."""

  def commit(self, params, state, commit):
    state = super().commit(params, state, commit)
    jax.debug.callback(_record, commit.old_length_B, commit.new_length_B, commit.num_accepted_B, state.hidden_BxD)
    return state


def test_greedy_raw_heads_read_the_state_before_the_last_committed_token():
  """Greedy decoding with raw heads emits the autoregressive tokens, and at the prefill and every commit the state
  the drafter keeps is a full forward's hidden state at position ``new_length − 2`` (zeros for one-token prompts):
  the query whose law produced the last committed token. Head j on it is draft token j's law (position
  ``length + j``)."""
  config, target, _ = model_pair()
  params = {"heads": random_heads(config, 4), "lm_head": heads_lib.lm_head_weight(config, target)}
  keys = jax.random.split(jax.random.key(0), 4)
  tokens, lens = spec.prepare_prompts(RAGGED)
  ar = run_ar(config, target, RAGGED, keys, 16)
  _RECORDS.clear()
  out = spec.generate_speculative(target, params, keys, tokens, lens, target=config,
                                  drafter=SpyHeads(config, num_heads=4), gamma=4, max_new_tokens=16,
                                  verifier="block", sampler=GREEDY)
  jax.effects_barrier()
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  m = out.metrics
  assert 0 < int(m.num_accepted_tokens.sum()) < int(m.num_draft_tokens.sum())
  seqs = np.concatenate([np.asarray(tokens), np.zeros((4, 16), np.int32)], axis=1)
  for b, p in enumerate(RAGGED):
    seqs[b, len(p):len(p) + 16] = np.asarray(ar.tokens_BxN[b])
  hidden = full_hidden(config, target, seqs)
  assert len(_RECORDS) >= 2
  old, new, tau, kept = _RECORDS[0]  # the prefill's prompt commit
  np.testing.assert_array_equal(new, [len(p) for p in RAGGED])
  np.testing.assert_array_equal(tau, 0)
  checked = 0
  for old, new, tau, kept in _RECORDS:
    for b in range(4):
      if new[b] - old[b] != tau[b] + 1:  # a finished row, or a block cut by the budget
        continue
      want = hidden[b, new[b] - 2] if new[b] >= 2 else np.zeros(config.d_model, np.float32)
      np.testing.assert_allclose(kept[b], want, rtol=1e-4, atol=1e-4)
      checked += 1
  assert checked > 8
  # after the prefill, head j's law is heads_logits on that full-forward state
  drafter = heads_lib.HeadsDrafter(config, num_heads=4)
  state = spec.prefill_speculative(target, params, tokens, lens, target=config, drafter=drafter, gamma=4,
                                   max_new_tokens=16)
  _, draft = jax.jit(lambda ds: drafter.propose(params, ds, state.tokens_BxS, state.length_B, keys, 4, T1))(
      state.drafter_state)
  before = np.stack([hidden[b, len(p) - 2] if len(p) >= 2 else np.zeros(config.d_model) for b, p in
                     enumerate(RAGGED)]).astype(np.float32)
  want = T1.probs(heads_lib.heads_logits(params, config, jnp.asarray(before), 4))
  np.testing.assert_allclose(draft.q_BxNxV, want, rtol=1e-4, atol=1e-6)


# --- greedy equality and the exact law --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _small_lm(vocab, seed=5):
  config = small_config(vocab)
  return config, dec.init_params(config, seed)


@pytest.mark.parametrize("rescore", ["neural", "pbest_neural"])
def test_greedy_neural_rescored_drafts_emit_the_autoregressive_tokens(rescore):
  config, target, _ = model_pair()
  lm_config, lm_params = _small_lm(64)
  params = {"heads": random_heads(config, 4), "lm_head": heads_lib.lm_head_weight(config, target), "lm": lm_params}
  drafter = heads_lib.HeadsDrafter.build(config, lm_config, num_heads=4, rescore=rescore, top_k=8, pbest=3,
                                         lm_weight=0.5)
  assert drafter.max_len == lm_config.max_len - (12 if rescore == "pbest_neural" else 0)
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, RAGGED, keys, 16)
  tokens, lens = spec.prepare_prompts(RAGGED)
  out = spec.generate_speculative(target, params, keys, tokens, lens, target=config, drafter=drafter, gamma=4,
                                  max_new_tokens=16, verifier="token", sampler=GREEDY)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  m = out.metrics
  assert 0 < int(m.num_accepted_tokens.sum()) < int(m.num_draft_tokens.sum())
  assert int(m.invalid_prob_rows.sum()) == 0


@pytest.mark.parametrize("rescore,verifier", [("none", "token"), ("none", "block"), ("neural", "block")])
def test_raw_and_neural_rescored_drafts_are_lossless_at_t1(rescore, verifier):
  """V = 6, γ = 2: the first 3 emitted tokens follow the target's exact law (χ², 20k rows); some drafts rejected."""
  config, target, _ = model_pair(vocab=6, seed=3, noise=1.0)
  lm_config, lm_params = _small_lm(6)
  params = {"heads": random_heads(config, 2, scale=2.0), "lm_head": heads_lib.lm_head_weight(config, target),
            "lm": lm_params}
  drafter = heads_lib.HeadsDrafter.build(config, lm_config, num_heads=2, rescore=rescore, top_k=3, lm_weight=1.0)
  check_drafter_law_at_t1(config, target, params, drafter, verifier, gamma=2)


def test_pbest_neural_tree_search_is_brute_force_and_leaves_an_autoregressive_cache():
  """With width k^(γ−1) the tree search over the neural LM's scratch slots finds the best lattice path under full
  forwards of the LM over (committed + path); afterwards the LM cache holds at positions length .. length + γ − 2
  what an autoregressive pass over the chosen path writes."""
  config, target, _ = model_pair()
  lm_config, lm_params = _small_lm(64)
  gamma, k = 3, 3
  params = {"heads": random_heads(config, gamma, scale=2.0), "lm_head": heads_lib.lm_head_weight(config, target),
            "lm": lm_params}
  drafter = heads_lib.HeadsDrafter.build(config, lm_config, num_heads=gamma, rescore="pbest_neural", top_k=k,
                                         pbest=k ** (gamma - 1), lm_weight=1.5)
  prompts = [[1, 2, 3, 4, 5], [6, 7]]
  tokens, lens = spec.prepare_prompts(prompts)
  max_new = 8
  state = spec.prefill_speculative(target, params, tokens, lens, target=config, drafter=drafter, gamma=gamma,
                                   max_new_tokens=max_new)
  ds = state.drafter_state
  propose = jax.jit(lambda ds: drafter.propose(params, ds, state.tokens_BxS, state.length_B,
                                               jax.random.split(jax.random.key(0), 2), gamma, T1))
  new_ds, draft = propose(ds)
  assert draft.q_BxNxV is None
  cand, head_logp = lattice.lattice_candidates(heads_lib.heads_logits(params, config, ds.hidden_BxD, gamma), k)
  paths = np.asarray(list(itertools.product(range(k), repeat=gamma)))
  width = max(map(len, prompts)) + gamma
  # every path of both rows in one right-padded batch (a causal pass: padding after a sequence changes nothing)
  path_tokens = np.asarray(cand)[:, np.arange(gamma)[None, :], paths]  # [B, P, γ]
  seqs = np.zeros((len(prompts), len(paths), width), np.int32)
  for b, prompt in enumerate(prompts):
    seqs[b, :, :len(prompt)] = prompt
    seqs[b, :, len(prompt):len(prompt) + gamma] = path_tokens[b]
  logp, cache = _lm_pass(lm_config, lm_params, jnp.asarray(seqs.reshape(-1, width)))
  logp = np.asarray(logp).reshape(len(prompts), len(paths), width, -1)
  for b, prompt in enumerate(prompts):
    at = len(prompt) - 1 + np.arange(gamma)
    lm_logp = logp[b][np.arange(len(paths))[:, None], at[None, :], path_tokens[b]]
    head = np.asarray(head_logp[b])[np.arange(gamma)[None, :], paths]
    best = int(np.argmax((head + 1.5 * lm_logp).sum(1)))
    np.testing.assert_array_equal(draft.tokens_BxN[b], path_tokens[b, best])
    # the LM cache after the search = the causal pass over the prompt and the chosen path (positions < length + γ − 1)
    upto, row = len(prompt) + gamma - 1, b * len(paths) + best
    for got, want in ((new_ds.lm_cache.k_LxBxSxKxH, cache.k_LxBxSxKxH), (new_ds.lm_cache.v_LxBxSxKxH,
                                                                         cache.v_LxBxSxKxH)):
      np.testing.assert_allclose(got[:, b, :upto], want[:, row, :upto], rtol=1e-4, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _lm_pass(config, params, seqs_BxT):
  """Log-softmax rows and the KV cache of one causal pass over whole sequences."""
  batch, width = seqs_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  logits, cache = dec.Decoder(config).apply({"params": params}, seqs_BxT, positions,
                                            dec.init_cache(config, batch, width), dec.causal_mask(positions, width))
  return jax.nn.log_softmax(logits, -1), cache


def test_both_collectors_refuse_bad_inputs_with_the_same_named_errors():
  """BPD's hidden states and SPRINTER's labels check their inputs through one helper (pools.check_collection)."""
  from blockspec_jax.train import sprinter as sprinter_train
  target = dec.DecoderConfig.tiny(vocab_size=64, d_model=32, num_layers=2, max_len=64)
  drafter = small_config(64)
  tp, dp = dec.init_params(target, 0), dec.init_params(drafter, 1)
  tokens_BxP, lens_B = np.ones((3, 4), np.int32), np.full((3,), 4, np.int32)
  for collect in (functools.partial(heads_train.collect_hidden, target, tp),
                  functools.partial(sprinter_train.collect_labels, target, tp, drafter, dp)):
    run = functools.partial(collect, key=jax.random.key(0), temperature=1.0, progress=False)
    for kw, message in ((dict(rows=[1, 1, 2]), r"rows must be 3 distinct prompt ids >= 0, got \[1, 1, 2\]"),
                        (dict(rows=[0, -1, 2]), "distinct prompt ids >= 0"),
                        (dict(max_new_tokens=60), r"prompt width 4 \+ 60 new tokens does not fit max_len 64"),
                        (dict(batch_size=0), "batch_size must be an integer >= 1"),
                        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1")):
      with pytest.raises(ValueError, match=message):
        run(tokens_BxP, lens_B, **{"max_new_tokens": 3, "batch_size": 2, **kw})
    with pytest.raises(ValueError, match=r"need tokens_BxP \[B, P\] and prompt_len_B \[B\]"):
      run(tokens_BxP, lens_B[:2], max_new_tokens=3, batch_size=2)
    with pytest.raises(ValueError, match="vocab|ids"):
      run(tokens_BxP * 64, lens_B, max_new_tokens=3, batch_size=2)


# --- training data, checkpoints, the job ------------------------------------------------------------------------------

def test_training_positions_and_labels_match_the_drafters_offset():
  """Position t's feature is the target's hidden state at t (a full forward) and head j's label is the token at
  t + 2 + j: the drafter reads the state at length − 2 and drafts position length + j, the same offset."""
  config = dec.DecoderConfig.tiny(vocab_size=32)
  params = dec.init_params(config, 0)
  prompts, lens = np.array([[3, 4, 5, 6], [7, 8, 0, 0], [9, 0, 0, 0]], np.int32), np.array([4, 2, 1], np.int32)
  data = heads_train.collect_hidden(config, params, prompts, lens, max_new_tokens=5, key=jax.random.key(0),
                                    batch_size=2, progress=False, rows=np.array([10, 11, 12]))
  np.testing.assert_array_equal(data["row_N"], [10, 11, 12])
  np.testing.assert_array_equal(data["length_N"], lens + 5)
  hidden = full_hidden(config, params, data["tokens_NxT"])
  # row 0: t = 2 .. 6; row 1: t = 0 .. 4; row 2 (one-token prompt): t = −1 is dropped, t = 0 .. 3
  assert data["position_M"].tolist() == [2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3]
  np.testing.assert_allclose(data["features_MxD"], hidden[data["seq_M"], data["position_M"]], rtol=1e-4, atol=1e-5)
  labels = heads_train.head_labels(data, 3)
  for m, (n, t) in enumerate(zip(data["seq_M"], data["position_M"])):
    for j in range(3):
      want = data["tokens_NxT"][n, t + 2 + j] if t + 2 + j < data["length_N"][n] else -1
      assert labels[m, j] == want
  assert labels[0, 0] == data["tokens_NxT"][0, 4]  # the first generated token: what draft token 0 is after prefill


def test_heads_checkpoints_round_trip_and_refuse_corruption(tmp_path):
  heads = random_heads(dec.DecoderConfig.tiny(), 4)
  heads_train.save_heads(tmp_path / "h", heads, {"target": "tiny"})
  back, info = heads_train.load_heads(tmp_path / "h", d_model=32)
  assert info["target"] == "tiny" and info["num_heads"] == 4 and info["d_model"] == 32
  for key in heads:
    np.testing.assert_array_equal(back[key], heads[key])
  two, _ = heads_train.load_heads(tmp_path / "h", num_heads=2)
  assert two["w1_HxDxD"].shape == (2, 32, 32)
  np.testing.assert_array_equal(two["w2_HxDxD"], heads["w2_HxDxD"][:2])
  with pytest.raises(ValueError, match="has 4 heads; the drafter asks for 5"):
    heads_train.load_heads(tmp_path / "h", num_heads=5)
  with pytest.raises(ValueError, match="D = 32 .*this target has D = 64"):
    heads_train.load_heads(tmp_path / "h", d_model=64)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    heads_train.load_heads(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="not the work directory"):
    heads_train.load_heads(tmp_path)
  npz = tmp_path / "h" / heads_train.HEADS_NPZ
  raw = bytearray(npz.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  npz.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match="SHA-256 does not match"):
    heads_train.load_heads(tmp_path / "h")
  (tmp_path / "h" / heads_train.HEADS_JSON).write_text("[]")
  with pytest.raises(ValueError, match="corrupted"):
    heads_train.load_heads(tmp_path / "h")
  with pytest.raises(ValueError, match="heads must be a dict"):
    heads_train.save_heads(tmp_path / "bad", {"w1_HxDxD": heads["w1_HxDxD"]})


def _smoke(workdir, *bindings):
  """The smoke job (gin/train/heads_smoke.gin) at a third of its size: 32 prompts, 40 steps."""
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([SMOKE], ["heads_job.progress = False", "heads_job.num_prompts = 32",
                                                  "heads_job.num_steps = 40", *bindings])
    return heads_job_lib.heads_job(workdir)
  finally:
    gin.clear_config()


def test_smoke_job_runs_resumes_without_recollecting_and_its_heads_load_into_the_drafter(tmp_path, monkeypatch):
  workdir = tmp_path / "smoke"
  first = _smoke(workdir, "heads_job.stop_after = 20")
  assert first["steps"] == 20 and first["resumed_from"] is None and not first["data_cached"]

  def no_collection(*args, **kwargs):
    raise AssertionError("the data were collected again")

  monkeypatch.setattr(heads_train, "collect_hidden", no_collection)
  summary = _smoke(workdir)
  assert summary["steps"] == 40 and summary["resumed_from"] == 20 and summary["data_cached"]
  assert json.loads((workdir / "metrics.json").read_text())["steps"] == 40
  for name in ("heads.json", "heads.npz", "ngram.json", "ngram.npz", "hidden_train.npz", "hidden_heldout.npz",
               "lm_head.npy", "metrics.jsonl"):
    assert (workdir / name).is_file(), name
  after, before = summary["heldout_after"], summary["heldout_before"]
  assert len(after["top1_per_head"]) == 4 and len(after["ce_per_head"]) == 4
  assert all(0 <= a <= 1 for a in after["top1_per_head"] + after["top1_rescored_per_head"])
  assert after["num_per_head"] == before["num_per_head"] and after["num_per_head"][0] == 8 * 16
  assert summary["data"]["train"]["prompts"] == 24 and summary["data"]["heldout"]["prompts"] == 8
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 40 and np.mean([r["loss"] for r in rows[-5:]]) < np.mean([r["loss"] for r in rows[:5]])  # the training loss goes down
  assert summary["ngram_heldout_nll"] > 0
  # held-out prompts never reach the training data
  train, _ = heads_train.load_hidden(workdir / "hidden_train.npz")
  held, _ = heads_train.load_hidden(workdir / "hidden_heldout.npz")
  assert np.intersect1d(train["row_N"], held["row_N"]).size == 0
  # the saved heads and n-gram load into the drafter (through load_params, as the decoding jobs call it)
  config = train_main.tiny_decoder(vocab_size=128, d_model=32, num_layers=2)
  target = dec.init_params(config, 0)
  model = type("Loaded", (), {"config": config, "params": {"params": target}})()
  drafter = heads_lib.HeadsDrafter(config, num_heads=3, rescore="ngram", heads=str(workdir))
  params = drafter.load_params(model, model)
  assert params["heads"]["w1_HxDxD"].shape == (3, 32, 32) and params["ngram"].order == 3
  # another binding of the job's settings over cached data is refused, not mixed
  with pytest.raises(ValueError, match="other settings"):
    _smoke(workdir, "heads_job.temperature = 0.5")


# --- errors -----------------------------------------------------------------------------------------------------------

def test_bad_settings_are_clear_errors(tmp_path):
  config, target, _ = model_pair()
  lm_config, _ = _small_lm(64)
  drafter = heads_lib.HeadsDrafter(config, num_heads=2)
  with pytest.raises(ValueError, match=r"gamma must be an integer in \[1, 2\]"):
    drafter.num_nodes(3)
  tokens, lens = spec.prepare_prompts(RAGGED)
  params = {"heads": random_heads(config, 2), "lm_head": heads_lib.lm_head_weight(config, target)}
  with pytest.raises(ValueError, match="gamma must be an integer"):
    spec.generate_speculative(target, params, jax.random.split(jax.random.key(0), 4), tokens, lens, target=config,
                              drafter=drafter, gamma=3, max_new_tokens=4)
  for bad in (0, 65, 2.5):
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, V = 64\]"):
      heads_lib.HeadsDrafter(config, top_k=bad)
  with pytest.raises(ValueError, match="unknown rescorer 'beam'; known: none, ngram, neural"):
    heads_lib.HeadsDrafter(config, rescore="beam")
  with pytest.raises(ValueError, match="needs the neural LM's DecoderConfig"):
    heads_lib.HeadsDrafter(config, rescore="neural")
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    heads_lib.HeadsDrafter(config, rescore="pbest_neural", lm_config=dec.DecoderConfig.tiny(vocab_size=32))
  with pytest.raises(ValueError, match="lm_weight"):
    heads_lib.HeadsDrafter(config, lm_weight=-1.0)
  with pytest.raises(ValueError, match="pbest"):
    heads_lib.HeadsDrafter(config, pbest=0)
  with pytest.raises(ValueError, match="num_heads"):
    heads_lib.HeadsDrafter(config, num_heads=0)
  with pytest.raises(ValueError, match="vocabulary mismatch between drafter"):
    small = heads_lib.HeadsDrafter(dec.DecoderConfig.tiny(vocab_size=32), num_heads=2)
    spec.generate_speculative(target, params, jax.random.split(jax.random.key(0), 4), tokens, lens, target=config,
                              drafter=small, gamma=2, max_new_tokens=4)
  assert heads_lib.HeadsDrafter.build(config, lm_config, rescore="ngram").lm_config is None
  assert heads_lib.HeadsDrafter(config).max_len is None and contracts.reads_target(drafter)
  model = type("Loaded", (), {"config": config, "params": {"params": target}})()
  with pytest.raises(ValueError, match="needs trained BPD heads"):
    drafter.load_params(model, model)
  with pytest.raises(FileNotFoundError):
    dataclasses.replace(drafter, heads=str(tmp_path)).load_params(model, model)
  with pytest.raises(ValueError, match="asked for 3 heads"):
    heads_lib.heads_logits(params, config, jnp.zeros((1, config.d_model)), 3)
  with pytest.raises(ValueError, match="heads_job.num_heads must be an integer >= 1"):
    _smoke(tmp_path / "x", "heads_job.num_heads = 0")
  with pytest.raises(ValueError, match="not both"):
    _smoke(tmp_path / "x", "heads_job.target = 'qwen2.5-coder-1.5b'")
  with pytest.raises(ValueError, match="top_k = 200 exceeds"):
    _smoke(tmp_path / "x", "heads_job.top_k = 200")
  assert not (tmp_path / "x").exists()


def test_real_target_gin_file_parses_and_validates(tmp_path):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([os.path.join(REPO, "gin/train/heads_qwen.gin")], [])
    settings = heads_job_lib.heads_job(tmp_path / "qwen", dry_run=True)  # checks the name; loads no model
  finally:
    gin.clear_config()
  assert settings["target"] == "qwen2.5-coder-1.5b" and settings["num_heads"] == 8
  assert settings["temperature"] == 1.0 and settings["dtype"] == "float32"
  assert not (tmp_path / "qwen").exists()


# --- the p best paths verified together (heads_tree, the paper's global rescoring) -----------------------------------

def _tree_drafter(config, target, vocab, rescore, num_heads=3, pbest=4, top_k=4, scale=2.0):
  """A heads_tree drafter with random heads (and, for "pbest_ngram", an n-gram LM of a few repeated sequences)."""
  params = {"heads": random_heads(config, num_heads, scale=scale), "lm_head": heads_lib.lm_head_weight(config, target)}
  if rescore == "pbest_ngram":
    params["ngram"] = lattice.build_ngram([[1, 2, 3, 4, 5, 0] * 4, [3, 1, 4, 1, 5, 2] * 4], vocab, order=3)
  drafter = heads_lib.HeadsTreeDrafter.build(config, None, num_heads=num_heads, rescore=rescore, top_k=top_k,
                                             pbest=pbest, lm_weight=0.7)
  return drafter, params


@pytest.mark.parametrize("rescore", ["pbest_ngram", "pbest_none"])
def test_the_tree_is_the_searchs_p_best_paths_as_point_mass_chains(rescore):
  """The draft holds the search's ``pbest`` paths (lattice.pbest_paths on the heads' logits and the same LM), path
  ``w``'s token ``d`` at node ``d·p + w``, each chain's nodes children of the one above, no q rows (point masses); the
  best path is the 1best chain drafter's draft."""
  config, target, _ = model_pair(vocab=6, seed=3, noise=1.0)
  drafter, params = _tree_drafter(config, target, 6, rescore)
  gamma, batch = 3, 2
  tokens_BxS = jnp.asarray([[1, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                            [3, 1, 4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  length_B = jnp.asarray([3, 4], jnp.int32)
  state = heads_lib.HeadsState(jax.random.normal(jax.random.key(4), (batch, config.d_model)))
  _, draft = drafter.propose(params, state, tokens_BxS, length_B, jax.random.split(jax.random.key(0), batch), gamma,
                             T1)
  assert draft.q_BxNxV is None and not draft.is_chain and draft.tokens_BxN.shape == (batch, 4 * gamma)
  logits = heads_lib.heads_logits(params, config, state.hidden_BxD, gamma)
  cand, logp = lattice.lattice_candidates(logits, 4)
  lm, lm_state = (lattice.ngram_lattice_lm(params["ngram"], tokens_BxS, length_B) if rescore == "pbest_ngram"
                  else lattice.zero_lattice_lm())
  _, paths_BxWxG, score_BxW, _ = lattice.pbest_paths(cand, logp, lm, lm_state, 0.7, 4)
  assert np.all(np.diff(np.asarray(score_BxW), axis=1) <= 0)  # best first
  assert len({tuple(p) for p in np.asarray(paths_BxWxG[0]).tolist()}) == 4  # distinct paths (4^3 >= 4)
  np.testing.assert_array_equal(np.asarray(draft.tokens_BxN).reshape(batch, gamma, 4),
                                np.swapaxes(np.asarray(paths_BxWxG), 1, 2))
  np.testing.assert_array_equal(np.asarray(draft.parents_BxN[0]), [-1, -1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7])
  chain = heads_lib.HeadsDrafter.build(config, None, num_heads=3, rescore=rescore, top_k=4, pbest=4, lm_weight=0.7)
  _, one = chain.propose(params, state, tokens_BxS, length_B, jax.random.split(jax.random.key(0), batch), gamma, T1)
  np.testing.assert_array_equal(np.asarray(one.tokens_BxN), np.asarray(paths_BxWxG[:, 0]))


@pytest.mark.parametrize("rescore", ["pbest_ngram", "pbest_none"])
def test_the_p_best_tree_is_greedy_exact_and_lossless_at_t1(rescore):
  """Random heads, γ = 3, 4 paths: at T = 0 the tokens are the autoregressive ones and some drafts are accepted;
  at T = 1 (V = 6) the first 3 emitted tokens follow the target's exact law (χ², 20k rows)."""
  config, target, _ = model_pair()
  drafter, params = _tree_drafter(config, target, 64, rescore, top_k=16, scale=0.1)
  check_drafter_greedy(config, target, params, drafter, "point_mass", gamma=3, max_new=12)
  config, target, _ = model_pair(vocab=6, seed=3, noise=1.0)
  drafter, params = _tree_drafter(config, target, 6, rescore)
  check_drafter_law_at_t1(config, target, params, drafter, "point_mass", gamma=3)
