"""The main job on the real SmolLM2 (drafter = target), small: table, JSON fields, greedy equality on a real model."""

import dataclasses
import json

import pytest

from blockspec_jax import run
from blockspec_jax.eval import prompts as prompts_lib


def test_prompt_file_rows_keep_their_licence():
  rows = prompts_lib.load_prompts()
  assert {r["task"] for r in rows} == {"code", "chat", "math"}
  assert all(r["licence"] in ("MIT", "Apache-2.0") and "==" in r["source"] for r in rows)
  assert [r["task"] for r in prompts_lib.load_prompts(limit=3)] == ["code", "chat", "math"]
  with pytest.raises(FileNotFoundError, match="build one"):
    prompts_lib.load_prompts("/nonexistent/prompts.jsonl")


def test_main_job_on_smollm2(tmp_path, capsys):
  out = tmp_path / "run.json"
  report = run.run_job(target="smollm2-135m", drafter="smollm2-135m", num_prompts=2, gamma=3, temperatures=(0.0,),
                       max_new_tokens=12, output_json=str(out), show_text=True)
  printed = capsys.readouterr().out
  assert "block efficiency" in printed and "--- block@T=0.0 ---" in printed and "dec tok/s" in printed
  saved = json.loads(out.read_text())
  assert saved["results"] == json.loads(json.dumps(report["results"]))
  by_method = {r["method"]: r for r in report["results"]}
  assert set(by_method) == {"autoregressive", "token", "block"}
  for name in ("token", "block"):
    r = by_method[name]
    for field in ("block_efficiency", "draft_acceptance_rate", "acceptance_per_position", "target_calls",
                  "tokens_generated", "wall_s", "tokens_per_s", "speedup", "prefill_s", "decode_s",
                  "decode_tokens_per_s", "decode_speedup"):
      assert field in r
    assert r["wall_s"] == pytest.approx(r["prefill_s"] + r["decode_s"]) and 0 < r["prefill_s"] < r["wall_s"]
    assert r["block_efficiency"] == pytest.approx(4.0)  # drafter = target at T = 0: every draft token accepted
    assert r["invalid_prob_rows"] == 0
  # Greedy: the same text from every method (speculative decoding is lossless; the drafter is the target here).
  texts = report["sample_text"]
  assert texts["token@T=0.0"] == texts["autoregressive@T=0.0"] == texts["block@T=0.0"]
  assert len(texts["block@T=0.0"].strip()) > 0


def test_pair_checks():
  from blockspec_jax.models import hub
  smol = hub.load_model("smollm2-135m")
  fake = dataclasses.replace(smol, config=dataclasses.replace(smol.config, vocab_size=smol.config.vocab_size + 1))
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    run.check_pair(smol, fake)
  with pytest.raises(ValueError, match="gamma must be >= 1"):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", gamma=0)
  with pytest.raises(ValueError, match="unknown model"):
    run.run_job(target="llama-405b", drafter="smollm2-135m", num_prompts=1)
