"""The training stack (blockspec_jax.train): divergences, trainable/frozen splits and LoRA, the trainer (frozen
parameters, exact resume, 8 fake devices = 1), DistillSpec data and loss, and the smoke job through its entry point."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import decoder as dec
from blockspec_jax.train import distill, divergences, params as params_lib, recipe as recipe_lib, trainer

from helpers import fake_devices_env, run_train_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


init_params = dec.init_params


def logits_of(*rows):
  """Logits [1, R, V] whose softmax is each given probability row."""
  return jnp.log(jnp.asarray(rows, jnp.float32))[None]


# --- divergences ----------------------------------------------------------------------------------------------------

P_ROWS = ([0.5, 0.3, 0.2], [0.25, 0.25, 0.5])
Q_ROWS = ([0.2, 0.3, 0.5], [0.25, 0.5, 0.25])


def test_tvd_is_half_l1_on_hand_rows():
  p, q = logits_of(*P_ROWS), logits_of(*Q_ROWS)
  # row 0: ½(0.3 + 0 + 0.3) = 0.3; row 1: ½(0 + 0.25 + 0.25) = 0.25
  assert float(divergences.token_divergence("tvd", p, q)) == pytest.approx(0.275, abs=1e-6)
  mask = jnp.asarray([[1.0, 0.0]])
  assert float(divergences.token_divergence("tvd", p, q, mask)) == pytest.approx(0.3, abs=1e-6)
  assert float(divergences.mean_total_variation(p, q, mask)) == pytest.approx(0.3, abs=1e-6)
  # T = 0 (evaluation only): one-hot argmaxes, row 0 differs (0 vs 2), row 1 differs (2 vs 1)
  assert float(divergences.mean_total_variation(p, q, temperature=0.0)) == pytest.approx(1.0)
  assert float(divergences.token_divergence("tvd", p, q, jnp.zeros((1, 2)))) == 0.0  # no position: 0, not NaN


def test_token_and_sequence_normalization_on_a_hand_table():
  """Row 0 has one set position (value 1), row 1 three (values 3, 5, 7), row 2 none: pooled over tokens
  (1 + 3 + 5 + 7) / 4 = 4; per sequence (1 + 5) / 2 = 3 (the empty row counts in neither)."""
  values = jnp.asarray([[1.0, 9.0, 9.0], [3.0, 5.0, 7.0], [2.0, 2.0, 2.0]])
  mask = jnp.asarray([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
  assert float(divergences.masked_mean(values, mask)) == pytest.approx(4.0)
  assert float(divergences.masked_mean(values, mask, "token")) == pytest.approx(4.0)
  assert float(divergences.masked_mean(values, mask, "sequence")) == pytest.approx(3.0)
  assert float(divergences.masked_mean(values, None, "sequence")) == pytest.approx((19 / 3 + 5.0 + 2.0) / 3)
  assert float(divergences.masked_mean(values, jnp.zeros_like(mask), "sequence")) == 0.0  # no position: 0, not NaN
  with pytest.raises(ValueError, match="unknown loss normalization 'per_token'; known: token, sequence"):
    divergences.masked_mean(values, mask, "per_token")


def test_distill_loss_normalizations_weigh_positions_as_the_paper_and_as_before():
  """DistillSpec's loss ``(1/B) Σ_b (1/|y_b|) Σ_t D`` against the pooled mean, on rows with 1, 4 and 2 positions:
  each equals its hand formula over the per-position divergences, and they differ."""
  target, drafter = init_params(TARGET, 0), init_params(DRAFTER, 1)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, size=(3, 6)), jnp.int32)
  mask = jnp.asarray([[0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], jnp.float32)
  d = np.asarray(divergences.per_token_divergence("fkl", distill.sequence_logits(TARGET, target, tokens),
                                                  distill.sequence_logits(DRAFTER, drafter, tokens)), np.float64)
  m = np.asarray(mask, np.float64)
  want = {"token": (d * m).sum() / m.sum(), "sequence": np.mean((d * m).sum(axis=1) / m.sum(axis=1))}
  for normalization, expected in want.items():
    loss_fn = distill.DistillLoss(TARGET, DRAFTER, "fkl", normalization=normalization)
    loss, aux = loss_fn(drafter, {"target": target, "drafter": {}}, {"tokens_BxT": tokens, "mask_BxT": mask}, None)
    assert float(loss) == pytest.approx(expected, rel=1e-5), normalization
  assert abs(want["token"] - want["sequence"]) > 1e-3
  assert distill.DistillLoss(TARGET, DRAFTER).normalization == "sequence"  # the paper's, for new runs
  with pytest.raises(ValueError, match="unknown loss normalization"):
    distill.DistillLoss(TARGET, DRAFTER, normalization="tokens")


def test_fkl_rkl_hand_values_and_asymmetry():
  p, q = logits_of([0.5, 0.5]), logits_of([0.9, 0.1])
  fkl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
  rkl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
  assert float(divergences.token_divergence("fkl", p, q)) == pytest.approx(fkl, abs=1e-6)  # 0.5108
  assert float(divergences.token_divergence("rkl", p, q)) == pytest.approx(rkl, abs=1e-6)  # 0.3681
  assert fkl != pytest.approx(rkl, abs=0.1)
  assert float(divergences.token_divergence("rkl", q, p)) == pytest.approx(fkl, abs=1e-6)  # swap = the other
  # temperature divides the logits before the softmax
  lp, lq = jax.random.normal(jax.random.key(0), (2, 2, 3, 11)) * 3
  assert float(divergences.token_divergence("fkl", lp, lq, temperature=2.0)) == pytest.approx(
      float(divergences.token_divergence("fkl", lp / 2, lq / 2)), rel=1e-5)


def test_jsd_hand_value_and_bounds():
  p, q = logits_of([0.5, 0.5]), logits_of([0.9, 0.1])
  m = [0.7, 0.3]
  kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b))
  hand = 0.5 * kl([0.5, 0.5], m) + 0.5 * kl([0.9, 0.1], m)
  assert float(divergences.token_divergence("jsd", p, q, beta=0.5)) == pytest.approx(hand, abs=1e-6)
  lp, lq = jax.random.normal(jax.random.key(1), (2, 4, 5, 16)) * 4
  for beta in (0.1, 0.5, 0.9):
    bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    d = divergences.per_token_divergence("jsd", lp, lq, beta=beta)
    assert float(d.min()) >= -1e-6 and float(d.max()) <= bound + 1e-6
    # (nearly) disjoint supports reach the bound H(β)
    far = divergences.token_divergence("jsd", logits_of([1 - 1e-7, 1e-7]), logits_of([1e-7, 1 - 1e-7]), beta=beta)
    assert float(far) == pytest.approx(bound, abs=1e-4)


def test_every_divergence_is_zero_when_p_equals_q_and_has_finite_gradients():
  logits = jax.random.normal(jax.random.key(2), (3, 5, 32)) * 5
  for name in divergences.DIVERGENCES:
    assert abs(float(divergences.token_divergence(name, logits, logits))) < 1e-6, name
  extreme = jnp.asarray([[[1e4, -1e4, 0.0, 50.0]]])
  for name in ("fkl", "rkl", "jsd"):
    grad = jax.grad(lambda d: divergences.token_divergence(name, extreme[..., ::-1], d))(extreme)
    assert bool(jnp.all(jnp.isfinite(grad))), name


def test_divergence_errors():
  x = jnp.zeros((1, 2, 4))
  with pytest.raises(ValueError, match="unknown divergence 'kl'; known: fkl, rkl, jsd, tvd"):
    divergences.token_divergence("kl", x, x)
  for t in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="temperature must be > 0"):
      divergences.token_divergence("fkl", x, x, temperature=t)
  for beta in (0.0, 1.0):
    with pytest.raises(ValueError, match="beta in"):
      divergences.token_divergence("jsd", x, x, beta=beta)
  with pytest.raises(ValueError, match="differ in shape"):
    divergences.token_divergence("fkl", x, jnp.zeros((1, 2, 5)))
  with pytest.raises(ValueError, match="mask shape"):
    divergences.token_divergence("fkl", x, x, jnp.ones((2, 2)))


# --- trainable / frozen, LoRA ---------------------------------------------------------------------------------------

CONFIG = dec.DecoderConfig.tiny(matmul="xla")


def test_partition_merge_and_layer_predicate():
  params = init_params(CONFIG, 0)
  trainable, frozen = params_lib.partition(params, params_lib.layers_trainable([1], extra=("lm_head",)))
  assert set(trainable) == {"layers_1", "lm_head"}
  assert "layers_1" not in frozen and "lm_head" not in frozen and "layers_0" in frozen
  merged = params_lib.merge(trainable, frozen)
  assert jax.tree.structure(merged) == jax.tree.structure(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))
  mlp, rest = params_lib.partition(params, params_lib.names_trainable("mlp"))
  assert all("mlp" in p for p in params_lib.leaf_paths(mlp)) and not any("mlp" in p for p in params_lib.leaf_paths(rest))
  with pytest.raises(ValueError, match="in both"):
    params_lib.merge(trainable, params)


def test_lora_zero_init_is_the_base_model_exactly():
  params = init_params(CONFIG, 0)
  lora = params_lib.init_lora(params, rank=2, key=jax.random.key(3), targets=("q", "v", "down"), alpha=4.0)
  assert lora.scale == 2.0
  assert lora.adapters["layers_0"]["attn"]["q"]["a"].shape == (2, CONFIG.d_model)
  assert lora.adapters["layers_0"]["attn"]["q"]["b"].shape == (CONFIG.num_heads * CONFIG.head_dim, 2)
  adapted = params_lib.apply_lora(params, lora)
  for a, b in zip(jax.tree.leaves(adapted), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = jnp.asarray([[1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(np.asarray(distill.sequence_logits(CONFIG, adapted, tokens)),
                                np.asarray(distill.sequence_logits(CONFIG, params, tokens)))
  # a nonzero B changes exactly the targeted weights, by scale · B @ A
  bumped = lora.replace(adapters=jax.tree.map(lambda x: x + 0.1, lora.adapters))
  changed = params_lib.apply_lora(params, bumped)
  w = params["layers_1"]["mlp"]["down"]["weight"]
  ad = bumped.adapters["layers_1"]["mlp"]["down"]
  np.testing.assert_allclose(changed["layers_1"]["mlp"]["down"]["weight"], w + 2.0 * ad["b"] @ ad["a"], rtol=1e-6)
  np.testing.assert_array_equal(changed["layers_1"]["attn"]["k"]["weight"], params["layers_1"]["attn"]["k"]["weight"])
  with pytest.raises(ValueError, match="no linear module"):
    params_lib.init_lora(params, 2, jax.random.key(0), targets=("wq",))
  with pytest.raises(ValueError, match="rank"):
    params_lib.init_lora(params, 0, jax.random.key(0))


def _logit_loss(target_params):
  """A loss over any drafter-shaped trainable/frozen split: MSE to a fixed model's logits."""
  def loss_fn(trainable, frozen, batch, key):
    del key
    params = params_lib.merge(trainable, frozen)
    out = distill.sequence_logits(CONFIG, params, batch["tokens_BxT"])
    ref = distill.sequence_logits(CONFIG, target_params, batch["tokens_BxT"])
    return jnp.mean((out - ref) ** 2), {}
  return loss_fn


def _opt_shapes(opt_state):
  return sorted(tuple(x.shape) for x in jax.tree.leaves(opt_state) if np.ndim(x) > 0)


def test_frozen_params_unchanged_and_absent_from_optimizer_state():
  params, ref = init_params(CONFIG, 0), init_params(CONFIG, 1)
  trainable, frozen = params_lib.partition(params, params_lib.layers_trainable([1]))
  optimizer = trainer.make_optimizer("adamw", 1e-2, "constant", weight_decay=0.01)
  state = trainer.init_state(trainable, optimizer)
  # adam's mu and nu, each exactly the trainable shapes; nothing shaped like a frozen-only leaf
  assert _opt_shapes(state.opt_state) == sorted(2 * [tuple(x.shape) for x in jax.tree.leaves(trainable)])
  assert params_lib.count_params(state.opt_state) <= 2 * params_lib.count_params(trainable) + 8
  step = trainer.make_train_step(_logit_loss(ref), optimizer)
  batch = {"tokens_BxT": jnp.arange(12, dtype=jnp.int32).reshape(2, 6)}
  new_state, metrics = step(state, frozen, batch, jax.random.key(0))
  assert int(new_state.step) == 1 and math.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(new_state.trainable), jax.tree.leaves(trainable)):
    assert not np.array_equal(np.asarray(a), np.asarray(b))
  merged = params_lib.merge(new_state.trainable, frozen)
  for name in ("layers_0", "embed", "final_norm", "lm_head"):
    for a, b in zip(jax.tree.leaves(merged[name]), jax.tree.leaves(params[name])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # LoRA: the whole base model is frozen; the optimizer holds adapter shapes only
  lora = params_lib.init_lora(params, 2, jax.random.key(1), targets=("q", "v"))
  lora_loss = lambda lo, base, batch, key: _logit_loss(ref)(params_lib.apply_lora(base, lo), {}, batch, key)
  lstate = trainer.init_state(lora, optimizer)
  assert _opt_shapes(lstate.opt_state) == sorted(2 * [tuple(x.shape) for x in jax.tree.leaves(lora)])
  lstate, _ = trainer.make_train_step(lora_loss, optimizer)(lstate, params, batch, jax.random.key(0))
  assert lstate.trainable.scale == lora.scale
  assert float(jnp.abs(lstate.trainable.adapters["layers_0"]["attn"]["q"]["b"]).max()) > 0


def test_optimizer_settings_errors():
  with pytest.raises(ValueError, match="unknown optimizer 'lion'; known: adamw, adam, sgd"):
    trainer.make_optimizer("lion")
  with pytest.raises(ValueError, match="unknown schedule"):
    trainer.make_optimizer(schedule="linear")
  with pytest.raises(ValueError, match="warmup_steps"):
    trainer.make_optimizer(warmup_steps=20, total_steps=10)
  with pytest.raises(ValueError, match="warmup_steps < total_steps"):
    trainer.make_schedule(1.0, "cosine", warmup_steps=20, total_steps=20)
  assert trainer.make_schedule(1.0, "constant", warmup_steps=20, total_steps=20)(20) == 1.0
  sched = trainer.make_schedule(1.0, "cosine", warmup_steps=2, total_steps=10)
  assert float(sched(0)) == 0.0 and float(sched(2)) == pytest.approx(1.0) and float(sched(10)) == pytest.approx(0.0)
  with pytest.raises(ValueError, match="no trainable"):
    trainer.init_state({}, optax.sgd(1.0))


def _quadratic_fit(workdir, num_steps, stop_after=None):
  """A cheap generic job: fit w to a step-dependent target (batch = a pure function of the step) with noise keys."""
  def loss_fn(trainable, frozen, batch, key):
    noise = 0.01 * jax.random.normal(key, trainable["w"].shape)
    return jnp.mean((trainable["w"] * frozen["scale"] - batch["y_B"] + noise) ** 2), {"w0": trainable["w"][0]}
  batch_fn = lambda step, trainable: {"y_B": jnp.arange(4, dtype=jnp.float32) + 0.1 * step}
  eval_fn = lambda step, trainable: {"norm": float(jnp.linalg.norm(trainable["w"]))}
  return trainer.fit(loss_fn=loss_fn, optimizer=QUAD_OPTIMIZER, trainable={"w": jnp.zeros(4)},
                     frozen={"scale": jnp.float32(2.0)}, batch_fn=batch_fn, key=jax.random.key(0), workdir=workdir,
                     eval_fn=eval_fn, loop=trainer.Loop(num_steps=num_steps, checkpoint_every=3, max_to_keep=5,
                                                        eval_every=2, progress=False, stop_after=stop_after))


QUAD_OPTIMIZER = trainer.make_optimizer("adam", 0.1, "constant")


def test_accumulate_applies_the_mean_gradient_every_k_steps():
  """accumulate = k: parameters move only on every k-th step, by one update of the mean of the k gradients (the
  clip applies to that mean); the schedule counts updates."""
  grads = [{"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([3.0, 4.0])}, {"w": jnp.array([0.5, 0.5])},
           {"w": jnp.array([-1.0, 2.0])}]
  opt = trainer.make_optimizer("sgd", 0.5, "cosine", 0, 4, clip_norm=None, accumulate=2)
  params = {"w": jnp.zeros(2)}
  state, seen = opt.init(params), []
  for g in grads:
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
    seen.append(np.asarray(params["w"]))
  lr = trainer.make_schedule(0.5, "cosine", 0, 2)  # 4 steps of 2 = 2 updates
  first = -float(lr(0)) * np.array([2.0, 1.0])  # mean of grads 0 and 1
  np.testing.assert_array_equal(seen[0], np.zeros(2))
  np.testing.assert_allclose(seen[1], first, rtol=1e-6)
  np.testing.assert_array_equal(seen[2], seen[1])
  np.testing.assert_allclose(seen[3], first - float(lr(1)) * np.array([-0.25, 1.25]), rtol=1e-6)
  # the clip sees the accumulated mean, not each micro-batch: a mean of norm 5 clipped to 1
  clipped = trainer.make_optimizer("sgd", 1.0, "constant", clip_norm=1.0, accumulate=2)
  state, p = clipped.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)}
  for g in ({"w": jnp.array([6.0, 8.0])}, {"w": jnp.array([0.0, 0.0])}):
    updates, state = clipped.update(g, state, p)
    p = optax.apply_updates(p, updates)
  np.testing.assert_allclose(np.asarray(p["w"]), [-0.6, -0.8], rtol=1e-6)
  for bad in (0, 1.5, True, "2"):
    with pytest.raises(ValueError, match="accumulate must be an integer >= 1"):
      trainer.make_optimizer(accumulate=bad)


def test_a_run_stopped_between_accumulated_updates_resumes_exactly(tmp_path):
  opt = trainer.make_optimizer("adamw", 0.05, "cosine", 1, 9, 0.01, 1.0, accumulate=3)
  def loss_fn(trainable, frozen, batch, key):
    noise = 0.01 * jax.random.normal(key, trainable["w"].shape)
    return jnp.mean((trainable["w"] * frozen["scale"] - batch["y_B"] + noise) ** 2), {}
  def fit(workdir, stop_after=None):
    return trainer.fit(loss_fn=loss_fn, optimizer=opt, trainable={"w": jnp.zeros(4)},
                       frozen={"scale": jnp.float32(2.0)},
                       batch_fn=lambda step, t: {"y_B": jnp.arange(4, dtype=jnp.float32) + 0.1 * step},
                       key=jax.random.key(0), workdir=workdir,
                       loop=trainer.Loop(num_steps=9, checkpoint_every=2, max_to_keep=2, progress=False, plot=False,
                                         stop_after=stop_after))
  straight = fit(tmp_path / "a")
  assert fit(tmp_path / "b", stop_after=4).resumed_from is None  # 4 = one update and one micro-step into the next
  resumed = fit(tmp_path / "b")
  assert resumed.resumed_from == 4
  for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.abs(straight.state.trainable["w"]).max()) > 0


def test_a_donating_step_computes_the_same_state_and_frees_the_one_passed_in(tmp_path):
  """``make_train_step(donate=True)``, what ``fit`` runs: the new state is the non-donating step's bit for bit, and
  the state passed in is deleted (its buffers became the new state's, so the two never coexist). ``fit`` copies a
  fresh state first: the caller's initial arrays survive the run, unchanged."""
  def loss_fn(trainable, frozen, batch, key):
    return jnp.mean((trainable["w"] @ frozen["x"] - batch["y"]) ** 2) + 0.01 * jax.random.normal(key), {}
  opt = trainer.make_optimizer("adamw", 0.05, "cosine", 1, 4, 0.01, 1.0)
  frozen, batch = {"x": jnp.eye(8) * 2.0}, {"y": jnp.ones((8, 8))}
  init = {"w": jax.random.normal(jax.random.key(1), (8, 8))}
  kept, donated = trainer.init_state(init, opt), trainer.init_state({"w": jnp.array(init["w"], copy=True)}, opt)
  plain, donating = trainer.make_train_step(loss_fn, opt), trainer.make_train_step(loss_fn, opt, donate=True)
  for step in range(3):
    new_kept, _ = plain(kept, frozen, batch, jax.random.key(step))
    new_donated, _ = donating(donated, frozen, batch, jax.random.key(step))
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    assert all(x.is_deleted() for x in jax.tree.leaves(donated))
    kept, donated = new_kept, new_donated
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(donated)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  before = np.asarray(init["w"]).copy()
  result = trainer.fit(loss_fn=loss_fn, optimizer=opt, trainable=init, frozen=frozen, batch_fn=lambda s, t: batch,
                       key=jax.random.key(0), workdir=tmp_path,
                       loop=trainer.Loop(num_steps=4, checkpoint_every=2, progress=False, plot=False))
  assert not init["w"].is_deleted()
  np.testing.assert_array_equal(np.asarray(init["w"]), before)
  assert not np.array_equal(np.asarray(result.state.trainable["w"]), before)


def test_fit_drops_metrics_past_the_checkpoint_it_resumes_from(tmp_path):
  straight = _quadratic_fit(tmp_path / "a", 8)
  _quadratic_fit(tmp_path / "b", 8, stop_after=4)  # checkpoints 3 and 4 (the stop's own save)
  # as if killed after logging step 4 but before its checkpoint: the resume restarts from 3 and re-logs step 4
  import shutil
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  resumed = _quadratic_fit(tmp_path / "b", 8)
  assert resumed.resumed_from == 3 and [r["step"] for r in resumed.history] == [4, 5, 6, 7, 8]
  np.testing.assert_array_equal(np.asarray(straight.state.trainable["w"]), np.asarray(resumed.state.trainable["w"]))
  rows_a = trainer.read_metrics(tmp_path / "a" / "metrics.jsonl")
  rows_b = trainer.read_metrics(tmp_path / "b" / "metrics.jsonl")
  assert [r["step"] for r in rows_b] == list(range(1, 9))
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ("seconds", "seconds_total", "peak_rss_gb",
                                                                "programs_compiled")}
                        for r in rows]
  assert strip(rows_a) == strip(rows_b)
  assert [r["step"] for r in rows_a if "eval_norm" in r] == [2, 4, 6, 8]
  assert rows_a[-1]["loss"] < rows_a[0]["loss"]
  # a finished run called again does nothing
  again = _quadratic_fit(tmp_path / "a", 8)
  assert again.resumed_from == 8 and again.history == []


# --- DistillSpec ----------------------------------------------------------------------------------------------------

TARGET = dec.DecoderConfig.tiny(vocab_size=64, matmul="xla")
DRAFTER = dec.DecoderConfig.tiny(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                 ffn_dim=32, matmul="xla")


def test_vocab_mismatch_and_bad_settings():
  with pytest.raises(ValueError, match="target vocab_size = 64, drafter vocab_size = 32"):
    distill.DistillLoss(TARGET, dec.DecoderConfig.tiny(vocab_size=32))
  with pytest.raises(ValueError, match="temperature must be > 0"):
    distill.DistillLoss(TARGET, DRAFTER, temperature=0.0)
  with pytest.raises(ValueError, match="unknown divergence"):
    distill.DistillLoss(TARGET, DRAFTER, divergence="kld")
  prompts, lens = distill.random_prompts(8, 4, 64, 0)
  with pytest.raises(ValueError, match="unknown data source"):
    distill.make_distill_data(TARGET, None, DRAFTER, prompts, lens, batch_size=4, max_new_tokens=4,
                              source="replay")


def test_split_and_batches_never_touch_heldout():
  train, held = distill.split_prompts(40, 0.25, seed=3)
  assert len(held) == 10 and len(train) == 30 and not set(train) & set(held)
  again = distill.split_prompts(40, 0.25, seed=3)
  np.testing.assert_array_equal(train, again[0]) and np.testing.assert_array_equal(held, again[1])
  data = distill.DistillData(TARGET, DRAFTER, np.zeros((40, 2), np.int32), np.full(40, 2, np.int32), train, held,
                             np.zeros((40, 4), np.int32), np.zeros((40, 4), np.float32), batch_size=7,
                             max_new_tokens=2, sample_temperature=1.0, source="mixed", on_policy_fraction=0.5)
  seen = np.concatenate([distill._train_rows(data, s) for s in range(30)])
  assert not set(seen.tolist()) & set(held.tolist())
  assert set(seen.tolist()) == set(train.tolist())  # 210 draws cycle through every training prompt
  np.testing.assert_array_equal(distill._train_rows(data, 5), distill._train_rows(data, 5))
  sources = [distill._is_on_policy(data, s) for s in range(200)]
  assert 60 < sum(sources) < 140 and sources == [distill._is_on_policy(data, s) for s in range(200)]


def test_build_sequences_mask_marks_positions_predicting_generated_tokens():
  tokens, mask = distill.build_sequences(np.asarray([[5, 6, 7], [8, 0, 0]]), np.asarray([3, 1]),
                                         np.asarray([[1, 2], [3, 4]]), np.asarray([2, 1]))
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 1, 2], [8, 3, 0, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 0], [1, 0, 0, 0, 0]])


def _distill_setup(source="mixed"):
  target, drafter = init_params(TARGET, 0), init_params(DRAFTER, 1)
  prompts, lens = distill.random_prompts(24, 4, TARGET.vocab_size, 0)
  data = distill.make_distill_data(TARGET, target, DRAFTER, prompts, lens, batch_size=4, max_new_tokens=6,
                                   source=source, on_policy_fraction=0.5, heldout_fraction=0.25, seed=0)
  return target, drafter, data


def test_target_samples_are_kept_for_a_resume(tmp_path, monkeypatch):
  """make_distill_data(samples_path=...): the first call samples and writes the file; a second call with the same
  prompts and settings reads the same arrays without sampling; other settings or a damaged file are refused."""
  target = init_params(TARGET, 0)
  prompts, lens = distill.random_prompts(12, 4, TARGET.vocab_size, 0)
  path = tmp_path / "samples.npz"

  def make(**kw):
    settings = dict(batch_size=4, max_new_tokens=5, source="fixed", heldout_fraction=0.25, seed=0,
                    samples_path=path, samples_meta={"target_name": "tiny"})
    return distill.make_distill_data(TARGET, target, DRAFTER, prompts, lens, **{**settings, **kw})

  first = make()
  assert path.exists()
  monkeypatch.setattr(distill, "sample_sequences", lambda *a, **k: pytest.fail("sampled again"))
  again = make(sample_batch_size=5)  # the sampling width is a cost, not a setting of the samples: read, not refused
  np.testing.assert_array_equal(again.fixed_tokens_NxT, first.fixed_tokens_NxT)
  np.testing.assert_array_equal(again.fixed_mask_NxT, first.fixed_mask_NxT)
  np.testing.assert_array_equal(again.train_idx, first.train_idx)
  assert first.fixed_mask_NxT.sum() > 0
  for kw, name in ((dict(max_new_tokens=6), "max_new_tokens"), (dict(seed=1), "seed"),
                   (dict(samples_meta={"target_name": "other"}), "target_name"),
                   (dict(sample_temperature=0.5), "sample_temperature")):
    with pytest.raises(ValueError, match=f"other settings \\(.*{name}"):
      make(**kw)
  path.write_bytes(path.read_bytes()[:100])
  with pytest.raises(ValueError, match="not a readable target samples file"):
    make()


def test_a_run_stopped_while_sampling_keeps_its_finished_rows(tmp_path, monkeypatch):
  """Sampling keeps its finished rows after every batch (samples.partial.npz): a run killed in its third batch
  samples only the rows not yet done when run again, and ends with the arrays of an uninterrupted run (each row has
  its own key); the partial file is gone once samples.npz is written."""
  target = init_params(TARGET, 0)
  prompts, lens = distill.random_prompts(12, 4, TARGET.vocab_size, 0)
  make = functools.partial(distill.make_distill_data, TARGET, target, DRAFTER, prompts, lens, batch_size=4,
                           max_new_tokens=5, source="fixed", heldout_fraction=0.25, seed=0, sample_batch_size=2,
                           samples_meta={"target_name": "tiny"})
  whole = make(samples_path=tmp_path / "whole.npz")
  real_sample, calls = distill.sample_sequences, []

  def killed_in_third_batch(*a, **k):
    calls.append(len(a[2]))
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real_sample(*a, **k)

  monkeypatch.setattr(distill, "sample_sequences", killed_in_third_batch)
  path = tmp_path / "samples.npz"
  with pytest.raises(KeyboardInterrupt):
    make(samples_path=path)
  partial = tmp_path / "samples.partial.npz"
  assert partial.exists() and not path.exists()
  with np.load(partial) as z:
    assert z["done_N"].sum() == 4
  calls.clear()
  monkeypatch.setattr(distill, "sample_sequences", lambda *a, **k: calls.append(len(a[2])) or real_sample(*a, **k))
  resumed = make(samples_path=path)
  assert len(calls) == 4  # the 8 rows left, 2 at a time
  np.testing.assert_array_equal(resumed.fixed_tokens_NxT, whole.fixed_tokens_NxT)
  np.testing.assert_array_equal(resumed.fixed_mask_NxT, whole.fixed_mask_NxT)
  assert path.exists() and not partial.exists()


def test_a_wider_pool_reuses_the_continuations_of_the_prompts_it_shares(tmp_path, monkeypatch):
  """make_distill_data(reuse_samples=<another run's file>): rows whose prompt that file sampled take its continuation
  (wherever the row now sits, ragged prompts included); new prompts, and a second copy of a reused prompt, are
  sampled with keys of their own stream; the grown file is read back on a resume; a file of other sampling settings
  or none at all is refused."""
  target = init_params(TARGET, 0)
  prompts, lens = distill.random_prompts(12, 5, TARGET.vocab_size, 0)
  lens = lens - np.arange(12) % 3
  base = dict(batch_size=4, max_new_tokens=5, source="fixed", seed=0, samples_meta={"target_name": "tiny"})
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  first = distill.make_distill_data(TARGET, target, DRAFTER, prompts, lens, heldout_fraction=0.25,
                                    samples_path=tmp_path / "a" / "samples.npz", **base)
  new_prompts, new_lens = distill.random_prompts(6, 5, TARGET.vocab_size, 7)
  order = np.asarray([11, 3, 0, 7])  # kept prompts moved, new ones between them, prompt 3 twice
  prompts2 = np.concatenate([prompts[order], new_prompts, prompts[[3]]])
  lens2 = np.concatenate([lens[order], new_lens, lens[[3]]])
  split = (np.arange(8), np.arange(8, 11))
  make = functools.partial(distill.make_distill_data, TARGET, target, DRAFTER, prompts2, lens2, split=split,
                           samples_path=tmp_path / "b" / "samples.npz", reuse_samples=tmp_path / "a", **base)
  sampled = set()  # the prompts the target was asked to continue
  real_sample = distill.sample_sequences
  monkeypatch.setattr(distill, "sample_sequences", lambda *a, **k: sampled.update(
      np.asarray(row, np.int32).tobytes() for row in np.asarray(a[2])) or real_sample(*a, **k))
  grown = make()
  asked = lambda i: prompts2[i].astype(np.int32).tobytes() in sampled
  assert all(asked(i) for i in range(4, 11)) and not any(asked(i) for i in (0, 2, 3))  # new ones and the 2nd copy
  for i, j in enumerate(order):  # the kept rows are those of the first file, bit for bit
    np.testing.assert_array_equal(grown.fixed_tokens_NxT[i, :10], first.fixed_tokens_NxT[j, :10])
    np.testing.assert_array_equal(grown.fixed_mask_NxT[i, :10], first.fixed_mask_NxT[j, :10])
    assert grown.fixed_mask_NxT[i].sum() == first.fixed_mask_NxT[j].sum() > 0
  assert (grown.fixed_mask_NxT[4:].sum(axis=1) > 0).all()
  p3 = int(lens[3])
  assert not np.array_equal(grown.fixed_tokens_NxT[10, p3:p3 + 5], grown.fixed_tokens_NxT[1, p3:p3 + 5])
  # the new rows' keys are not the first run's: prompt 0 sampled fresh (no reuse) differs from its reused draw
  fresh = distill.make_distill_data(TARGET, target, DRAFTER, prompts2, lens2, split=split, **base)
  assert not np.array_equal(fresh.fixed_tokens_NxT[4:10], grown.fixed_tokens_NxT[4:10])
  monkeypatch.setattr(distill, "sample_sequences", lambda *a, **k: pytest.fail("sampled again"))
  again = make()  # a resume reads the grown file
  np.testing.assert_array_equal(again.fixed_tokens_NxT, grown.fixed_tokens_NxT)
  with pytest.raises(ValueError, match=r"reuse_samples: .* other settings \(max_new_tokens differ\)"):
    distill.make_distill_data(TARGET, target, DRAFTER, prompts2, lens2, split=split,
                              reuse_samples=tmp_path / "a", **{**base, "max_new_tokens": 6})
  with pytest.raises(ValueError, match="reuse_samples: no target samples file"):
    distill.make_distill_data(TARGET, target, DRAFTER, prompts2, lens2, split=split,
                              reuse_samples=tmp_path / "none", **base)


def test_the_sampling_batch_width_does_not_change_the_samples():
  """Row i is sampled with its own key: 1, 2 or 5 rows at a time (the last batch wrapping around) give the same
  continuations, and the training batch size is not the sampling one."""
  target = init_params(TARGET, 0)
  prompts, lens = distill.random_prompts(12, 4, TARGET.vocab_size, 0)
  lens = lens - np.arange(12) % 3  # ragged prompts
  make = functools.partial(distill.make_distill_data, TARGET, target, DRAFTER, prompts, lens, batch_size=4,
                           max_new_tokens=5, source="fixed", heldout_fraction=0.25, seed=0)
  one = make(sample_batch_size=1)
  assert one.batch_size == 4 and one.fixed_mask_NxT.sum() > 12
  for width in (2, 5, 64):
    other = make(sample_batch_size=width)
    np.testing.assert_array_equal(other.fixed_tokens_NxT, one.fixed_tokens_NxT)
    np.testing.assert_array_equal(other.fixed_mask_NxT, one.fixed_mask_NxT)
  for bad in (0, 2.0, True):
    with pytest.raises(ValueError, match="sample_batch_size must be an integer >= 1"):
      make(sample_batch_size=bad)


@pytest.mark.slow  # a second held-out metric check; the window loss check runs by default
def test_heldout_tv_by_offset_is_the_direct_per_position_computation():
  """heldout_tv_report: at offset i, the mean over held-out rows that generated token i of ½ Σ |p − q| at the
  position predicting it, computed here from whole-sequence logits; its mean is heldout_tv, and the 16-wide bins
  average the offsets they hold."""
  target, drafter, data = _distill_setup("fixed")
  object.__setattr__(data, "fixed_mask_NxT", data.fixed_mask_NxT.copy())
  data.fixed_mask_NxT[data.heldout_idx[0], :] = 0.0
  data.fixed_mask_NxT[data.heldout_idx[0], data.prompt_len_N[data.heldout_idx[0]] - 1] = 1.0  # one generated token
  report = distill.heldout_tv_report(drafter, target, data)
  sum_N, count_N = np.zeros(6), np.zeros(6)
  for row in data.heldout_idx:
    tokens = jnp.asarray(data.fixed_tokens_NxT[row][None])
    tv_T = np.asarray(divergences.total_variation(distill.sequence_logits(TARGET, target, tokens),
                                                  distill.sequence_logits(DRAFTER, drafter, tokens)))[0]
    start = int(data.prompt_len_N[row]) - 1
    for i in range(6):
      if data.fixed_mask_NxT[row, start + i] > 0:
        sum_N[i] += tv_T[start + i]
        count_N[i] += 1
  assert count_N[0] == len(data.heldout_idx) and count_N[-1] == len(data.heldout_idx) - 1
  np.testing.assert_allclose(report.count_N, count_N)
  np.testing.assert_allclose(report.sum_N, sum_N, rtol=1e-5)
  assert report.mean == pytest.approx(sum_N.sum() / count_N.sum(), rel=1e-5)
  assert report.mean == distill.heldout_tv(drafter, target, data)
  assert report.by_offset(4) == pytest.approx({"0-3": sum_N[:4].sum() / count_N[:4].sum(),
                                               "4-5": sum_N[4:].sum() / count_N[4:].sum()}, rel=1e-5)
  assert distill.HeldoutTV(np.zeros(3), np.array([1.0, 0.0, 0.0])).by_offset(2) == {"0-1": 0.0, "2-2": None}
  with pytest.raises(ValueError, match="width must be an integer >= 1"):
    report.by_offset(0)


RESUME_OPTIMIZER = trainer.make_optimizer("adamw", 1e-2, "cosine", 1, 6, 0.01, 1.0)  # one object: one compile


def _fit(workdir, target, drafter, data, num_steps, stop_after=None):
  return trainer.fit(loss_fn=distill.DistillLoss(TARGET, DRAFTER, "jsd", 1.0, 0.5), optimizer=RESUME_OPTIMIZER,
                     trainable=drafter, frozen={"target": target, "drafter": {}},
                     batch_fn=distill.make_batch_fn(data, {}), key=jax.random.key(7), workdir=workdir,
                     loop=trainer.Loop(num_steps=num_steps, checkpoint_every=2, max_to_keep=2, progress=False,
                                       stop_after=stop_after))


def test_resume_reaches_bit_identical_params(tmp_path):
  target, drafter, data = _distill_setup("mixed")
  sources = [distill._is_on_policy(data, s) for s in range(6)]
  assert any(sources) and not all(sources)  # both data paths run
  straight = _fit(tmp_path / "a", target, drafter, data, 6)
  first = _fit(tmp_path / "b", target, drafter, data, 6, stop_after=3)
  assert int(first.state.step) == 3 and first.resumed_from is None
  resumed = _fit(tmp_path / "b", target, drafter, data, 6)
  assert resumed.resumed_from == 3 and int(resumed.state.step) == 6
  for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows_a = trainer.read_metrics(tmp_path / "a" / "metrics.jsonl")
  rows_b = trainer.read_metrics(tmp_path / "b" / "metrics.jsonl")
  assert [r["step"] for r in rows_b] == list(range(1, 7))
  assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
  # nothing recompiles per step: programs are compiled only in the first step of each process's fit
  assert all(r["programs_compiled"] == 0 for r in rows_a[1:]) and rows_a[0]["programs_compiled"] >= 1
  assert [r["step"] for r in rows_b if r["programs_compiled"]] == [1, 4]  # the first step of each of the two fits
  assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "6"]
  before = distill.heldout_tv(drafter, target, data)
  assert 0.0 < before < 1.0


SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from blockspec_jax import parallel
    from blockspec_jax.models import decoder as dec
    from blockspec_jax.train import distill, trainer
    assert len(jax.devices()) == 8, jax.devices()
    T = dec.DecoderConfig.tiny(vocab_size=64, matmul="xla")
    D = dec.DecoderConfig.tiny(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32,
                               matmul="xla")
    target, drafter = dec.init_params(T, 0), dec.init_params(D, 1)
    loss_fn = distill.DistillLoss(T, D, "fkl", 1.0)
    opt = trainer.make_optimizer("adamw", 1e-3, "cosine", 1, 3, 0.01, 1.0)
    rng = np.random.default_rng(0)
    batches = [{"tokens_BxT": jnp.asarray(rng.integers(0, 64, (16, 12)), jnp.int32),
                "mask_BxT": jnp.asarray(rng.random((16, 12)) < 0.7, jnp.float32)} for _ in range(3)]
    frozen = {"target": target, "drafter": {}}
    results = []
    for mesh in (None, parallel.make_mesh(data=8, model=1)):
      step = trainer.make_train_step(loss_fn, opt, mesh)
      state = trainer.init_state(drafter, opt)
      for s in range(3):
        state, m = step(state, frozen, batches[s], jax.random.key(s))
      results.append(jax.device_get(state))
      print("loss", float(m["loss"]))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])))
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(results[0].trainable), jax.tree.leaves(drafter)))
    print("max diff", diff, "moved", moved)
    assert moved > 1e-4 and diff <= 1e-6, (diff, moved)
    # fit() on the mesh (checkpoints of replicated arrays included) reaches the same parameters
    import tempfile
    with tempfile.TemporaryDirectory() as workdir:
      fitted = trainer.fit(loss_fn=loss_fn, optimizer=opt, trainable=drafter, frozen=frozen,
                           batch_fn=lambda s, t: batches[s], key=jax.random.key(0), workdir=workdir,
                           loop=trainer.Loop(num_steps=3, mesh=parallel.make_mesh(data=8, model=1),
                                             checkpoint_every=2, progress=False, plot=False))
    fit_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(jax.device_get(fitted.state))))
    print("fit diff", fit_diff)
    assert fit_diff <= 1e-6, fit_diff
    print("SHARDED EQUAL")
""")


@pytest.mark.slow  # data-parallel train steps across 2 processes x 2 devices run by default (test_multihost)
def test_eight_devices_equal_one_device():
  env = fake_devices_env(8)
  proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                        timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "SHARDED EQUAL" in proc.stdout


# --- the entry point --------------------------------------------------------------------------------------------------

def test_eval_curves_merge_points_measured_outside_the_loop():
  rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4, "eval_heldout_tv": 0.30},
          {"step": 4, "loss": 0.3, "eval_heldout_tv": 0.25, "eval_other": 1.0}]
  curves = trainer.eval_curves(rows, {"eval_heldout_tv": [(0, 0.40), (4, 0.99)], "eval_new": [(3, 2.0)]})
  # step 0 added before the rows' points; at step 4 the rows' value is kept; a metric only in points is drawn too
  assert curves == {"eval_heldout_tv": [(0, 0.40), (2, 0.30), (4, 0.25)], "eval_new": [(3, 2.0)],
                    "eval_other": [(4, 1.0)]}
  assert trainer.eval_curves(rows) == {"eval_heldout_tv": [(2, 0.30), (4, 0.25)], "eval_other": [(4, 1.0)]}
  assert trainer.eval_curves([{"step": 1, "loss": 0.5}]) == {}


def test_smoke_job_end_to_end(tmp_path, capsys):
  workdir = tmp_path / "smoke"
  rc = run_train_main(["--gin_file", os.path.join(REPO, "gin/train/distill_smoke.gin"), "--workdir", str(workdir),
                  "--gin_param", "distill_job.num_steps = 40", "--gin_param", "distill_job.num_prompts = 64",
                  "--gin_param", "distill_job.progress = False", "--gin_param", "make_optimizer.learning_rate = 1e-2"])
  assert rc == 0
  err = capsys.readouterr().err
  assert "compiling distill train step" in err
  summary = json.loads((workdir / "metrics.json").read_text())
  assert summary["steps"] == 40 and summary["final_loss"] > 0 and summary["seconds"] > 0
  assert summary["heldout_tv_after"] < summary["heldout_tv_before"]
  assert list(summary["heldout_tv_after_by_offset"]) == ["0-15"]  # 16 new tokens: one bin, the mean
  assert summary["heldout_tv_after_by_offset"]["0-15"] == pytest.approx(summary["heldout_tv_after"], rel=1e-6)
  assert len(trainer.read_metrics(workdir / "metrics.jsonl")) == 40
  try:
    import matplotlib  # noqa: F401  (pinned in requirements.txt; the plot is skipped without it)
    assert (workdir / "loss.png").read_bytes()[:4] == b"\x89PNG"
  except ImportError:
    pass
  config = (workdir / "config.gin").read_text()
  assert "distill_job.num_steps = 40" in config and "make_optimizer.learning_rate" in config


def test_entry_point_usage_errors(tmp_path, capsys):
  base = ["--gin_file", os.path.join(REPO, "gin/train/distill_smoke.gin"), "--workdir", str(tmp_path)]
  for binding, message in (("distill_job.divergence = 'kl'", "unknown divergence 'kl'"),
                           ("distill_job.temperature = 0.0", "temperature must be > 0"),
                           ("drafter/tiny_decoder.vocab_size = 64", "target vocab_size = 128, drafter vocab_size = 64"),
                           ("distill_job.source = 'replay'", "unknown data source"),
                           ("distill_job.loss_normalization = 'tokens'",
                            "distill_job.loss_normalization = 'tokens' is not one of 'token', 'sequence'"),
                           ("distill_job.target = 'smollm2-135m'", "not a mix")):
    with pytest.raises(SystemExit) as e:
      run_train_main(base + ["--gin_param", binding])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_lora_state_checkpoints_and_resumes(tmp_path):
  """A LoRA ``Lora`` dataclass as the trainable tree goes through orbax and comes back with its static scale."""
  params = {"layers_0": {"attn": {"q": {"weight": jnp.ones((4, 3))}}}}
  lora = params_lib.init_lora(params, 2, jax.random.key(0), targets=("q",), alpha=4.0)
  loss = lambda lo, base, batch, key: (jnp.sum(params_lib.apply_lora(base, lo)["layers_0"]["attn"]["q"]["weight"]
                                               ** 2), {})
  run = lambda workdir, stop=None: trainer.fit(
      loss_fn=loss, optimizer=QUAD_OPTIMIZER, trainable=lora, frozen=params, batch_fn=lambda s, t: {},
      key=jax.random.key(0), workdir=workdir,
      loop=trainer.Loop(num_steps=4, checkpoint_every=1, progress=False, plot=False, stop_after=stop))
  straight = run(tmp_path / "a")
  run(tmp_path / "b", stop=2)
  resumed = run(tmp_path / "b")
  assert resumed.resumed_from == 2 and isinstance(resumed.state.trainable, params_lib.Lora)
  assert resumed.state.trainable.scale == 2.0
  for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- gathered loss window, drafter recipes, prompt split ------------------------------------------------------------

def test_loss_on_the_window_equals_the_loss_on_every_position():
  """Heads run only at the positions that predict generated tokens: the same loss and gradient as the full pass."""
  target, drafter, data = _distill_setup("fixed")
  batch = distill.make_batch_fn(data, {})(0, drafter)
  assert batch["positions_BxN"].shape == (4, 6) and float(batch["mask_BxN"].sum()) == float(batch["mask_BxT"].sum())
  full = {k: v for k, v in batch.items() if k not in ("positions_BxN", "mask_BxN")}
  for name in divergences.DIVERGENCES:
    loss_fn = distill.DistillLoss(TARGET, DRAFTER, name, 1.0, 0.5)
    (a, aux_a), g_a = jax.value_and_grad(loss_fn, has_aux=True)(drafter, {"target": target, "drafter": {}}, batch,
                                                                 None)
    (b, aux_b), g_b = jax.value_and_grad(loss_fn, has_aux=True)(drafter, {"target": target, "drafter": {}}, full,
                                                                 None)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(aux_a["tv"]), float(aux_b["tv"]), rtol=1e-5, atol=1e-7)
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_loss_window_positions_and_mask():
  mask = np.asarray([[0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], np.float32)
  positions, window = distill.loss_window(mask, np.asarray([3, 1]), 4)
  np.testing.assert_array_equal(positions, [[2, 3, 4, 5], [0, 1, 2, 3]])
  np.testing.assert_array_equal(window, [[1, 1, 0, 0], [1, 1, 1, 0]])
  positions, window = distill.loss_window(mask[:1], np.asarray([5]), 4)  # clipped at the end, never double counted
  np.testing.assert_array_equal(positions, [[4, 5, 5, 5]])
  np.testing.assert_array_equal(window, [[0, 0, 0, 0]])


def test_head_logits_equals_the_decoders_head():
  for config, seed in ((TARGET, 0), (dataclasses.replace(TARGET, tie_embeddings=True), 3)):
    params = init_params(config, seed)
    tokens = jnp.asarray([[3, 5, 7, 9]], jnp.int32)
    full = distill.sequence_logits(config, params, tokens)
    picked = distill.sequence_logits(config, params, tokens, jnp.asarray([[1, 3]], jnp.int32))
    np.testing.assert_allclose(np.asarray(picked), np.asarray(full)[:, [1, 3]], rtol=1e-6, atol=1e-6)


def test_select_layers_and_recipe_splits():
  config = dataclasses.replace(TARGET, num_layers=3)
  params = init_params(config, 0)
  small, kept = recipe_lib.select_layers(config, params, (0, 2))
  assert small.num_layers == 2 and set(kept) == {"embed", "layers_0", "layers_1", "final_norm", "lm_head"}
  assert kept["layers_1"] is params["layers_2"] and kept["embed"] is params["embed"]
  with pytest.raises(ValueError, match="indices into the base model's 3 layers"):
    recipe_lib.select_layers(config, params, (0, 3))
  # LoRA: an untrained adapter assembles to the base exactly; a subset recipe trains what it names only.
  lora = recipe_lib.DrafterRecipe("base", lora_rank=2, lora_targets=("q", "down"))
  parts = lora.split(small, kept)
  assert isinstance(parts.trainable, params_lib.Lora)
  for a, b in zip(jax.tree.leaves(parts.assemble(parts.trainable, parts.frozen)), jax.tree.leaves(kept)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  subset = recipe_lib.DrafterRecipe("base", layers=(0, 2), train_layers=(1,), train_modules=("final_norm",))
  parts = subset.split(*subset.derive(config, params))
  assert set(parts.trainable) == {"layers_1", "final_norm"} and "layers_0" in parts.frozen
  for bad, message in ((dict(lora_rank=2, train_layers=(0,)), "trains adapters only"),
                       (dict(layers=(1, 1)), "distinct layer indices"), (dict(lora_rank=-1), "lora_rank"),
                       (dict(lora_rank=2, lora_targets=("qq",)), "unknown LoRA targets")):
    with pytest.raises(ValueError, match=message):
      recipe_lib.DrafterRecipe("base", **bad)
  with pytest.raises(ValueError, match="out of range"):
    recipe_lib.DrafterRecipe("base", train_layers=(5,)).split(small, kept)
  with pytest.raises(ValueError, match="not top-level modules"):
    recipe_lib.DrafterRecipe("base", train_modules=("head",)).split(small, kept)
  assert recipe_lib.DrafterRecipe.from_json(subset.to_json()) == subset


def test_restore_trainable_from_a_training_checkpoint(tmp_path):
  """The drafter's trainable tree comes back from the trainer's checkpoint without the optimizer (LoRA and subset)."""
  params = {"layers_0": {"attn": {"q": {"weight": jnp.ones((4, 3))}}}, "final_norm": {"scale": jnp.ones((3,))}}
  # Keys inserted out of sorted order, with distinct shapes: leaves must come back to their own paths.
  unsorted = {"z_norm": {"scale": jnp.arange(3.0)}, "layers_0": {"q": {"weight": jnp.ones((4, 3))},
                                                                "k": {"weight": jnp.full((2, 3), 2.0)}}}
  for trainable in (params_lib.init_lora(params, 2, jax.random.key(0), targets=("q",)), unsorted):
    workdir = tmp_path / type(trainable).__name__
    loss = lambda t, frozen, batch, key: (sum(jnp.sum(x ** 2) for x in jax.tree.leaves(t)) + 1.0, {})
    out = trainer.fit(loss_fn=loss, optimizer=QUAD_OPTIMIZER, trainable=trainable, frozen={},
                      batch_fn=lambda s, t: {}, key=jax.random.key(0), workdir=workdir,
                      loop=trainer.Loop(num_steps=3, checkpoint_every=1, max_to_keep=2, progress=False, plot=False))
    restored, step = recipe_lib.restore_trainable(workdir, trainable)
    assert step == 3 and type(restored) is type(trainable)
    for a, b in zip(jax.tree.leaves(out.state.trainable), jax.tree.leaves(restored)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"no checkpoint of step 1 .* kept steps: \[2, 3\]"):
      recipe_lib.restore_trainable(workdir, trainable, step=1)
  with pytest.raises(ValueError, match="has shape"):
    recipe_lib.restore_trainable(workdir, {"z_norm": {"scale": jnp.ones(4)}, "layers_0": unsorted["layers_0"]})
  with pytest.raises(ValueError, match="another drafter"):
    recipe_lib.restore_trainable(workdir, {"z_norm": {"scale": jnp.ones(3)}})
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    recipe_lib.restore_trainable(tmp_path / "empty", {"w": jnp.ones(2)})


def test_training_prompts_never_share_an_item_template_or_text_with_held_out_ones():
  held = [dict(id="HumanEval/3", task="code", text="a"), dict(id="gsm_symbolic/7/seed0", task="math", text="b")]
  prompts_lib.check_disjoint([dict(id="HumanEval/4", task="code", text="c"),
                              dict(id="gsm_symbolic/8/seed1000/0", task="math", text="d")], held)
  for row in (dict(id="HumanEval/3", task="code", text="z"), dict(id="gsm_symbolic/7/seed1000/5", task="math",
                                                                   text="z"), dict(id="mtbench/1", task="chat", text="a")):
    with pytest.raises(ValueError, match="overlap the held-out set"):
      prompts_lib.check_disjoint([row], held)
  assert prompts_lib.template_key(dict(id="gsm_symbolic/7/seed1000/5", task="math")) == "gsm_symbolic/7"


def test_a_killed_run_keeps_its_metrics_and_checkpoint_and_resumes_to_the_same_result(tmp_path):
  """SIGKILL mid-run (no clean-up code runs): metrics.jsonl stays readable, the last finished checkpoint restores,
  and re-running the command finishes with the held-out TV of a run that was never interrupted."""
  import signal
  import time

  def command(workdir):
    return [sys.executable, "-m", "blockspec_jax.train", "--gin_file",
            os.path.join(REPO, "gin/train/distill_smoke.gin"), "--workdir", str(workdir),
            "--gin_param", "distill_job.num_steps = 120", "--gin_param", "distill_job.checkpoint_every = 10",
            "--gin_param", "distill_job.progress = False"]

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  killed = tmp_path / "killed"
  proc = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  try:
    while time.time() < deadline:
      steps = [int(p.name) for p in (killed / "checkpoints").glob("*") if p.name.isdigit()]
      if steps and max(steps) >= 30:
        break
      assert proc.poll() is None, "the run ended before it could be killed"
      time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait()
  rows = trainer.read_metrics(killed / "metrics.jsonl")
  assert len(rows) >= 30 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
  assert not (killed / "metrics.json").exists()
  saved = max(int(p.name) for p in (killed / "checkpoints").glob("*") if p.name.isdigit())
  resumed = subprocess.run(command(killed), env=env, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  straight = subprocess.run(command(tmp_path / "straight"), env=env, capture_output=True, text=True, timeout=600)
  assert straight.returncode == 0, straight.stderr[-2000:]
  a = json.loads((killed / "metrics.json").read_text())
  b = json.loads((tmp_path / "straight" / "metrics.json").read_text())
  assert a["resumed_from"] == saved and b["resumed_from"] is None and a["steps"] == b["steps"] == 120
  assert a["heldout_tv_after"] == b["heldout_tv_after"] and a["final_loss"] == b["final_loss"]
  assert [r["step"] for r in trainer.read_metrics(killed / "metrics.jsonl")] == list(range(1, 121))


def test_by_part_gives_each_part_its_own_optimizer():
  """trainer.by_part: each top-level part updated by its own optimizer (SD²'s joint run: the map and the drafter
  at their own learning rates); a tree with other parts is a clear error."""
  opt = trainer.by_part({"steer": optax.sgd(1.0), "drafter": optax.sgd(0.25)})
  params = {"steer": {"w": jnp.ones((2,))}, "drafter": {"lora": {"a": jnp.ones((3,))}}}
  grads = jax.tree.map(lambda x: 2.0 * x, params)
  updates, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_array_equal(np.asarray(updates["steer"]["w"]), [-2.0, -2.0])
  np.testing.assert_array_equal(np.asarray(updates["drafter"]["lora"]["a"]), [-0.5, -0.5, -0.5])
  with pytest.raises(ValueError, match=r"parts \['steer'\] are not the optimizers' \['drafter', 'steer'\]"):
    opt.init({"steer": params["steer"]})
