"""artifacts: records with a digest (Artifact) and npz caches that carry their settings (save_tagged / load_tagged)."""

import json

import numpy as np
import pytest

from blockspec_jax import artifacts

KIND = artifacts.Artifact("thing.npz", "thing.json", what="thing", absent="is not a thing directory",
                          remedy="rerun the thing job")


def test_artifact_round_trips_and_names_each_damage(tmp_path):
  w_3x2 = np.arange(6, dtype=np.float32).reshape(3, 2)
  KIND.save(tmp_path, {"w_3x2": w_3x2}, {"note": "x"}, {"rank": 3})
  arrays, record = KIND.load(tmp_path, convert={"rank": int}, names=("w_3x2",))
  np.testing.assert_array_equal(arrays["w_3x2"], w_3x2)
  assert record["rank"] == 3 and record["note"] == "x" and record["format"] == 1
  with pytest.raises(ValueError, match="no arrays"):
    KIND.load(tmp_path, names=("w_3x2", "b_3"))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    KIND.load(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="is not a thing directory"):
    KIND.load(tmp_path / "..")
  npz = tmp_path / "thing.npz"
  npz.write_bytes(npz.read_bytes()[:-7])
  with pytest.raises(ValueError, match="SHA-256 does not match.*rerun the thing job"):
    KIND.load(tmp_path)
  record_path = tmp_path / "thing.json"
  record_path.write_text(json.dumps({**record, "format": 2}))
  with pytest.raises(ValueError, match="format 2"):
    KIND.read_record(tmp_path)
  record_path.write_text("{")
  with pytest.raises(ValueError, match="corrupted"):
    KIND.read_record(tmp_path)


def test_tagged_npz_keeps_its_settings_and_refuses_damage(tmp_path):
  path = tmp_path / "cache.npz"
  tokens_2x3 = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
  meta = {"seed": 0, "target": "t", "stop_ids": [2]}
  artifacts.save_tagged(path, {"tokens_2x3": tokens_2x3}, meta, names=("tokens_2x3",))
  arrays, saved = artifacts.load_tagged(path, ("tokens_2x3",), what="cache", redo="delete it")
  np.testing.assert_array_equal(arrays["tokens_2x3"], tokens_2x3)
  assert saved == meta
  assert not list(tmp_path.glob(".*tmp*"))  # the atomic write left no temporary file
  with pytest.raises(ValueError, match=r"arrays \['mask_2x3'\] missing"):
    artifacts.save_tagged(path, {"tokens_2x3": tokens_2x3}, meta, names=("tokens_2x3", "mask_2x3"))
  with pytest.raises(ValueError, match="'meta'"):
    artifacts.save_tagged(path, {"meta": tokens_2x3}, meta)
  with pytest.raises(ValueError, match="not a readable cache file.*delete it"):
    artifacts.load_tagged(path, ("mask_2x3",), what="cache", redo="delete it")
  with pytest.raises(FileNotFoundError, match="no cache file"):
    artifacts.load_tagged(tmp_path / "absent.npz", (), what="cache", redo="delete it")
  path.write_bytes(path.read_bytes()[:40])
  with pytest.raises(ValueError, match="not a readable cache file"):
    artifacts.load_tagged(path, ("tokens_2x3",), what="cache", redo="delete it")


def test_changed_settings_names_the_keys_that_differ():
  saved = {"seed": 0, "V": 49152, "target": "a"}
  assert artifacts.changed_settings({"seed": 0, "target": "a"}, saved) == ["V"]
  assert artifacts.changed_settings({"seed": 0, "target": "a"}, saved, compare_saved_keys=False) == []
  assert artifacts.changed_settings({"seed": 1, "target": "b", "new": 1}, saved,
                                    compare_saved_keys=False) == ["new", "seed", "target"]


def test_read_matching_reads_a_cache_made_alike_and_refuses_one_made_otherwise(tmp_path):
  path = tmp_path / "labels.npz"
  load = lambda p: artifacts.load_tagged(p, ("labels_N",), what="labels", redo="delete it")
  assert artifacts.read_matching(path, {"seed": 0}, load, redo="delete it") is None  # absent: collect
  artifacts.save_tagged(path, {"labels_N": np.arange(3)}, {"seed": 0, "V": 64})
  data = artifacts.read_matching(path, {"seed": 0}, load, redo="delete it", compare_saved_keys=False)
  np.testing.assert_array_equal(data["labels_N"], np.arange(3))
  with pytest.raises(ValueError, match=r"labels.npz was collected with other settings \(V differ\); use a fresh "
                                       r"work directory or delete it"):
    artifacts.read_matching(path, {"seed": 0}, load, redo="delete it")
  with pytest.raises(ValueError, match=r"\(seed differ\)"):
    artifacts.read_matching(path, {"seed": 1}, load, redo="delete it", compare_saved_keys=False)
  path.write_bytes(path.read_bytes()[:40])
  with pytest.raises(ValueError, match="not a readable labels file"):  # the loader's own error passes through
    artifacts.read_matching(path, {"seed": 0}, load, redo="delete it")


def test_collect_missing_fills_only_the_uncached_splits_and_saves_each_at_once():
  from blockspec_jax import checks
  from blockspec_jax.train import pools
  calls, saved = [], []

  def collect(split, rows):
    calls.append((split, rows.dtype, rows.tolist()))
    if split == "heldout" and len(rows) == 0:
      raise ValueError("no held-out prompts")
    return {"rows": rows}

  data = pools.collect_missing({"train": {"rows": "cached"}, "heldout": None}, ([0, 2], [1]), collect,
                               lambda split, d: saved.append(split))
  assert calls == [("heldout", np.dtype(np.int64), [1])] and saved == ["heldout"]
  assert data["train"] == {"rows": "cached"} and data["heldout"]["rows"].tolist() == [1]
  calls.clear(), saved.clear()
  with pytest.raises(checks.UsageError, match="no held-out prompts"):  # the collector's error, as a usage error
    pools.collect_missing({"train": None, "heldout": None}, ([0, 2], []), collect, lambda split, d: saved.append(split))
  assert saved == ["train"]  # the first split was saved before the second failed
