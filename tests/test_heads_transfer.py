"""BPD heads on other prompts (blockspec_jax.eval.heads_transfer): the data is the training job's own collection,
the score is the job's held-out evaluation overall and per category, and the command's mistakes are one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.data.prompts import load_prompts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import heads as heads_drafter
from blockspec_jax.drafters import lattice
from blockspec_jax.eval import heads_transfer as ht
from blockspec_jax.train import heads as heads_lib
from helpers import PROMPTS, model_pair


def _collected(first_row=0):
  config, target, _ = model_pair()
  data = ht.collect(config, target, PROMPTS, temperature=1.0, max_new_tokens=6, seed=3, batch_size=3,
                    progress=False, first_row=first_row)
  return config, target, data


def test_collect_is_the_training_jobs_collection():
  config, target, data = _collected(first_row=7)
  tokens_BxP, prompt_len_B = spec.prepare_prompts(PROMPTS)
  want = heads_lib.collect_hidden(config, target, tokens_BxP, prompt_len_B, max_new_tokens=6, temperature=1.0,
                                  key=jax.random.fold_in(jax.random.key(3), 1), batch_size=3, progress=False,
                                  rows=7 + np.arange(len(PROMPTS)))
  assert set(data) == set(want)
  for name in want:
    np.testing.assert_array_equal(data[name], want[name], err_msg=name)
  np.testing.assert_array_equal(data["row_N"], 7 + np.arange(len(PROMPTS)))


def _scored(data, config, target, tasks=None, first_row=0, heads=None):
  lm_head_VxD = heads_drafter.lm_head_weight(config, target)
  heads = heads_drafter.init_heads(config.d_model, 3, jax.random.key(1)) if heads is None else heads
  ngram = heads_lib.build_text_ngram(data, config.vocab_size, 3)
  return ht.score(heads, lm_head_VxD, ngram, data, num_heads=3, top_k=5, lm_weight=0.5, tasks=tasks,
                  first_row=first_row, chunk=4), (heads, lm_head_VxD, ngram)


def test_score_is_the_jobs_evaluation_and_categories_combine_to_it():
  config, target, data = _collected()
  rng = np.random.default_rng(0)
  trained = {k: jnp.asarray(v) for k, v in heads_drafter.init_heads(config.d_model, 3, jax.random.key(1)).items()}
  trained["w2_HxDxD"] = jnp.asarray(rng.normal(size=trained["w2_HxDxD"].shape).astype(np.float32) * 0.3)
  whole, (heads, lm_head_VxD, ngram) = _scored(data, config, target, heads=trained)
  labels_MxH = heads_lib.head_labels(data, 3)
  contexts = heads_lib.text_contexts(data, 3, 2, ngram.bos)
  want = heads_lib.evaluate_heads(heads, lm_head_VxD, heads_lib.lm_head_config(config.vocab_size, config.d_model),
                                  data["features_MxD"], labels_MxH, chunk=4, ngram=ngram, contexts_MxHxC=contexts,
                                  top_k=5, lm_weight=0.5)
  assert whole["trained"] == want  # tasks None: one evaluation of every position
  assert whole["positions"] == labels_MxH.shape[0] and whole["prompts"] == len(PROMPTS)
  assert whole["ngram_nll"] == pytest.approx(heads_lib.ngram_heldout_nll(ngram, data))
  assert whole["trained"]["top1"] != whole["untrained"]["top1"] or whole["trained"]["ce"] != whole["untrained"]["ce"]
  tasks = ["code", "chat", "code", "math"]
  split, _ = _scored(data, config, target, tasks=tasks, heads=trained)
  assert list(split["by_task"]) == ["code", "chat", "math"]
  assert sum(sub["positions"] for sub in split["by_task"].values()) == whole["positions"]
  for name in ("trained", "untrained"):
    for key in ("ce", "top1", "top1_rescored", *heads_lib.HEAD_SUMS.values()):
      np.testing.assert_allclose(split[name][key], whole[name][key], rtol=1e-6, atol=1e-7, err_msg=f"{name} {key}")
    assert split[name]["num_per_head"] == whole[name]["num_per_head"]
  code = np.isin(data["row_N"][data["seq_M"]], [0, 2])
  assert split["by_task"]["code"]["positions"] == int(code.sum())
  shifted, _ = _scored({**data, "row_N": data["row_N"] + 137}, config, target, tasks=tasks, first_row=137,
                       heads=trained)
  assert shifted["by_task"] == split["by_task"]  # rows counted from the first prompt's id
  text = ht.format_score(split, "title")
  assert text.splitlines()[0] == "title" and "rescored" in text and "math" in text


def test_untrained_heads_score_as_the_untrained_row():
  config, target, data = _collected()
  result, _ = _scored(data, config, target, heads=heads_drafter.init_heads(config.d_model, 3, jax.random.key(5)))
  assert result["trained"] == result["untrained"]  # W2 = 0: every head is the target's next-token head


def _fake_run(tmp_path, **record):
  """A heads run for SmolLM2 (D = 576, V = 49152): untrained heads and a trigram of a few token sequences."""
  run_dir = tmp_path / "heads"
  heads_drafter.save_heads(run_dir, heads_drafter.init_heads(576, 2, jax.random.key(0)), {"target": "smollm2-135m"})
  lattice.save_ngram(run_dir, lattice.build_ngram([np.arange(40) % 17, np.arange(30) * 3], 49152, 3))
  run = dict(target="smollm2-135m", dtype="float32", temperature=1.0, max_new_tokens=4, seed=0, collect_batch_size=2,
             num_heads=2, top_k=4, lm_weight=1.0)
  (run_dir / "metrics.json").write_text(json.dumps({**run, **record}))
  return run_dir


@pytest.mark.parametrize("argv, record, message", [
    (["--heads", "{missing}"], None, "no metrics.json there"),
    (["--heads", "{heads}"], {"target": None}, "not a real-model BPD heads run's record"),
    (["--heads", "{heads}"], {"num_heads": 3}, "--heads"),
    (["--heads", "{heads}", "--system", ""], {}, "--system:"),
    (["--heads", "{heads}", "--num-prompts", "0"], {}, "--num-prompts must be an integer >= 1"),
    (["--heads", "{heads}", "--first-row", "-1"], {}, "--first-row must be an integer >= 0"),
    (["--heads", "{heads}", "--prompts", "nosuch"], {}, "nosuch"),
])
def test_mistakes_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, argv, record, message):
  from blockspec_jax import sources
  monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  run_dir = _fake_run(tmp_path, **(record or {}))
  argv = [a.format(missing=tmp_path / "none", heads=run_dir) for a in argv]
  with pytest.raises(SystemExit) as e:
    ht.main(argv + ["--json", str(tmp_path / "out.json")])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_heads_of_another_width_are_refused_in_one_line(tmp_path, capsys):
  from blockspec_jax import sources
  sources.load_model("smollm2-135m", "float32", progress=False)  # on an empty cache, fetched here, not in main's stderr
  capsys.readouterr()
  run_dir = _fake_run(tmp_path)
  heads_drafter.save_heads(run_dir, heads_drafter.init_heads(64, 2, jax.random.key(0)))
  with pytest.raises(SystemExit):
    ht.main(["--heads", str(run_dir), "--num-prompts", "1", "--json", str(tmp_path / "out.json")])
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "576" in err, err


def test_smollm2_end_to_end_keeps_its_hidden_states(tmp_path, capsys):
  """Untrained heads on SmolLM2: trained and untrained rows equal, head 1's top-1 is the target's own next-token
  accuracy on its sampled text; the hidden states kept, reread, another format refused on the same file."""
  run_dir = _fake_run(tmp_path)
  out = tmp_path / "transfer.json"
  argv = ["--heads", str(run_dir), "--prompts", "other", "--num-prompts", "2", "--json", str(out)]
  assert ht.main(argv) == 0
  first = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert result["positions"] > 0 and result["trained"] == result["untrained"]
  tasks = [row["task"] for row in load_prompts("other", limit=2)]
  assert list(result["by_task"]) == list(dict.fromkeys(tasks)) and "collecting 2 prompts" in first
  assert (tmp_path / "transfer_hidden.npz").is_file()
  assert ht.main(argv) == 0
  assert "hidden states read from" in capsys.readouterr().out
  assert json.loads(out.read_text())["trained"] == result["trained"]
  with pytest.raises(SystemExit):
    ht.main(argv + ["--system", "none"])
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "transfer_hidden.npz" in err, err
