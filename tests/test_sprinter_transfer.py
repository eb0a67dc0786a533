"""SPRINTER's head on other prompts (blockspec_jax.eval.sprinter_transfer): the labels are the training job's own
collection, the score is the run's report per category with its base rate, and the command's mistakes are one line."""

import json

import jax
import numpy as np
import pytest

from blockspec_jax.data.prompts import load_prompts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters.sprinter import save_head
from blockspec_jax.eval import sprinter_transfer as st
from blockspec_jax.train import sprinter
from helpers import PROMPTS, model_pair


@pytest.mark.parametrize("label_set", ["sampled", "official"])
def test_collect_is_the_training_jobs_collection(label_set):
  config, target, drafter = model_pair(noise=1.0)
  data = st.collect(config, target, config, drafter, PROMPTS, label_set=label_set, temperature=1.0,
                    max_new_tokens=5, seed=3, batch_size=2, progress=False, first_row=7)
  tokens_BxP, prompt_len_B = spec.prepare_prompts(PROMPTS)
  common = dict(max_new_tokens=5, temperature=1.0, batch_size=2, progress=False, rows=7 + np.arange(len(PROMPTS)))
  if label_set == "official":
    want = sprinter.collect_official_labels(config, target, config, drafter, tokens_BxP, prompt_len_B, **common)
  else:
    want = sprinter.collect_labels(config, target, config, drafter, tokens_BxP, prompt_len_B,
                                   key=jax.random.fold_in(jax.random.key(3), 1), **common)
  assert set(data) == set(want)
  for name in want:
    np.testing.assert_array_equal(data[name], want[name], err_msg=name)
  with pytest.raises(ValueError, match="label_set 'greedy' is not one of"):
    st.collect(config, target, config, drafter, PROMPTS, label_set="greedy", temperature=1.0, max_new_tokens=5,
               seed=3, batch_size=2, progress=False)


def test_score_is_the_head_report_overall_and_per_category():
  rng = np.random.default_rng(0)
  features_NxD = rng.normal(size=(40, 6)).astype(np.float32)
  labels_N = (features_NxD[:, 0] + 0.5 * rng.normal(size=40) > 0.3).astype(np.int8)
  row_N = np.repeat(np.arange(4), 10)
  head = {"w_D": np.eye(6, dtype=np.float32)[0] * 2.0, "b": np.float32(-0.5)}
  data = {"features_NxD": features_NxD, "labels_N": labels_N, "row_N": row_N}
  result = st.score(head, data, (0.3, 0.7), tasks=["code", "chat", "code", "math"])
  rate = labels_N.mean()
  assert result["num"] == 40 and result["positive_rate"] == pytest.approx(rate)
  assert result["base_rate"] == pytest.approx(max(rate, 1 - rate))
  assert result["report"] == sprinter.head_report(head, features_NxD, labels_N, (0.3, 0.7))
  assert result["bce"] == pytest.approx(sprinter.evaluate_head(head, features_NxD, labels_N)["bce"])
  assert list(result["by_task"]) == ["code", "chat", "math"]  # the prompts' order
  code = np.isin(row_N, [0, 2])
  assert result["by_task"]["code"]["num"] == 20
  assert result["by_task"]["code"]["report"] == sprinter.head_report(head, features_NxD[code], labels_N[code],
                                                                     (0.3, 0.7))
  shifted = st.score(head, {**data, "row_N": row_N + 137}, (0.3, 0.7), ["code", "chat", "code", "math"], 137)
  assert shifted == result  # rows counted from the first prompt's id
  text = st.format_score(result, "title")
  assert text.splitlines()[0] == "title" and "base rate" in text and "θ=0.7" in text


def _fake_run(tmp_path, **record):
  head_dir = tmp_path / "head"
  save_head(head_dir, {"w_D": np.zeros(576, np.float32), "b": np.float32(0.0)}, {"drafter": "smollm2-135m"})
  run = dict(target="smollm2-135m", drafter="smollm2-135m", dtype="float32", label_set="sampled",
             temperature=1.0, max_new_tokens=4, seed=0, thresholds=[0.3, 0.7], collect_batch_size=2)
  (head_dir / "metrics.json").write_text(json.dumps({**run, **record}))
  return head_dir


@pytest.mark.parametrize("argv, record, message", [
    (["--head", "{missing}"], None, "no metrics.json there"),
    (["--head", "{head}"], {"target": None}, "not a real-model SPRINTER run's record"),
    (["--head", "{head}", "--system", ""], {}, "--system:"),
    (["--head", "{head}", "--num-prompts", "0"], {}, "--num-prompts must be an integer >= 1"),
    (["--head", "{head}", "--first-row", "-1"], {}, "--first-row must be an integer >= 0"),
    (["--head", "{head}", "--prompts", "nosuch"], {}, "nosuch"),
])
def test_mistakes_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, argv, record, message):
  from blockspec_jax import sources
  monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  head_dir = _fake_run(tmp_path, **(record or {}))
  argv = [a.format(missing=tmp_path / "none", head=head_dir) for a in argv]
  with pytest.raises(SystemExit) as e:
    st.main(argv + ["--json", str(tmp_path / "out.json")])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_smollm2_end_to_end_keeps_its_labels(tmp_path, capsys, monkeypatch):
  """SmolLM2 drafting for itself (every label 1: q = p): the report, its labels file, a rerun that reads them, and
  another format refused on the same labels file."""
  head_dir = _fake_run(tmp_path)
  out = tmp_path / "transfer.json"
  argv = ["--head", str(head_dir), "--prompts", "other", "--num-prompts", "2", "--json", str(out)]
  assert st.main(argv) == 0
  first = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert result["num"] > 0 and result["positive_rate"] == 1.0 and result["base_rate"] == 1.0
  assert [r["eta_fp"] for r in result["report"]] == [None, None]  # no label 0
  assert [r["accept_rate"] for r in result["report"]] == [1.0, 0.0]  # the zero head says 0.5
  tasks = [row["task"] for row in load_prompts("other", limit=2)]
  assert list(result["by_task"]) == list(dict.fromkeys(tasks)) and "collecting sampled labels" in first
  assert sum(sub["num"] for sub in result["by_task"].values()) == result["num"]
  assert (tmp_path / "transfer_labels.npz").is_file()
  from blockspec_jax import sources
  loaded, load = [], sources.load_model
  monkeypatch.setattr(sources, "load_model", lambda name, *a, **k: loaded.append(name) or load(name, *a, **k))
  assert st.main(argv) == 0
  assert "labels read from" in capsys.readouterr().out
  assert loaded == ["smollm2-135m"]  # the target's tokenizer keys the labels; no drafter without a collection
  assert json.loads(out.read_text())["report"] == result["report"]
  with pytest.raises(SystemExit):
    st.main(argv + ["--system", "none"])
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "transfer_labels.npz" in err, err
