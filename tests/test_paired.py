"""Paired rule comparison (blockspec_jax.eval.paired): exact cases, block ≥ token on shared drafts, the summary."""

import numpy as np
import pytest

from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.eval import paired
from helpers import PROMPTS, model_pair, tiny_config


def _table(drafter_noise_params, config, target, gamma=4, draws=16, temperature=1.0, seed=0):
  return paired.paired_acceptance(target, drafter_noise_params, PROMPTS, target=config, drafter=ModelDrafter(config),
                                  gamma=gamma, temperature=temperature, draws=draws, seed=seed)


def test_self_drafting_accepts_everything():
  """Drafter = target: every rule accepts the whole draft, so Σ_i P(τ ≥ i | X^i) = γ for every γ."""
  config, target, _ = model_pair()
  table = _table(target, config, target, draws=4)
  assert table.shape == (4, len(PROMPTS), 2, 4)
  np.testing.assert_allclose(table, np.broadcast_to(np.arange(1, 5, dtype=np.float32), table.shape), rtol=1e-5)


def test_progress_counts_the_contexts_batch_by_batch(capsys):
  """``progress``: a bar over the contexts on stderr, advanced per length batch, naming the batch it compiles; the
  table is the one without it."""
  config, target, _ = model_pair()
  table = paired.paired_acceptance(target, target, PROMPTS, target=config, drafter=ModelDrafter(config), gamma=2,
                                   temperature=1.0, draws=2, buckets=2, progress="T=1 self")
  err = capsys.readouterr().err
  assert "T=1 self" in err and f"{len(PROMPTS)}/{len(PROMPTS)}" in err, err
  assert "batch 1/2" in err and "batch 2/2" in err and "compiling" in err, err
  np.testing.assert_allclose(table, np.broadcast_to(np.arange(1, 3, dtype=np.float32), table.shape), rtol=1e-5)
  paired.paired_acceptance(target, target, PROMPTS, target=config, drafter=ModelDrafter(config), gamma=2,
                           temperature=1.0, draws=2)
  assert capsys.readouterr().err == ""  # no bar unless asked


def test_rules_agree_at_gamma_one_and_block_wins_on_shared_drafts():
  config, target, drafter = model_pair(noise=1.0)
  table = _table(drafter, config, target, gamma=4, draws=64)
  # γ = 1: block and token verification are the same rule.
  np.testing.assert_allclose(table[:, :, 0, 0], table[:, :, 1, 0], rtol=1e-6)
  assert np.all((table >= 0) & (table <= np.arange(1, 5)[None, None, None, :] + 1e-5))
  summary = paired.summarize_paired(table)
  assert [s["gamma"] for s in summary] == [1, 2, 3, 4]
  assert summary[0]["diff"] == pytest.approx(0.0, abs=1e-6)
  # E[τ] under block verification ≥ token verification (Sun et al., Thm. 2); on shared drafts the gain shows clearly.
  for s in summary[1:]:
    assert s["diff"] > 3 * s["diff_stderr"] > 0, s
  # Same seed, same table; another seed, other drafts.
  np.testing.assert_array_equal(table, _table(drafter, config, target, gamma=4, draws=64))
  assert not np.array_equal(table[:4], _table(drafter, config, target, gamma=4, draws=4, seed=1))


def test_summary_arithmetic():
  # 2 draws, 3 contexts, rules (token, block), γ ≤ 2.
  table = np.zeros((2, 3, 2, 2))
  table[:, :, 0, 1] = [[1.0, 1.2, 1.4], [1.0, 1.0, 1.0]]   # token, γ = 2: per-context means 1.0, 1.1, 1.2
  table[:, :, 1, 1] = [[1.2, 1.2, 1.6], [1.2, 1.4, 1.2]]   # block, γ = 2: 1.2, 1.3, 1.4
  s = paired.summarize_paired(table)[1]
  assert s["be"] == pytest.approx({"token": 2.1, "block": 2.3})
  assert s["diff"] == pytest.approx(0.2) and s["diff_stderr"] == pytest.approx(0.0, abs=1e-12)
  assert s["gain"] == pytest.approx(2.3 / 2.1 - 1) and (s["contexts"], s["draws"]) == (3, 2)


@pytest.mark.slow  # a second SmolLM2 paired table
def test_length_buckets_give_the_one_batch_table():
  """Contexts measured in batches of similar length draw the same drafts (row keys follow the context, not its
  place in a batch), so the table is the one-batch table up to float rounding of the padding."""
  config, target, drafter = model_pair(noise=1.0)
  assert [list(r) for r in paired.length_buckets([7, 2, 4, 1], 2)] == [[3, 1], [2, 0]]
  assert len(paired.length_buckets([3, 1], 5)) == 2  # never an empty batch
  with pytest.raises(ValueError, match="buckets must be an integer >= 1"):
    paired.length_buckets([3], 0)
  one = _table(drafter, config, target, gamma=3, draws=4)
  for buckets in (2, 4):
    split = paired.paired_acceptance(target, drafter, PROMPTS, target=config, drafter=ModelDrafter(config), gamma=3,
                                     temperature=1.0, draws=4, buckets=buckets)
    np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-6)


def test_contexts_record_their_prompt_and_offset():
  owners, offsets = [], []
  contexts = paired.build_contexts([[1, 2], [3]], [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21]], 4, owners, offsets)
  # 8 sampled tokens, 4 positions: prefixes of 0, 2, 4, 6; a 2-token sample gives only 0 and 1 (no repeats).
  assert offsets == [0, 2, 4, 6, 0, 1] and owners == [0, 0, 0, 0, 1, 1]
  assert contexts[2] == [1, 2, 10, 11, 12, 13] and contexts[5] == [3, 20]
  assert all(len(c) == len([[1, 2], [3]][o]) + j for c, o, j in zip(contexts, owners, offsets))


def test_bad_arguments():
  config, target, drafter = model_pair()
  with pytest.raises(ValueError, match="gamma and draws must be >= 1"):
    _table(drafter, config, target, gamma=0)
  with pytest.raises(ValueError, match="at least one token"):
    paired.paired_acceptance(target, drafter, [[1], []], target=config, drafter=ModelDrafter(config), gamma=2,
                             temperature=1.0, draws=1)


def test_tree_arm_summary_and_paired_differences():
  from blockspec_jax.eval import paired_trees as pt
  # 2 draws, 3 contexts; arm A with rules (rrs_wor, traversal), arm B with (rrs, spectr), budget 8.
  a = np.zeros((2, 3, 2))
  a[:, :, 0] = [[1.0, 2.0, 3.0], [1.0, 2.0, 1.0]]  # rrs_wor: per-context means 1.0, 2.0, 2.0
  a[:, :, 1] = [[1.5, 2.0, 3.0], [1.5, 2.5, 2.0]]  # traversal: 1.5, 2.25, 2.5
  b = np.zeros((2, 3, 2))
  b[:, :, 0] = [[0.5, 1.0, 1.0], [0.5, 2.0, 2.0]]  # rrs: 0.5, 1.5, 1.5
  results = [dict(budget=8, arm="rsd_c branching=(2, 1, 1, 1)", gamma=4, rules=["rrs_wor", "traversal"], table=a),
             dict(budget=8, arm="spectr k=2", gamma=4, rules=["rrs", "spectr"], table=b)]
  rows = {(r["arm"].split(" ")[0], r["rule"]): r for r in pt.summarize_arms(results)}
  assert rows[("rsd_c", "traversal")]["be"] == pytest.approx(1 + 6.25 / 3)
  assert rows[("rsd_c", "rrs_wor")]["be_stderr"] == pytest.approx(np.std([1, 2, 2], ddof=1) / np.sqrt(3))
  d, se = pt.paired_difference(results, 8, results[0]["arm"], "traversal", "rrs_wor")  # diffs 0.5, 0.25, 0.5
  assert d == pytest.approx(1.25 / 3) and se == pytest.approx(np.std([0.5, 0.25, 0.5], ddof=1) / np.sqrt(3))
  d, _ = pt.paired_difference(results, 8, results[0]["arm"], "rrs_wor", "rrs", worse_arm="spectr k=2")
  assert d == pytest.approx(0.5)  # (1.0 − 0.5 + 2.0 − 1.5 + 2.0 − 1.5) / 3, paired on contexts across arms
  text = paired.format_trees([dict(r, temperature=1.0) for r in results], [1.0])
  assert "traversal − rrs_wor on the same trees: +0.417" in text
  assert "siblings without − with replacement" in text and "+0.500" in text
  with pytest.raises(KeyError, match="no arm"):
    pt.paired_difference(results, 16, "spectr k=2", "rrs", "spectr")


def test_rsd_c_branches_at_several_depths_within_each_budget():
  """RSD-C's multi-level shapes: the deepest (2, 2, 1, …) and (4, 2, 1, …) with at most N nodes, their node count
  in the label; a shape that cannot fit is left out; every arm's drafter builds with its settings."""
  from blockspec_jax import drafters
  from blockspec_jax.eval import paired_trees as pt
  assert pt.branching_within((2, 2), 16) == ((2, 2, 1, 1), 14)  # 2 + 4 + 4 + 4
  assert pt.branching_within((2, 2), 8) == ((2, 2), 6)
  assert pt.branching_within((4, 2), 16) == ((4, 2), 12)
  assert pt.branching_within((4, 2), 8) is None and pt.branching_within((2, 2), 4) is None
  multi = {budget: [a for a in pt.arms_for_budget(budget) if a.label.startswith("rsd_c-")] for budget in (4, 8, 16)}
  assert [a.label for a in multi[4]] == []
  assert [a.label for a in multi[8]] == ["rsd_c-2,2 branching=(2, 2) (6 nodes)"]
  assert [a.label for a in multi[16]] == ["rsd_c-2,2 branching=(2, 2, 1, 1) (14 nodes)",
                                          "rsd_c-4,2 branching=(4, 2) (12 nodes)"]
  config = tiny_config()
  for arm in (a for arms in multi.values() for a in arms):
    drafter = drafters.make(arm.drafter, config=config, **dict(arm.settings))
    assert drafter.num_nodes(arm.gamma) <= 16 and arm.rules == ("rrs_wor", "traversal")
    assert f"({drafter.num_nodes(arm.gamma)} nodes)" in arm.label
  # the without/with-replacement comparison keeps to the (2, 1, …) shape, whatever else is at the budget
  table = np.ones((1, 2, 2))
  results = [dict(budget=8, arm=a.label, gamma=a.gamma, rules=list(a.rules), table=table, temperature=1.0)
             for a in pt.arms_for_budget(8)]
  text = paired.format_trees(results, [1.0])
  assert "rrs_wor on rsd_c branching=(2, 1, 1, 1) − rrs on spectr k=2" in text


@pytest.mark.parametrize("argv,message", [
    (["--draws", "0"], "--draws must be an integer >= 1, got 0"),
    (["--temperatures", "x"], "--temperatures is for --trees and --drafters"),
    (["--trees", "--temperatures", "x"], "--temperatures takes comma-separated numbers, got 'x'"),
    (["--trees", "--budgets", "4,x"], "--budgets takes comma-separated numbers, got '4,x'"),
    (["--trees", "--budgets", "4,0"], "every budget must be >= 1, got 0"),
    (["--drafters", "heads:/nonexistent/heads_run"], "/nonexistent/heads_run"),
    (["--json", "/proc/version/out.json"], "cannot write the folder of the report (--json)"),
    (["--mesh", "2x2"], "--mesh 2 x 2 (data x model) must cover the run's 1 device(s)"),
    (["--mesh", "four"], "--mesh takes DATAxMODEL (e.g. 4x2), got 'four'"),
    (["--system", " "], "--system: system must be 'default', 'none', a system message"),
])
def test_option_mistakes_are_one_line_before_any_model_loads(argv, message, capsys, monkeypatch):
  from blockspec_jax import sources
  from blockspec_jax.eval import paired
  monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the check"))
  with pytest.raises(SystemExit) as exit_info:
    paired.main(["--target", "smollm2-135m", "--drafter", "smollm2-135m", *argv])
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2
  assert len(err) == 1 and err[0].startswith("python -m blockspec_jax.eval.paired: error:") and message in err[0], err


def test_the_plain_comparison_runs_end_to_end_and_records_its_mesh(tmp_path, capsys):
  """``eval.paired`` on SmolLM2 drafting for itself (T = 1): a drafter equal to its target has every draft accepted
  under both rules (BE = γ + 1 at every γ), and the report records the options and the mesh it ran on."""
  import json
  from blockspec_jax.eval import paired
  from blockspec_jax import sources
  from blockspec_jax.data import prompts as prompts_lib
  out = tmp_path / "paired.json"
  assert paired.main(["--target", "smollm2-135m", "--drafter", "smollm2-135m", "--num-prompts", "1",
                      "--sample-tokens", "4", "--positions", "2", "--gamma", "2", "--draws", "2", "--system", "none",
                      "--json", str(out)]) == 0
  saved = json.loads(out.read_text())
  assert saved["config"]["mesh"] == [1, 1] and saved["config"]["gamma"] == 2 and len(saved["contexts"]) == 2
  # the contexts' prompts carry no system turn: the first context is the prompt itself
  none, default = (prompts_lib.encode_prompts(sources.load_model("smollm2-135m"), prompts_lib.load_prompts(limit=1),
                                              system=s)[0] for s in ("none", "default"))
  assert saved["config"]["system"] == "none" and saved["contexts"][0] == len(none) < len(default)
  assert [(s["gamma"], s["be"]["token"], s["be"]["block"]) for s in saved["summary"]] == [
      (1, pytest.approx(2.0, abs=1e-3), pytest.approx(2.0, abs=1e-3)),
      (2, pytest.approx(3.0, abs=1e-3), pytest.approx(3.0, abs=1e-3))]
  assert "BE = 1 + Σ_i P(τ ≥ i | X^i)" in capsys.readouterr().out


def test_a_resumed_file_must_have_the_same_contexts(tmp_path):
  """A file is resumed only with the settings that made its contexts; one written before ``--system`` existed counts
  as ``--system default``."""
  import argparse
  from blockspec_jax.checks import UsageError
  from blockspec_jax.eval import paired
  args = argparse.Namespace(**{k: 1 for k in paired._CONTEXT_SETTINGS}, verify_draws=16)
  args.system = "default"
  earlier = {"config": {k: 1 for k in paired._CONTEXT_SETTINGS if k != "system"} | {"verify_draws": 16}}
  paired._check_same_contexts(tmp_path, earlier, args, paired._CONTEXT_SETTINGS + ("verify_draws",))
  args.system, args.verify_draws, args.seed = "none", 8, 2
  with pytest.raises(UsageError, match=r"other settings \(--system, --seed, --verify-draws\)"):
    paired._check_same_contexts(tmp_path, earlier, args, paired._CONTEXT_SETTINGS + ("verify_draws",))
