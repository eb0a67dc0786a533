"""DistillSpec on a real model (SmolLM2-135M, every CI run): the fast-pair job end to end on a few steps, the trained
drafter loaded back (newest checkpoint and ``@init``), lossless in the decoding loop, and beside its base in the main
job; eval.paired's drafter comparison arithmetic."""

import json
import os

import gin
import jax
import numpy as np
import pytest

from blockspec_jax import run
from blockspec_jax import checks
from blockspec_jax import methods as methods_lib
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval import paired_drafters
from blockspec_jax.models import hub
from blockspec_jax.train import __main__ as train_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(rows):
  return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def fast_pair(tmp_path_factory):
  """The fast-pair job (gin/train/distill_smollm2_fast.gin) for 3 steps on 3 held-out and 6 training prompts."""
  workdir = tmp_path_factory.mktemp("fast_pair")
  held = prompts_lib.load_prompts(limit=3)
  held_file = workdir / "held.jsonl"
  held_file.write_text(_rows(held))
  train = [dict(id=f"train/{i}", task=("code", "chat", "math")[i % 3], source="test", licence="MIT",
                text=f"Write {i + 2} short sentences about the number {i * 7 + 3}.") for i in range(6)]
  # The job reads its prompt pool from the workdir when both files are there (as on a resume): no download here.
  (workdir / "prompts_heldout.jsonl").write_text(_rows(held))
  (workdir / "prompts_train.jsonl").write_text(_rows(train))
  gin.clear_config()
  try:
    rc = train_main.main(["--gin_file", os.path.join(REPO, "gin/train/distill_smollm2_fast.gin"),
                          "--workdir", str(workdir),
                          "--gin_param", f"distill_job.heldout_prompts = '{held_file}'",
                          "--gin_param", "distill_job.num_steps = 3", "--gin_param", "distill_job.batch_size = 2",
                          "--gin_param", "distill_job.max_new_tokens = 8",
                          "--gin_param", "distill_job.checkpoint_every = 2",
                          "--gin_param", "distill_job.progress = False",
                          "--gin_param", "make_optimizer.warmup_steps = 1",
                          "--gin_param", "make_optimizer.learning_rate = 1e-3"])
  finally:
    gin.clear_config()
  assert rc == 0
  return workdir, json.loads((workdir / "metrics.json").read_text())


@pytest.mark.slow  # SmolLM2 distillation end to end; the default run trains, resumes and loads back tiny pairs (test_train, test_multihost)
def test_fast_pair_job_and_its_drafter_loaded_back(fast_pair):
  workdir, summary = fast_pair
  assert summary["steps"] == 3 and summary["num_train_prompts"] == 6 and summary["num_heldout_prompts"] == 3
  for key in ("heldout_tv_before", "heldout_tv_after", "final_loss", "peak_rss_gb"):
    assert summary[key] > 0
  assert summary["drafter_recipe"]["layers"] == [0, 1, 2, 29]
  assert json.loads((workdir / "drafter.json").read_text())["base"] == "smollm2-135m"
  base = hub.load_model("smollm2-135m", progress=False)
  init = sources.load_model(f"{workdir}@init", progress=False)
  trained = sources.load_model(str(workdir), progress=False)
  assert init.config.num_layers == trained.config.num_layers == 4 and init.tokenizer is not None
  bp, ip, tp = base.params["params"], init.params["params"], trained.params["params"]
  for j, i in enumerate((0, 1, 2, 29)):  # the untrained drafter is the base's layers, bit for bit
    for a, b in zip(jax.tree.leaves(ip[f"layers_{j}"]), jax.tree.leaves(bp[f"layers_{i}"])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(tp["embed"]["embedding"]), np.asarray(bp["embed"]["embedding"]))  # frozen
  moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
           for a, b in zip(jax.tree.leaves(tp["layers_3"]), jax.tree.leaves(ip["layers_3"]))]
  assert max(moved) > 0  # three adamw steps moved the trained layers
  assert trained.spec.name.endswith("@3") and init.spec.name.endswith("@init")
  methods_lib.check_model_name(f"{workdir}@2")
  with pytest.raises(ValueError, match=r"no checkpoint of step 1 .*kept steps: \[2, 3\]"):
    sources.load_model(f"{workdir}@1", progress=False)
  with pytest.raises(checks.UsageError, match="checkpoint step or 'init'"):
    methods_lib.check_model_name(f"{workdir}@latest")


def _train(workdir, *params):
  gin.clear_config()
  try:
    return train_main.main(["--gin_file", os.path.join(REPO, "gin/train/distill_smollm2_fast.gin"),
                            "--workdir", str(workdir), "--gin_param", "distill_job.progress = False",
                            "--gin_param", "distill_job.max_new_tokens = 8",
                            "--gin_param", "distill_job.batch_size = 2", *params])
  finally:
    gin.clear_config()


@pytest.mark.slow  # SmolLM2 distillation end to end; the default run trains, resumes and loads back tiny pairs (test_train, test_multihost)
def test_a_run_started_from_another_runs_checkpoint(fast_pair, tmp_path, capsys):
  """distill_job.init_from: the new run starts from the earlier run's trained parameters (its @init is them), trains
  on with a fresh optimizer (here 2 steps accumulated into one update); a bad init_from fails before any model
  loads."""
  source, summary = fast_pair
  workdir = tmp_path / "warm"
  workdir.mkdir()
  for name in ("prompts_heldout.jsonl", "prompts_train.jsonl", "held.jsonl"):
    (workdir / name).write_text((source / name).read_text())
  rc = _train(workdir, "--gin_param", f"distill_job.heldout_prompts = '{workdir / 'held.jsonl'}'",
              "--gin_param", f"distill_job.init_from = '{source}'", "--gin_param", "distill_job.num_steps = 2",
              "--gin_param", "make_optimizer.accumulate = 2", "--gin_param", "make_optimizer.warmup_steps = 0",
              "--gin_param", "make_optimizer.learning_rate = 1e-3")
  assert rc == 0
  warm = json.loads((workdir / "metrics.json").read_text())
  assert warm["init_from"].endswith("@3") and warm["steps"] == 2
  assert warm["heldout_tv_before"] == pytest.approx(summary["heldout_tv_after"], abs=1e-6)
  source_trained = sources.load_model(str(source), progress=False).params["params"]
  init = sources.load_model(f"{workdir}@init", progress=False).params["params"]
  trained = sources.load_model(str(workdir), progress=False).params["params"]
  for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(source_trained)):  # @init = where it started
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  moved = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
           for a, b in zip(jax.tree.leaves(trained["layers_3"]), jax.tree.leaves(init["layers_3"]))]
  assert max(moved) > 0
  capsys.readouterr()
  for name, extra, message in (("bad", (f"distill_job.init_from = '{tmp_path}'",),
                                "is not the work directory of a drafter training run"),
                               ("other", (f"distill_job.init_from = '{source}'", "drafter_recipe.layers = (0, 1, 29)"),
                                "was trained with another drafter recipe")):
    with pytest.raises(SystemExit) as e:
      _train(tmp_path / name, *[a for x in extra for a in ("--gin_param", x)])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert message in out.err and "loaded" not in out.out  # refused before any model loads


@pytest.mark.slow  # SmolLM2 distillation end to end; the default run trains, resumes and loads back tiny pairs (test_train, test_multihost)
def test_main_job_runs_a_trained_drafter_beside_its_base_losslessly(fast_pair, capsys):
  workdir, _ = fast_pair
  report = run.run_job(target="smollm2-135m", drafter=("smollm2-135m", str(workdir)), num_prompts=1, gamma=3,
                       temperatures=(0.0,), methods=("autoregressive", "greedy"), max_new_tokens=8,
                       output_json=None, show_text=True)
  printed = capsys.readouterr().out
  label = os.path.basename(str(workdir))
  assert f"greedy T=0: [{label}] vs [smollm2-135m]: tok/s" in printed
  rows = report["results"]
  assert [r.get("drafter") for r in rows] == [None, "smollm2-135m", label]
  assert rows[1]["block_efficiency"] == pytest.approx(4.0)  # the target drafting for itself
  assert [r["compiles_while_timed"] for r in rows] == [0, 0, 0]  # each drafter compiles before its timed prompts
  texts = set(report["sample_text"].values())
  assert len(texts) == 1  # greedy speculative decoding with either drafter = the target's own greedy text


@pytest.mark.slow  # SmolLM2 distillation end to end; the default run trains, resumes and loads back tiny pairs (test_train, test_multihost)
def test_paired_drafters_resume_and_take_appended_drafters(fast_pair, tmp_path, capsys):
  """eval.paired --drafters on SmolLM2: a finished comparison takes another drafter appended (only its tables are
  measured, on the same contexts), records each context's offset, reports by category and by offset, and refuses a
  file measured with other settings or other first drafters."""
  from blockspec_jax.eval import paired
  workdir, _ = fast_pair
  out = tmp_path / "p.json"
  common = ["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--num-prompts", "2", "--sample-tokens", "4",
            "--positions", "2", "--draws", "2", "--gamma", "2", "--temperatures", "1", "--json", str(out)]
  assert paired.main([*common, "--drafters", f"{workdir}@init"]) == 0
  first = json.loads(out.read_text())["results"]
  assert len(first) == 1 and first[0]["offsets"] == [0, 2, 0, 2] and len(first[0]["tasks"]) == 4
  capsys.readouterr()
  assert paired.main([*common, "--buckets", "2", "--drafters", f"{workdir}@init,{workdir}"]) == 0
  printed = capsys.readouterr().out
  assert "resuming from" in printed and "1 (temperature, drafter) tables already measured" in printed
  results = json.loads(out.read_text())["results"]
  assert results[0] == first[0] and len(results) == 2 and results[1]["offsets"] == first[0]["offsets"]
  report = out.with_suffix(".md").read_text()
  assert "by category" in report and "by tokens past the prompt" in report and "| +0–1 | +2–3 |" in report
  assert "| at the prompt | 2 |" in report and "| past the prompt | 2 |" in report  # Δ paired within each part
  for extra, message in ((["--seed", "1", "--drafters", f"{workdir}@init,{workdir}"], "other settings (--seed)"),
                         (["--drafters", f"{workdir},{workdir}@init"], "give them first")):
    with pytest.raises(SystemExit) as e:
      paired.main([*common, *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_paired_drafters_summary_arithmetic():
  # 2 draws × 3 contexts × 2 rules × 2 γ; the second drafter accepts 0.5 more at every context, rule and γ.
  ref = np.asarray([[[[0.5, 1.0], [0.6, 1.2]], [[0.3, 0.4], [0.3, 0.5]], [[0.8, 1.5], [0.9, 1.7]]]] * 2)
  better = ref + 0.5
  better[1] += 0.2  # one draw differs: draws are averaged per context first
  rows = paired_drafters.summarize_drafters({"base": ref, "tuned": better}, ["code", "chat", "code"],
                                            ("token", "block"))
  by = {(r["drafter"], r["rule"], r["gamma"]): r for r in rows}
  r = by[("tuned", "block", 2)]
  assert r["be"] == pytest.approx(1 + (1.2 + 0.5 + 1.7) / 3 + 0.6)
  assert r["diff"] == pytest.approx(0.6) and r["diff_se"] == pytest.approx(0.0, abs=1e-12)
  assert r["by_task"]["code"] == pytest.approx(1 + (1.2 + 1.7) / 2 + 0.6)
  assert by[("base", "token", 1)]["diff"] == 0.0 and by[("base", "token", 1)]["gain"] == 0.0
  assert r["be_se"] == pytest.approx(np.std([1.2, 0.5, 1.7], ddof=1) / np.sqrt(3))
  ref_accepted = (1.2 + 0.5 + 1.7) / 3  # E[τ] of the reference, block rule, γ = 2 (draws averaged first)
  assert r["accepted_gain"] == pytest.approx(0.6 / ref_accepted)
  assert r["gain"] == pytest.approx(0.6 / (1 + ref_accepted))
  text = paired_drafters.format_drafters(rows, 1.0)
  assert "| tuned | block | 2 |" in text and "Δ vs base" in text and f"{100 * 0.6 / ref_accepted:+.1f}% |" in text
  # Offsets past the prompt as the groups: sorted by number, not as strings ("+8" before "+16").
  by_offset = paired_drafters.summarize_drafters({"base": ref, "tuned": better}, ["+16", "+8", "+0"],
                                                 ("token", "block"))
  assert list(by_offset[0]["by_task"]) == ["+0", "+8", "+16"]
  assert by_offset[-1]["by_task"]["+8"] == pytest.approx(1 + 0.5 + 0.6)
  text = paired_drafters.format_drafters(by_offset, 1.0, groups="tokens past the prompt")
  assert "by tokens past the prompt" in text and "| +0 | +8 | +16 |" in text
  # Offsets of short samples fall into the bins where they are, not where a full sample would put them.
  assert paired_drafters.offset_bins([0, 16, 32, 48, 0, 3, 6, 9, 33], 16) == [
      "+0–15", "+16–31", "+32–47", "+48–63", "+0–15", "+0–15", "+0–15", "+0–15", "+32–47"]
  assert paired_drafters.offset_bins([0, 2], 1) == ["+0", "+2"]
  assert paired_drafters._group_key("+16–31") < paired_drafters._group_key("+32–47") < paired_drafters._group_key("chat")
  with pytest.raises(ValueError, match="width"):
    paired_drafters.offset_bins([0], 0)
  with pytest.raises(ValueError, match="share the contexts"):
    paired_drafters.summarize_drafters({"a": ref, "b": ref[:, :2]}, ["code"] * 3, ("token", "block"))
  # Within groups: the difference is paired inside each group (here the tuned drafter gains only past the prompt).
  tuned = ref.copy()
  tuned[:, 1:] += 0.5
  assert paired_drafters.prompt_split([0, 16, 32]) == ["at the prompt", "past the prompt", "past the prompt"]
  within = paired_drafters.summarize_within({"base": ref, "tuned": tuned}, paired_drafters.prompt_split([0, 16, 32]),
                                            ("token", "block"), gammas={2})
  assert [(r["group"], r["drafter"], r["rule"]) for r in within][:2] == [("at the prompt", "base", "token"),
                                                                         ("at the prompt", "base", "block")]
  got = {(r["group"], r["drafter"], r["rule"]): r for r in within}
  assert got[("at the prompt", "tuned", "block")]["diff"] == 0.0 and got[("at the prompt", "tuned", "block")][
      "contexts"] == 1
  past = got[("past the prompt", "tuned", "block")]
  assert past["contexts"] == 2 and past["diff"] == pytest.approx(0.5) and past["diff_se"] == pytest.approx(0.0)
  assert past["accepted_gain"] == pytest.approx(0.5 / ((0.5 + 1.7) / 2))
  text = paired_drafters.format_within(within, 1.0)
  assert "| past the prompt | 2 | tuned | block | 2 |" in text and "paired within the group" in text
  with pytest.raises(ValueError, match="2 group labels for tables of \\[3\\] contexts"):
    paired_drafters.summarize_within({"base": ref}, ["a", "b"], ("token", "block"))
  # A reference that accepts next to nothing (an untrained drafter: E[τ] ~ 1e-8) has no accepted-gain ratio (it
  # would read +5,000,000%), and none at all (0 / 0) prints n/a, not nan; Δ and the BE gain still compare.
  tuned_be = by[("tuned", "block", 2)]["be"]
  for nothing in (1e-8, 0.0):
    rows = paired_drafters.summarize_drafters({"init": np.full_like(ref, nothing), "tuned": better},
                                              ["code", "chat", "code"], ("token", "block"))
    tuned_row = next(r for r in rows if r["drafter"] == "tuned" and r["rule"] == "block" and r["gamma"] == 2)
    assert np.isnan(tuned_row["accepted_gain"]) and tuned_row["diff"] == pytest.approx(tuned_be - 1.0 - nothing)
    assert tuned_row["gain"] == pytest.approx(tuned_be / (1.0 + nothing) - 1.0)
    for text in (paired_drafters.format_drafters(rows, 1.0),
                 paired_drafters.format_within([dict(row, group="all") for row in rows], 1.0)):
      assert text.count("| n/a |") == len(rows) and "nan" not in text and "%" in text
  above = 2 * paired_drafters.MIN_REFERENCE_ACCEPTED
  rows = paired_drafters.summarize_drafters({"init": np.full_like(ref, above), "tuned": better},
                                            ["code", "chat", "code"], ("token", "block"))
  assert rows[-1]["accepted_gain"] == pytest.approx((rows[-1]["be"] - 1.0) / above - 1.0)  # above it, reported


def test_verifier_settings_are_checked_and_reach_the_rule():
  methods_lib.check_verifier_settings({"lenient": {"epsilon": 0.5, "f": "pow"}})
  for bad, message in (({"lenien": {}}, "unknown verifier 'lenien'"), ({"lenient": {"epsilon": 0.0}}, "epsilon"),
                       ({"lenient": 0.5}, "must be a dict"), ({"block": {"epsilon": 0.5}}, "block")):
    with pytest.raises(checks.UsageError, match=message):
      methods_lib.check_verifier_settings(bad)


def test_drafter_labels_are_short_and_distinct():
  assert methods_lib.drafter_labels(["qwen2.5-coder-0.5b", "results/train/distill_qwen_tvd",
                             "results/train/distill_qwen_tvd@init", "other/distill_qwen_tvd"]) == [
      "qwen2.5-coder-0.5b", "distill_qwen_tvd", "distill_qwen_tvd@init", "distill_qwen_tvd'"]
  assert methods_lib.drafter_labels(["results/train/steer_joint", "steered:results/train/steer_joint?replay=8",
                              "heads:runs/heads_qwen?rescore=ngram"]) == [
      "steer_joint", "steered:steer_joint?replay=8", "heads:heads_qwen?rescore=ngram"]
