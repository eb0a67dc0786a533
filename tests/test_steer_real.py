"""SD² trained jointly with its drafter on a real model (SmolLM2-135M as target and drafter base, every CI run): the
job on a few steps, its work directory loaded back as the drafter (LoRA merged, the newest checkpoint) and as the
map, greedy speculative decoding with both equal to the target's own greedy text, and the map refusing the base
model and its run's untuned drafter (``@init``)."""

import json

import numpy as np
import pytest

from blockspec_jax import run
from blockspec_jax import checks
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import hub
from blockspec_jax.train import recipe as recipe_lib
from blockspec_jax.train.steer_job import steer_job

MODEL = "smollm2-135m"


def _rows(rows):
  return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def joint_run(tmp_path_factory):
  """3 joint steps on 2 held-out and 4 training prompts: the drafter is 4 of SmolLM2's 30 layers (as the DistillSpec
  fast pair's) with rank-2 LoRA on their MLPs, steered by a rank-4 map."""
  workdir = tmp_path_factory.mktemp("steer_joint")
  held = prompts_lib.load_prompts(limit=2)
  train = [dict(id=f"train/{i}", task=("code", "chat")[i % 2], source="test", licence="MIT",
                text=f"List {i + 2} facts about the number {i * 7 + 3}.") for i in range(4)]
  held_file = workdir / "held.jsonl"
  held_file.write_text(_rows(held))
  # The job reads its prompt pool from the workdir when both files are there (as on a resume): no download here.
  (workdir / "prompts_heldout.jsonl").write_text(_rows(held))
  (workdir / "prompts_train.jsonl").write_text(_rows(train))
  summary = steer_job(workdir, target=MODEL, drafter=MODEL, heldout_prompts=str(held_file),
                      train_prompts_per_task=2, max_new_tokens=6, batch_size=2, sample_batch_size=6, rank=4,
                      gamma=3, scheme="blocks", divergence="tvd", num_steps=3, checkpoint_every=3, progress=False,
                      finetune_drafter={"layers": (0, 1, 2, 29), "lora_rank": 2, "lora_targets": ("up", "down")},
                      optimizer={"name": "adamw", "learning_rate": 1e-3, "warmup_steps": 1},
                      drafter_optimizer={"name": "adamw", "learning_rate": 1e-3, "warmup_steps": 1})
  return workdir, summary


@pytest.mark.slow  # SmolLM2 joint steering run; the default run covers the steer job on tiny models (test_steer)
def test_joint_run_records_and_loads_back_as_drafter_and_map(joint_run):
  workdir, summary = joint_run
  assert summary["steps"] == 3 and summary["num_heldout_prompts"] == 2
  for key in ("heldout_tv_before", "heldout_tv_after", "heldout_tv_plain", "heldout_tv_drafter_only"):
    assert 0 < summary[key] < 1
  assert summary["heldout_tv_before"] == summary["heldout_tv_plain"] and summary["steered_layers"] == [0, 1, 2, 3]
  assert recipe_lib.read_recipe(workdir).base == MODEL and recipe_lib.checkpoint_subtree(workdir) == "drafter"
  tuned = sources.load_model(str(workdir))
  assert tuned.spec.name == f"{workdir.resolve()}@3" and tuned.config.num_layers == 4
  base = hub.load_model(MODEL, progress=False)
  layer = lambda m, i: m.params["params"][f"layers_{i}"]
  up = lambda m: np.asarray(layer(m, 3 if m is tuned else 29)["mlp"]["up"]["weight"])
  q = lambda m: np.asarray(layer(m, 3 if m is tuned else 29)["attn"]["q"]["weight"])
  assert np.abs(up(tuned) - up(base)).max() > 0  # the adapters, merged
  np.testing.assert_array_equal(q(tuned), q(base))  # no adapter on q: the base's weights
  info = json.loads((workdir / "steer.json").read_text())
  assert info["drafter"] == str(workdir.resolve()) and info["drafter_base"] == MODEL and info["drafter_step"] == 3


@pytest.mark.slow  # SmolLM2 joint steering run; the default run covers the steer job on tiny models (test_steer)
def test_joint_run_decodes_losslessly_and_refuses_other_drafters(joint_run):
  workdir, _ = joint_run
  settings = {"steered": {"steer": str(workdir)}}
  common = dict(target=MODEL, num_prompts=1, gamma=3, temperatures=(0.0,), max_new_tokens=8, output_json=None,
                show_text=False, drafter_settings=settings)
  report = run.run_job(drafter=str(workdir), methods=("autoregressive", "greedy@steered"), **common)
  assert len(set(report["sample_text"].values())) == 1  # greedy with the tuned, steered drafter = the target's
  for drafter, message in ((MODEL, "steers a drafter of 4 layers"),  # the base: another shape
                           (f"{workdir}@init", "trained jointly with its drafter's step 3")):  # its shape, untuned
    with pytest.raises(checks.UsageError, match=message):
      run.run_job(drafter=drafter, methods=("greedy@steered",), **common)


@pytest.mark.slow  # SmolLM2 joint steering run; the default run covers the steer job on tiny models (test_steer)
def test_joint_run_steers_over_the_quantized_base_with_the_dequantized_ids(joint_run):
  """The trained drafter (LoRA beside the quantized blocks) and the map's taps read from the quantized target: every
  generated id of greedy and block decoding, at T = 0 and 1, is the dequantized run's (the kernel's logits are
  bit-identical on the same weights)."""
  workdir, _ = joint_run
  common = dict(target=MODEL, drafter=str(workdir), methods=("autoregressive", "greedy@steered", "block@steered"),
                num_prompts=1, gamma=3, temperatures=(0.0, 1.0), max_new_tokens=8, output_json=None, show_text=False,
                drafter_settings={"steered": {"steer": str(workdir)}})
  dense, quantized = (run.run_job(weights=w, **common) for w in hub.WEIGHTS)
  assert quantized["generated_ids"] == dense["generated_ids"] and len(quantized["generated_ids"]) == 6
