"""The lossy bench: its rows, the exact tabular TVs (0 for lossless rules, computed), the teacher-forced log-likelihood
against a direct computation, and one small run end to end on SmolLM2 (drafter = target) with a saved head."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import methods
from blockspec_jax.eval import bench_lossy
from blockspec_jax.models import decoder as dec
from blockspec_jax.train import sprinter as sprinter_train
from helpers import tiny_config


def test_method_specs_name_every_row():
  specs = bench_lossy.method_specs((0.3, 0.5, 0.7), (0.3, 0.5), cap=20)
  assert [s["label"] for s in specs] == ["autoregressive", "token", "block", "sprinter θ=0.3", "sprinter θ=0.5",
                                         "sprinter θ=0.7", "mtad τ=0.3", "mtad τ=0.5"]
  both = bench_lossy.method_specs((0.5,), (0.3,), cap=20, sprinter_bonus=(True, False))
  assert [s["label"] for s in both if s["method"] == "sprinter"] == ["sprinter θ=0.5", "sprinter θ=0.5 no bonus"]
  assert [s["verifier_settings"]["sprinter"]["bonus"] for s in both if s["method"] == "sprinter"] == [True, False]
  for s in specs + both:
    methods.parse_method(s["method"])
    methods.check_verifier_settings(s["verifier_settings"])


def test_tabular_fidelity_is_exact_zero_for_lossless_rows_and_positive_for_lossy_ones():
  specs = bench_lossy.method_specs((0.0, 0.5, 2.0), (0.5, float("inf")), cap=3)
  tv = bench_lossy.tabular_fidelity(specs, gamma=3, width=2, n=3)
  for label in ("autoregressive", "token", "block", "sprinter θ=2", "mtad τ=inf"):
    assert tv[label] == pytest.approx(0.0, abs=1e-12), label  # lossless settings: computed, not assumed
  for label in ("sprinter θ=0", "mtad τ=0.5"):
    assert tv[label] > 1e-3, label
  # Without the bonus token the law of 4 tokens differs (cap 3: the bonus, when the flagged third token passes, is
  # the fourth); flagging every token stays exact either way.
  both = bench_lossy.tabular_fidelity(bench_lossy.method_specs((0.0, 2.0), (0.5,), cap=3, sprinter_bonus=(True, False)),
                                      gamma=3, width=2, n=4)
  assert both["sprinter θ=2"] == pytest.approx(0.0, abs=1e-12)
  assert both["sprinter θ=2 no bonus"] == pytest.approx(0.0, abs=1e-12)
  assert both["sprinter θ=0 no bonus"] > 1e-3 and abs(both["sprinter θ=0 no bonus"] - both["sprinter θ=0"]) > 1e-4
  # (Not monotone in θ: sequence-level TV is not a sum of per-step errors, which may partly cancel.)


def test_target_loglik_matches_a_direct_forward():
  config = tiny_config(vocab_size=32)
  params = dec.init_params(config, 0)

  @dataclasses.dataclass
  class Model:
    config: dec.DecoderConfig
    params: dict

  prompts = [[1, 2, 3], [4, 5], [6]]
  outputs = [[7, 8], [9, 10, 11], [12]]
  total, count, per_seq = bench_lossy.target_loglik(Model(config, {"params": params}), prompts, outputs, batch_size=2)
  expected = []
  for p, o in zip(prompts, outputs):
    seq = jnp.asarray([p + o], jnp.int32)
    positions = jnp.arange(seq.shape[1])[None]
    logits, _ = dec.Decoder(config).apply({"params": params}, seq, positions, dec.init_cache(config, 1, seq.shape[1]),
                                          dec.causal_mask(positions, seq.shape[1]))
    logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)), np.float64)
    expected.append(sum(logp[len(p) - 1 + j, t] for j, t in enumerate(o)))
  assert count == 6
  assert total == pytest.approx(sum(expected), rel=1e-5)
  np.testing.assert_allclose(per_seq, [e / len(o) for e, o in zip(expected, outputs)], rtol=1e-5)


@pytest.mark.heavy  # the longest SmolLM2 run of the default suite (~4-5 min); by default the fast tests cover the bench's grid and test_run the lossy rules on SmolLM2
def test_bench_on_smollm2_end_to_end(tmp_path, capsys):
  """SmolLM2 as drafter and target, a zero head (every context gets sigmoid(b)): one threshold below and one above
  it, one τ, 2 prompts × 8 tokens; the table, the JSON and the plot are written, and the rows behave as they must
  (drafter = target: token/block accept everything; a head that accepts everything calls the target once per cap)."""
  head_dir = tmp_path / "head"
  sprinter_train.save_head(head_dir, {"w_D": np.zeros(576, np.float32), "b": np.float32(0.0)},
                           {"drafter": "smollm2-135m"})  # sigmoid(0) = 0.5
  out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
  report = bench_lossy.bench_lossy_job(target="smollm2-135m", drafter="smollm2-135m", sprinter_head=str(head_dir),
                                       num_prompts=2, gamma=3, max_new_tokens=8, thresholds=(0.4, 0.6), cap=4,
                                       taus=(0.5,), beam_width=2, output_json=str(out), plot=str(plot),
                                       tabular_n=2)
  printed = capsys.readouterr().out
  assert "sprinter θ=0.4 lossy" in printed and "mtad τ=0.5 lossy" in printed and "HumanEval" in printed
  saved = json.loads(out.read_text())
  assert saved["results"] == json.loads(json.dumps(report["results"]))
  rows = {r["label"]: r for r in saved["results"]}
  assert set(rows) == {"autoregressive", "token", "block", "sprinter θ=0.4", "sprinter θ=0.6", "mtad τ=0.5"}
  assert plot.stat().st_size > 0
  assert rows["autoregressive"]["target_calls_per_token"] == pytest.approx(1.0)
  assert rows["block"]["block_efficiency"] > 3.0  # drafter = target at T = 1: (almost) every token accepted
  # θ = 0.4 < 0.5: the head accepts every context, so the target is called once per cap (4) tokens.
  assert rows["sprinter θ=0.4"]["target_calls_per_token"] == pytest.approx(0.25)
  assert rows["sprinter θ=0.4"]["num_cap_flags"] == rows["sprinter θ=0.4"]["target_calls"]
  # θ = 0.6 > 0.5: the head flags every token: speculative sampling with γ = 1 (lossless); drafter = target accepts
  # every flagged token, which brings the bonus token: two tokens per call.
  assert rows["sprinter θ=0.6"]["target_calls_per_token"] == pytest.approx(0.5)
  assert rows["sprinter θ=0.6"]["num_head_flags"] == rows["sprinter θ=0.6"]["target_calls"]
  assert rows["sprinter θ=0.6"]["num_head_accepted"] == 0
  assert rows["sprinter θ=0.4"]["lossy"] and rows["mtad τ=0.5"]["lossy"] and not rows["block"]["lossy"]
  # block reuses token's prefills, SPRINTER at θ = 0.6 those at θ = 0.4 (the threshold is the rule's, not the drafter's)
  assert {k: r["prefills_reused"] for k, r in rows.items()} == {
      "autoregressive": 0, "token": 0, "block": 2, "sprinter θ=0.4": 0, "sprinter θ=0.6": 2, "mtad τ=0.5": 0}
  for r in rows.values():
    assert r["humaneval_num"] == 1 and r["humaneval_passed"] in (0, 1)  # prompt 0 is HumanEval/0
    assert np.isfinite(r["mean_logp"]) and r["perplexity"] >= 1.0


def test_a_bench_without_sprinter_or_without_mtad_rows():
  """``thresholds = ()`` leaves SPRINTER out (no head needed), ``taus = ()`` MTAD; one lossy row is needed."""
  from blockspec_jax.checks import UsageError
  for fields, lossy in (({"thresholds": (), "sprinter_head": None}, ["mtad τ=0.3", "mtad τ=0.5"]),
                        ({"taus": ()}, ["sprinter θ=0.3", "sprinter θ=0.5", "sprinter θ=0.7"])):
    grid = bench_lossy.LossySettings(**fields).groups()[1]
    assert [s["label"] for s in grid.specs()] == ["autoregressive", "token", "block", *lossy]
  with pytest.raises(UsageError, match="needs a lossy row"):
    bench_lossy.LossySettings(thresholds=(), taus=())


def test_several_sprinter_heads_side_by_side(monkeypatch):
  """A tuple of heads gives one set of SPRINTER rows per head, labelled with the head's directory name, and each row
  decodes with its own head (the other rows with the first); heads must have distinct names."""
  from blockspec_jax.checks import UsageError
  heads = ("runs/sprinter_sampled", "runs/sprinter_official")
  grid = bench_lossy.LossySettings(sprinter_head=list(heads), thresholds=(0.3, 0.7), taus=(),
                                   sprinter_bonus=(True, False)).groups()[1]
  specs = grid.specs()
  assert [s["label"] for s in specs if s["method"] == "sprinter"] == [
      f"sprinter θ={t}{b} [{h}]" for h in ("sprinter_sampled", "sprinter_official") for b in ("", " no bonus")
      for t in ("0.3", "0.7")]
  assert [s["head"] for s in specs if s["method"] == "sprinter"] == [heads[0]] * 4 + [heads[1]] * 4
  one = bench_lossy.LossySettings(sprinter_head=heads[0]).groups()[1]
  assert [s["label"] for s in one.specs() if s["method"] == "sprinter"] == ["sprinter θ=0.3", "sprinter θ=0.5",
                                                                             "sprinter θ=0.7"]
  seen = []

  def run_method(method, *args, drafter_settings, verifier_settings, **kwargs):
    seen.append((method, drafter_settings["sprinter"]["head"]))
    return {"tokens_per_s": 1.0, "target_calls_per_token": 1.0}, [[1]]

  monkeypatch.setattr(bench_lossy.harness, "run_method", run_method)
  monkeypatch.setattr(bench_lossy, "target_loglik", lambda *a, **k: (-1.0, 1, [-1.0]))
  Tok = type("Tok", (), {"decode": lambda self, ids, skip_special_tokens: "x"})
  target = type("Target", (), {"stop_ids": (), "tokenizer": Tok()})()
  data = bench_lossy.LossySettings().data_settings("unused", num_prompts=1)
  sampler = bench_lossy.LossySettings().sampler_settings((1.0,))
  rows = bench_lossy._bench_rows(grid, sampler, data, (target, None), [], [[1]], 1,
                                 {s["label"]: 0.0 for s in specs}, None, None)
  assert seen == [("autoregressive", heads[0]), ("token", heads[0]), ("block", heads[0])] + [
      ("sprinter", h) for h in heads for _ in range(4)]
  assert [r.get("sprinter_head") for r in rows[3:]] == [heads[0]] * 4 + [heads[1]] * 4
  for bad in (("a/head", "b/head"), (None,), ()):
    with pytest.raises(UsageError, match="sprinter_head"):
      bench_lossy.LossySettings(sprinter_head=bad).groups()


def test_the_lossless_rows_are_a_setting():
  from blockspec_jax.checks import UsageError
  grid = bench_lossy.LossySettings(lossless=("block",), taus=()).groups()[1]
  assert [s["label"] for s in grid.specs()][:3] == ["autoregressive", "block", "sprinter θ=0.3"]
  assert [s["label"] for s in bench_lossy.LossySettings(lossless=()).groups()[1].specs()][:2] == [
      "autoregressive", "sprinter θ=0.3"]
  for bad in (("sprinter",), ("mtad",), ("nope",), ("block", "block")):
    with pytest.raises(UsageError, match="bench_lossy.lossless"):
      bench_lossy.LossySettings(lossless=bad)


def test_same_draft_table_compares_rules_on_one_draft_law():
  """Token, block and MTAD on the same sampled chains, exactly: the lossless rules have TV 0 and block accepts at
  least as much as token; MTAD's acceptance falls as τ grows (a = max{i : L_i > log τ} shrinks draft by draft) and
  τ = inf accepts nothing, exactly (TV 0)."""
  rows = {r["rule"]: r for r in bench_lossy.same_draft_table((0.1, 0.5, 2.0, float("inf")), gamma=3, n=2)}
  assert rows["token"]["tv"] < 1e-12 and rows["block"]["tv"] < 1e-12
  assert rows["block"]["expected_accepted"] >= rows["token"]["expected_accepted"] - 1e-12
  mtad = [rows[f"mtad τ={t:g}"]["expected_accepted"] for t in (0.1, 0.5, 2.0, float("inf"))]
  assert all(a >= b - 1e-12 for a, b in zip(mtad, mtad[1:])) and mtad[-1] == 0.0
  assert rows["mtad τ=inf"]["tv"] < 1e-12 and rows["mtad τ=0.5"]["tv"] > 1e-3
