"""SPRINTER's verifier-head training (blockspec_jax.train.sprinter): labels and features against full forwards, the
BCE head on a separable set, folding the standardisation, the threshold report on a hand table, storage and its
errors, and the gin job end to end (resume without recollecting, disjoint prompts, the real-pair gin files)."""

import functools
import json
import math
import os
import shutil

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling
from blockspec_jax.drafters.sprinter import head_probs, init_head
from blockspec_jax.models import decoder as dec
from blockspec_jax.train import distill, sprinter, trainer
from blockspec_jax.train import __main__ as train_main
from helpers import run_train_main, small_config, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "gin/train/sprinter_smoke.gin")

TARGET = tiny_config(max_len=64)  # V 64, D 32, 2 layers
DRAFTER = small_config(max_len=64)  # V 64, D 16, 1 layer, 2 heads / 1 KV head, F 32


@functools.partial(jax.jit, static_argnames="config")
def _forward(params, tokens_1xT, *, config):
  length = tokens_1xT.shape[1]
  positions_1xT = jnp.arange(length, dtype=jnp.int32)[None]
  logits, _, hidden = dec.Decoder(config).apply({"params": params}, tokens_1xT, positions_1xT,
                                                dec.init_cache(config, 1, length),
                                                dec.causal_mask(positions_1xT, length), return_hidden=True)
  return logits[0], hidden[0]


def _full_forward(config, params, tokens_T, width=16):
  """(logits [T, V], hidden [T, D]) of one sequence: a plain causal forward at batch 1, no window (zero-padded to
  ``width`` tokens, which a causal forward's first T positions do not see: one compilation per model)."""
  tokens_1xW = np.zeros((1, width), np.int32)
  tokens_1xW[0, :len(tokens_T)] = tokens_T
  logits, hidden = _forward(params, jnp.asarray(tokens_1xW), config=config)
  return np.asarray(logits)[:len(tokens_T)], np.asarray(hidden)[:len(tokens_T)]


def test_labels_and_features_equal_full_forwards_of_both_models():
  tp, dp = dec.init_params(TARGET, 0), dec.init_params(DRAFTER, 1)
  rng = np.random.default_rng(3)
  lens_B = np.asarray([6, 3, 5, 1, 4], np.int32)
  tokens_BxP = rng.integers(1, 64, size=(5, 6)).astype(np.int32) * (np.arange(6)[None] < lens_B[:, None])
  rows = np.asarray([10, 20, 30, 40, 50])
  stop_ids, temperature, key = (1, 2, 3, 4, 5, 6), 0.7, jax.random.key(5)
  data = sprinter.collect_labels(TARGET, tp, DRAFTER, dp, tokens_BxP, lens_B, max_new_tokens=7,
                                 temperature=temperature, key=key, batch_size=2, progress=False, rows=rows,
                                 stop_ids=stop_ids)
  assert set(data) == set(sprinter.LABEL_FIELDS)
  n = data["labels_N"].shape[0]
  assert data["features_NxD"].shape == (n, 16) and data["features_NxD"].dtype == np.float32
  assert data["labels_N"].dtype == np.int8
  # on-policy: the continuations are the drafter's samples (row r keyed by fold_in(key, r), whatever the batching)
  ref_BxT, ref_mask_BxT = distill.sample_sequences(DRAFTER, dp, tokens_BxP, lens_B, distill._row_keys(key, rows),
                                                   max_new_tokens=7, temperature=temperature, stop_ids=stop_ids)
  stopped = 0
  for b, r in enumerate(rows):
    sel = data["row_N"] == r
    positions = data["position_N"][sel]
    generated = data["token_N"][sel]
    count = int(sel.sum())
    assert 1 <= count <= 7 and count == int(ref_mask_BxT[b].sum())
    np.testing.assert_array_equal(positions, lens_B[b] + np.arange(count))  # contiguous, from the prompt's end
    np.testing.assert_array_equal(generated, ref_BxT[b, lens_B[b]:lens_B[b] + count])
    if count < 7:  # ended by a stop token, which is labelled; none before it
      assert generated[-1] in stop_ids and not np.isin(generated[:-1], stop_ids).any()
      stopped += 1
    sequence = np.concatenate([tokens_BxP[b, :lens_B[b]], generated])
    t_logits, _ = _full_forward(TARGET, tp, sequence)
    d_logits, d_hidden = _full_forward(DRAFTER, dp, sequence)
    p_TxV = np.asarray(sampling.probs_from_logits(t_logits, temperature=temperature))
    q_TxV = np.asarray(sampling.probs_from_logits(d_logits, temperature=temperature))
    t_N = positions
    q_N, p_N = q_TxV[t_N - 1, generated], p_TxV[t_N - 1, generated]
    np.testing.assert_allclose(data["q_tok_N"][sel], q_N, rtol=1e-5)
    np.testing.assert_allclose(data["p_tok_N"][sel], p_N, rtol=1e-5)
    clear = np.abs(q_N - p_N) > 1e-5 * np.maximum(q_N, p_N)  # a near-tie may flip with the last ulp
    np.testing.assert_array_equal(data["labels_N"][sel][clear], (q_N <= p_N)[clear].astype(np.int8))
    np.testing.assert_array_equal(data["labels_N"][sel], (data["q_tok_N"][sel] <= data["p_tok_N"][sel]))
    # the feature is the drafter's final-norm state at the position that produced the token (t − 1)
    np.testing.assert_allclose(data["features_NxD"][sel], d_hidden[t_N - 1], rtol=1e-5, atol=1e-5)
  assert 0 < stopped < 5  # both kinds of row end occur
  assert 0 < data["labels_N"].sum() < n


def test_official_labels_follow_the_greedy_sd_like_trajectory_of_full_forwards():
  """The paper's code's labels: at each step the drafter's greedy token x with q(x), p(x) at T = 1 and 1[q(x) ≤ p(x)];
  the context goes on with x when the label is 1, else with the target's greedy token; a stop token ends the row.
  Walked here with full forwards of both models (batch 2: the last batch wraps around). The drafter is a perturbed
  copy of the target, so its greedy token passes at some steps and not at others."""
  from helpers import perturbed
  tp = dec.init_params(TARGET, 0)
  dp = perturbed(tp, 1, 0.5)
  lens_B = np.asarray([5, 2, 4], np.int32)
  tokens_BxP = np.random.default_rng(4).integers(1, 64, size=(3, 5)).astype(np.int32) * (
      np.arange(5)[None] < lens_B[:, None])
  rows, steps = np.asarray([7, 8, 9]), 6
  walks = []
  for b in range(3):  # the reference walk; its third token's successor is the stop token, whatever it is
    seq, walk = list(tokens_BxP[b, :lens_B[b]]), []
    for t in range(steps):
      t_logits, _ = _full_forward(TARGET, tp, seq)
      d_logits, d_hidden = _full_forward(TARGET, dp, seq)
      p_V = np.asarray(sampling.probs_from_logits(t_logits[-1], temperature=1.0))
      q_V = np.asarray(sampling.probs_from_logits(d_logits[-1], temperature=1.0))
      x = int(np.argmax(q_V))
      nxt = x if q_V[x] <= p_V[x] else int(np.argmax(p_V))
      walk.append(dict(x=x, q=q_V[x], p=p_V[x], label=int(q_V[x] <= p_V[x]), hidden=d_hidden[-1],
                       position=len(seq), next=nxt))
      seq.append(nxt)
    walks.append(walk)
  stop = walks[0][2]["next"]  # row 0 ends after its third step
  data = sprinter.collect_official_labels(TARGET, tp, TARGET, dp, tokens_BxP, lens_B, max_new_tokens=steps,
                                          batch_size=2, progress=False, rows=rows, stop_ids=(stop,))
  assert set(data) == set(sprinter.LABEL_FIELDS)
  labels = 0
  for b, r in enumerate(rows):
    sel = data["row_N"] == r
    walk = walks[b]
    ends = [i for i, w in enumerate(walk) if w["next"] == stop]
    walk = walk[:ends[0] + 1] if ends else walk
    assert int(sel.sum()) == len(walk), b
    np.testing.assert_array_equal(data["token_N"][sel], [w["x"] for w in walk])
    np.testing.assert_array_equal(data["position_N"][sel], [w["position"] for w in walk])
    np.testing.assert_array_equal(data["labels_N"][sel], [w["label"] for w in walk])
    np.testing.assert_allclose(data["q_tok_N"][sel], [w["q"] for w in walk], rtol=1e-5)
    np.testing.assert_allclose(data["p_tok_N"][sel], [w["p"] for w in walk], rtol=1e-5)
    np.testing.assert_allclose(data["features_NxD"][sel], np.stack([w["hidden"] for w in walk]), rtol=1e-5,
                               atol=1e-5)
    labels += int(data["labels_N"][sel].sum())
  assert int(np.sum(data["row_N"] == 7)) == 3  # the stop token ended row 0
  assert 0 < labels < len(data["labels_N"])  # both branches of the trajectory were taken


def test_batch_indices_are_a_pure_function_of_the_step_and_cover_each_epoch():
  got = np.concatenate([sprinter.batch_indices(10, 4, 7, s) for s in range(5)])
  np.testing.assert_array_equal(np.sort(got[:10]), np.arange(10))
  np.testing.assert_array_equal(np.sort(got[10:20]), np.arange(10))
  np.testing.assert_array_equal(got[:10], np.random.default_rng([7, 0]).permutation(10))
  np.testing.assert_array_equal(sprinter.batch_indices(10, 4, 7, 3), got[12:16])
  assert not np.array_equal(got[:10], got[10:20])


def test_head_separates_a_linearly_separable_set_and_its_loss_decreases(tmp_path):
  rng = np.random.default_rng(0)
  scales_D = np.asarray([1.0, 10.0, 0.1, 100.0, 1.0, 3.0])
  offsets_D = np.asarray([5.0, -3.0, 0.0, 50.0, 0.0, 1.0])
  w_true_D = rng.normal(size=6)

  def make(n):
    z_NxD = rng.normal(size=(n, 6))
    return (z_NxD * scales_D + offsets_D).astype(np.float32), (z_NxD @ w_true_D > 0.2).astype(np.int8)

  train_X, train_y = make(1024)
  held_X, held_y = make(512)
  head, result = sprinter.train_head(train_X, train_y, workdir=tmp_path, batch_size=128, learning_rate=0.05,
                                     seed=0, heldout=(held_X, held_y),
                                     loop=trainer.Loop(num_steps=150, eval_every=50, progress=False))
  assert head["w_D"].shape == (6,) and head["w_D"].dtype == jnp.float32 and head["b"].shape == ()
  rows = trainer.read_metrics(tmp_path / "metrics.jsonl")
  assert len(rows) == 150 and "eval_heldout_loss" in rows[49] and "eval_heldout_accuracy" in rows[-1]
  first, last = np.mean([r["loss"] for r in rows[:10]]), np.mean([r["loss"] for r in rows[-10:]])
  assert last < 0.5 * first
  before = sprinter.evaluate_head(sprinter.fold_standardization(init_head(6), np.zeros(6), np.ones(6)), held_X,
                                  held_y)
  after = sprinter.evaluate_head(head, held_X, held_y)
  assert after["bce"] < 0.5 * before["bce"] and after["accuracy"] > 0.95
  (row,) = sprinter.head_report(head, held_X, held_y, (0.5,))
  assert row["accuracy"] > 0.95 and row["accuracy"] == pytest.approx(after["accuracy"])
  assert (tmp_path / "checkpoints").is_dir()
  with pytest.raises(ValueError, match="labels must be 0 or 1"):
    sprinter.train_head(train_X, train_y * 2, workdir=tmp_path / "bad", loop=trainer.Loop(num_steps=1), batch_size=4)


def test_folding_the_standardisation_keeps_the_head_probabilities():
  rng = np.random.default_rng(1)
  features_NxD = (rng.normal(size=(64, 5)) * [1, 50, 0.01, 3, 7] + [0, 20, 1, -4, 0]).astype(np.float32)
  mean_D, inv_scale_D = sprinter.standardization(features_NxD)
  np.testing.assert_allclose(((features_NxD - mean_D) * inv_scale_D).std(0), 1.0, rtol=1e-4)
  head = {"w_D": jnp.asarray(rng.normal(size=5), jnp.float32), "b": jnp.float32(0.3)}
  folded = sprinter.fold_standardization(head, mean_D, inv_scale_D)
  standardised = jnp.asarray((features_NxD - mean_D) * inv_scale_D)
  np.testing.assert_allclose(np.asarray(head_probs(folded, jnp.asarray(features_NxD))),
                             np.asarray(head_probs(head, standardised)), rtol=1e-5, atol=1e-6)
  batch = {"features_BxD": jnp.asarray(features_NxD), "labels_B": jnp.asarray(rng.integers(0, 2, 64), jnp.float32)}
  frozen = {"mean_D": jnp.asarray(mean_D), "inv_scale_D": jnp.asarray(inv_scale_D)}
  loss_std, _ = sprinter.head_loss(head, frozen, batch, None)
  loss_raw, _ = sprinter.head_loss(folded, {}, batch, None)
  assert float(loss_raw) == pytest.approx(float(loss_std), rel=1e-5)
  # a constant dimension keeps scale 1 (no division by zero)
  _, inv = sprinter.standardization(np.stack([np.full(4, 3.0), np.arange(4.0)], axis=1))
  assert inv[0] == 1.0 and np.isfinite(inv).all()


def test_bce_with_pos_weight_on_hand_values():
  head = init_head(3)  # logit 0 everywhere: each term is log 2
  batch = {"features_BxD": jnp.ones((2, 3)), "labels_B": jnp.asarray([1.0, 0.0])}
  loss, aux = sprinter.head_loss(head, {}, batch, None)
  assert float(loss) == pytest.approx(math.log(2.0), rel=1e-6)
  loss, _ = sprinter.head_loss(head, {"pos_weight": jnp.float32(3.0)}, batch, None)
  assert float(loss) == pytest.approx((3 * math.log(2.0) + math.log(2.0)) / 2, rel=1e-6)
  assert float(aux["accuracy"]) == 0.5 and float(aux["positive_rate"]) == 0.5  # logit 0 accepts: 1 right of 2


def test_head_report_on_a_hand_table():
  probs = np.asarray([0.2, 0.4, 0.6, 0.8, 0.95, 0.35])
  labels = np.asarray([0, 1, 1, 0, 1, 0])
  head = {"w_D": jnp.ones((1,), jnp.float32), "b": jnp.float32(0.0)}
  features = np.log(probs / (1 - probs)).astype(np.float32)[:, None]
  rows = sprinter.head_report(head, features, labels, (0.3, 0.5, 0.9, 1.5))
  assert [tuple(r) for r in rows] == [sprinter.REPORT_FIELDS] * 4
  # t = 0.5 accepts rows 2, 3, 4: right on 0, 2, 4, 5; label-0 rows {0, 3, 5} accepted: 3; label-1 {1, 2, 4} flagged: 1
  expected = [(0.3, 4 / 6, 2 / 3, 0.0, 5 / 6), (0.5, 4 / 6, 1 / 3, 1 / 3, 3 / 6), (0.9, 4 / 6, 0.0, 2 / 3, 1 / 6),
              (1.5, 3 / 6, 0.0, 1.0, 0.0)]
  for row, (t, accuracy, eta_fp, eta_fn, accept_rate) in zip(rows, expected):
    assert row == {"threshold": t, "accuracy": accuracy, "eta_fp": eta_fp, "eta_fn": eta_fn,
                   "accept_rate": accept_rate, "positive_rate": 0.5, "num": 6}
  (all_pos,) = sprinter.head_report(head, features[[1, 2]], labels[[1, 2]], (0.5,))
  assert all_pos["eta_fp"] is None and all_pos["eta_fn"] == 0.5 and all_pos["positive_rate"] == 1.0
  with pytest.raises(ValueError, match="thresholds"):
    sprinter.head_report(head, features, labels, (-0.1,))


def test_save_load_round_trip_and_clear_errors(tmp_path):
  rng = np.random.default_rng(2)
  head = {"w_D": jnp.asarray(rng.normal(size=8), jnp.float32), "b": jnp.float32(-0.75)}
  info = {"drafter": "d", "target": "t", "temperature": 1.0, "report_heldout": [{"threshold": 0.5}]}
  workdir = tmp_path / "run"
  sprinter.save_head(workdir, head, info)
  loaded, got = sprinter.load_head(workdir, d_model=8)
  np.testing.assert_array_equal(np.asarray(loaded["w_D"]), np.asarray(head["w_D"]))
  assert float(loaded["b"]) == -0.75 and loaded["b"].shape == () and loaded["w_D"].dtype == jnp.float32
  assert got["drafter"] == "d" and got["d_model"] == 8 and got["report_heldout"] == [{"threshold": 0.5}]
  assert got["b"] == -0.75 and got["w_norm"] == pytest.approx(float(np.linalg.norm(np.asarray(head["w_D"]))))
  sprinter.load_head(workdir)  # no width check
  with pytest.raises(ValueError, match=r"D = 8.*this drafter has D = 896"):
    sprinter.load_head(workdir, d_model=896)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    sprinter.load_head(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="head.json not found"):
    sprinter.load_head(tmp_path / "empty")
  good_json = (workdir / "head.json").read_text()
  good_npz = (workdir / "head.npz").read_bytes()
  (workdir / "head.npz").write_bytes(good_npz[:-7] + b"garbage")
  with pytest.raises(ValueError, match="SHA-256 does not match"):
    sprinter.load_head(workdir)
  (workdir / "head.npz").write_bytes(b"not a zip file at all")  # corrupted, with the json's hash updated to match
  import hashlib
  record = json.loads(good_json)
  record["head_sha256"] = hashlib.sha256(b"not a zip file at all").hexdigest()
  (workdir / "head.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match="head.npz is corrupted"):
    sprinter.load_head(workdir)
  (workdir / "head.json").write_text(good_json[: len(good_json) // 2])
  with pytest.raises(ValueError, match="head.json is corrupted"):
    sprinter.load_head(workdir)
  (workdir / "head.json").write_text(good_json)
  (workdir / "head.npz").unlink()
  with pytest.raises(FileNotFoundError, match="head.npz not found"):
    sprinter.load_head(workdir)
  with pytest.raises(ValueError, match="NaN or infinite"):
    sprinter.save_head(tmp_path / "nan", {"w_D": jnp.full((3,), jnp.nan), "b": jnp.float32(0)})


def _head(workdir):
  head, _ = sprinter.load_head(workdir)
  return np.asarray(head["w_D"]), float(head["b"])


def test_smoke_job_end_to_end_resumes_without_recollecting_and_keeps_held_out_prompts_out(tmp_path, monkeypatch,
                                                                                           capsys):
  first = tmp_path / "first"
  base = ["--gin_file", SMOKE, "--gin_param", "sprinter_job.progress = False"]
  assert run_train_main(base + ["--workdir", str(first), "--gin_param", "sprinter_job.stop_after = 50"]) == 0
  stopped = json.loads((first / "metrics.json").read_text())
  assert stopped["steps"] == 50 and stopped["resumed_from"] is None and not stopped["labels_cached"]
  assert "sprinter_job.stop_after = 50" in (first / "config.gin").read_text()

  def no_collection(*args, **kwargs):
    raise AssertionError("labels were collected again")

  monkeypatch.setattr(sprinter, "collect_labels", no_collection)
  assert run_train_main(base + ["--workdir", str(first)]) == 0
  summary = json.loads((first / "metrics.json").read_text())
  assert summary["steps"] == 100 and summary["resumed_from"] == 50 and summary["labels_cached"]
  assert "held-out head at threshold 0.5" in capsys.readouterr().out
  report = summary["report_heldout"]
  assert [r["threshold"] for r in report] == [0.3, 0.5, 0.7, 0.9]
  assert all(tuple(r) == sprinter.REPORT_FIELDS for r in report)
  counts = summary["labels"]
  assert counts["train"]["prompts"] == 48 and counts["heldout"]["prompts"] == 16
  assert report[0]["num"] == counts["heldout"]["num"] > 0
  assert summary["peak_rss_gb"] > 0 and summary["seconds"] > 0 and summary["d_model"] == 16
  for name in ("head.json", "head.npz", "labels_train.npz", "labels_heldout.npz", "metrics.jsonl"):
    assert (first / name).is_file()
  _, info = sprinter.load_head(first, d_model=16)
  assert info["report_heldout"] == report and info["temperature"] == 1.0 and "random tiny" in info["drafter"]

  # no held-out prompt reaches the training labels: the split is split_prompts' (64 prompts, 1/4 held out)
  train, _ = sprinter.load_labels(first / "labels_train.npz")
  held, _ = sprinter.load_labels(first / "labels_heldout.npz")
  train_idx, heldout_idx = distill.split_prompts(64, 0.25, 0)
  np.testing.assert_array_equal(np.unique(train["row_N"]), train_idx)
  np.testing.assert_array_equal(np.unique(held["row_N"]), heldout_idx)
  assert np.intersect1d(train["row_N"], heldout_idx).size == 0

  # an uninterrupted run on the same (cached) labels reaches the same head, bit for bit
  second = tmp_path / "second"
  second.mkdir()
  for name in ("labels_train.npz", "labels_heldout.npz"):
    shutil.copy(first / name, second / name)
  assert run_train_main(base + ["--workdir", str(second)]) == 0
  w1, b1 = _head(first)
  w2, b2 = _head(second)
  np.testing.assert_array_equal(w1, w2)
  assert b1 == b2

  # labels cached under other settings are refused, not mixed
  with pytest.raises(SystemExit):
    run_train_main(base + ["--workdir", str(first), "--gin_param", "sprinter_job.temperature = 0.5"])
  assert "collected with other settings (temperature differ)" in capsys.readouterr().err


def test_entry_point_usage_errors(tmp_path, capsys):
  base = ["--gin_file", SMOKE, "--workdir", str(tmp_path)]
  for binding, message in (("distill_job.num_steps = 3", "configure distill_job and sprinter_job"),
                           ("sprinter_job.target = 'smollm2-135m'", "not a mix"),
                           ("sprinter_job.temperature = -1.0", "temperature must be >= 0"),
                           ("sprinter_job.thresholds = (0.5, -1)", "thresholds must be numbers"),
                           ("sprinter_job.batch_size = 0", "sprinter_job.batch_size must be an integer >= 1"),
                           ("sprinter_job.label_set = 'greedy'",
                            "sprinter_job.label_set = 'greedy' is not one of 'sampled', 'official'")):
    with pytest.raises(SystemExit):
      run_train_main(base + ["--gin_param", binding])
    assert message in capsys.readouterr().err


def test_the_smoke_job_trains_on_the_official_labels_and_records_which(tmp_path, capsys):
  """``sprinter_job.label_set = 'official'``: the labels come from the greedy SD-like trajectory (each prompt's
  tokens contiguous from its end, every label 1[q ≤ p]), the head trains on them, and the summary and the cached
  files say which set they are (a rerun with the other set refuses the cache, naming label_set)."""
  base = ["--gin_file", SMOKE, "--workdir", str(tmp_path), "--gin_param", "sprinter_job.progress = False",
          "--gin_param", "sprinter_job.num_steps = 20", "--gin_param", "sprinter_job.label_set = 'official'"]
  assert run_train_main(base) == 0
  summary = json.loads((tmp_path / "metrics.json").read_text())
  assert summary["label_set"] == "official" and summary["steps"] == 20 and summary["labels"]["train"]["num"] > 0
  data, meta = sprinter.load_labels(tmp_path / "labels_train.npz")
  assert meta["label_set"] == "official"
  np.testing.assert_array_equal(data["labels_N"], data["q_tok_N"] <= data["p_tok_N"])
  for r in np.unique(data["row_N"])[:4]:
    positions = data["position_N"][data["row_N"] == r]
    np.testing.assert_array_equal(positions, positions[0] + np.arange(len(positions)))
  capsys.readouterr()
  with pytest.raises(SystemExit):
    run_train_main(base[:-1] + ["sprinter_job.label_set = 'sampled'"])
  assert "label_set differ" in capsys.readouterr().err


def test_real_pair_gin_files_parse_and_their_settings_validate(tmp_path):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([os.path.join(REPO, "gin/train/sprinter_qwen.gin")], [])
    assert train_main.selected_job() is train_main.sprinter_job
    settings = train_main.sprinter_job(tmp_path / "qwen", dry_run=True)  # checks the names; loads no model
    assert settings["target"] == "qwen2.5-coder-1.5b" and settings["drafter"] == "qwen2.5-coder-0.5b"
    assert settings["temperature"] == 1.0 and settings["dtype"] == "float32" and settings["max_new_tokens"] == 64
    assert settings["collect_batch_size"] == 4 and settings["num_steps"] == 400 and settings["batch_size"] == 256
    assert settings["train_prompts_per_task"] == 48 and settings["thresholds"] == [0.3, 0.5, 0.7, 0.9]
    assert not (tmp_path / "qwen").exists()
    gin.clear_config()
    gin.parse_config_files_and_bindings([os.path.join(REPO, "gin/train/sprinter_smollm2.gin")], [])
    assert gin.query_parameter("sprinter_job.drafter") == "results/train/distill_smollm2_fast"
    if os.path.isdir(os.path.join(REPO, "results/train/distill_smollm2_fast")):
      cwd = os.getcwd()
      os.chdir(REPO)
      try:
        assert train_main.sprinter_job(tmp_path / "smol", dry_run=True)["target"] == "smollm2-135m"
      finally:
        os.chdir(cwd)
  finally:
    gin.clear_config()
