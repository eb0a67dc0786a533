"""Evaluation suites (blockspec_jax.eval.suite): every shipped gin suite parses and binds only real settings, the
pooled and speedup arithmetic is exact, settings are refused before any model loads, and the smoke suite runs on
SmolLM2 end to end and writes a directory a researcher can use (config, JSON, CSV, plots, Markdown)."""

import csv
import json
import pathlib

import gin
import numpy as np
import pytest

from blockspec_jax import checks
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval import suite

REPO = pathlib.Path(__file__).resolve().parents[1]
SUITES = sorted((REPO / "gin" / "eval").glob("*.gin"))


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_every_suite_file_parses_and_names_real_methods(path, monkeypatch):
  monkeypatch.chdir(REPO)  # includes are relative to the repository root, as in the README's commands
  gin.clear_config()
  try:
    gin.parse_config_file(str(path))
    methods = gin.query_parameter("suite.methods") if path.stem != "qwen_pair" else methods_lib.METHODS
    for method in methods:
      methods_lib.parse_method(method)
    assert gin.query_parameter("suite.target") and gin.query_parameter("suite.drafter")
  finally:
    gin.clear_config()


def _row(task, method, gamma, tokens, calls, wall, decode, be=None, acc=None, per_pos=None):
  r = dict(task=task, method=method, gamma=gamma, temperature=1.0, top_k=0, top_p=1.0, lossy=False, prompts=2,
           tokens_generated=tokens, target_calls=calls, target_calls_per_token=calls / tokens, wall_s=wall,
           prefill_s=wall - decode, decode_s=decode, tokens_per_s=tokens / wall, decode_tokens_per_s=tokens / decode,
           peak_rss_gb=1.5, compiles_while_timed=0)
  if gamma is not None:
    r.update(block_efficiency=be, draft_acceptance_rate=acc, acceptance_per_position=per_pos, draft_nodes=gamma)
  return r


def test_pooled_rows_and_speedups_are_exact():
  # block: code 10 drafts of γ = 2 with 12 accepted (BE 2.2, rate 0.6); chat 30 drafts with 15 accepted (BE 1.5,
  # rate 0.25). Pooled: 40 drafts, 27 accepted -> BE 1 + 27/40, rate 27/80, per position weighted by drafts.
  rows = [_row("code", "autoregressive", None, 40, 40, 10.0, 8.0),
          _row("chat", "autoregressive", None, 60, 60, 20.0, 16.0),
          _row("code", "block", 2, 22, 10, 4.0, 2.0, 2.2, 0.6, [0.8, 0.4]),
          _row("chat", "block", 2, 45, 30, 9.0, 6.0, 1.5, 0.25, [0.4, 0.1])]
  pooled = [suite._pooled(rows[:2]), suite._pooled(rows[2:])]
  assert pooled[1]["block_efficiency"] == pytest.approx(1 + 27 / 40)
  assert pooled[1]["draft_acceptance_rate"] == pytest.approx(27 / 80)
  assert pooled[1]["acceptance_per_position"] == pytest.approx([(0.8 * 10 + 0.4 * 30) / 40, (0.4 * 10 + 0.1 * 30) / 40])
  assert pooled[1]["tokens_per_s"] == pytest.approx(67 / 13.0) and pooled[1]["target_calls_per_token"] == 40 / 67
  everything = rows + pooled
  suite._with_speedups(everything)
  assert [r["speedup"] for r in everything] == pytest.approx([1, 1, (22 / 4) / 4, (45 / 9) / 3, 1,
                                                              (67 / 13) / (100 / 30)])
  assert everything[2]["decode_speedup"] == pytest.approx((22 / 2) / 5)
  no_baseline = [_row("code", "block", 2, 22, 10, 4.0, 2.0, 2.2, 0.6, [0.8, 0.4])]
  suite._with_speedups(no_baseline)
  assert np.isnan(no_baseline[0]["speedup"])


def test_bucket_width():
  assert [suite.bucket_width(w, 64) for w in (1, 64, 65, 130)] == [64, 64, 128, 192]
  assert suite.bucket_width(37, 1) == 37
  with pytest.raises(checks.UsageError, match="width_bucket"):
    suite.bucket_width(10, 0)


@pytest.mark.parametrize("param, message", [
    ("suite.tasks = ['code', 'poetry']", r"tasks \['poetry'\] are not in"),
    ("suite.method_gammas = {'greedy': (2,)}", "method_gammas names"),
    ("suite.top_p = 1.5", "top_p must be in"),
    ("suite.methods = ('blok',)", "unknown method 'blok'"),
    ("suite.gammas = (0,)", "every gamma"),
    ("suite.gammas = ()", "gammas is empty"),
    ("suite.gammas = 3", r"gammas must be a tuple or list, e.g. \(3,\)"),
    ("suite.temperatures = 1.0", "temperatures must be a tuple or list"),
    ("suite.out_dir = '/proc/version/x'", "cannot write the suite's directory"),
    ("suite.width_bucket = 0", "width_bucket"),
    ("suite.target = 'no-such-model'", "no-such-model"),
    ("suite.prompts = '/nonexistent/prompts.jsonl'", "not found"),
])
def test_bad_settings_fail_in_one_line_before_any_model_loads(param, message, capsys, monkeypatch):
  monkeypatch.setattr(sources, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
  gin.clear_config()
  try:
    with pytest.raises(SystemExit) as exc:
      suite.main(["--gin_file", str(REPO / "gin" / "eval" / "smoke.gin"), "--gin_param", param])
  finally:
    gin.clear_config()
  assert exc.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("python -m blockspec_jax.eval.suite: error:"), err
  assert __import__("re").search(message, err[0]), err[0]


#: The smoke suite's categories the test runs: three of the six (the shortest prompts: the prefills of the three long
#: ones took most of the test's minute); the six categories' rows are checked by tests/test_prompts_six.py.
SMOKE_TASKS = ("chat", "math", "qa")


def test_smoke_suite_on_smollm2_writes_a_usable_run_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  out = tmp_path / "smoke"
  gin.clear_config()
  try:
    assert suite.main(["--gin_file", "gin/eval/smoke.gin", "--gin_param", f"suite.out_dir = '{out}'",
                       "--gin_param", "suite.progress = False", "--gin_param", f"suite.tasks = {SMOKE_TASKS!r}"]) == 0
  finally:
    gin.clear_config()
  report = json.loads((out / "results.json").read_text())
  rows = report["results"]
  tasks = list(SMOKE_TASKS)
  assert set(tasks) < set(prompts_lib.TASKS)
  assert report["settings"]["tasks"] == tasks and report["prompts_per_task"] == {t: 1 for t in tasks}
  assert [(r["task"], r["method"]) for r in rows] == (
      [(t, m) for m in ("autoregressive", "token", "block") for t in tasks + ["all"]])
  for r in rows:
    if r["method"] == "autoregressive":
      assert r["speedup"] == 1.0 and r["gamma"] is None and r["target_calls"] == r["tokens_generated"]
    else:  # SmolLM2 drafting for itself: p = q bit for bit, so every draft is accepted under both rules
      assert r["gamma"] == 2 and r["draft_acceptance_rate"] == 1.0
      assert r["acceptance_per_position"] == [1.0, 1.0]
      assert r["block_efficiency"] == 3.0  # γ + 1 per target call; the budget may cut the last block's tokens
      assert r["tokens_generated"] / r["target_calls"] <= 3.0
    assert not r["lossy"] and r["peak_rss_gb"] > 0
    assert r["compiles_while_timed"] == 0  # later categories reuse the first one's programs (warm runs)
    # block reuses token's prefills (one drafter, one γ); autoregressive runs once per temperature here
    assert r["prefills_reused"] == (r["prompts"] if r["method"] == "block" else 0)
  pooled = [r for r in rows if r["task"] == "all"]
  assert [p["tokens_generated"] for p in pooled] == [
      sum(r["tokens_generated"] for r in rows if r["method"] == p["method"] and r["task"] != "all") for p in pooled]
  with open(out / "results.csv", newline="") as f:
    table = list(csv.DictReader(f))
  assert len(table) == len(rows) and list(table[0]) == list(suite.ROW_FIELDS)
  assert table[-1]["acceptance_per_position"] == "1;1"
  config = (out / "config.gin").read_text()
  assert "suite.name = 'smoke'" in config and "suite.gammas = (2,)" in config
  markdown = (out / "report.md").read_text()
  assert all(f"## {t}" in markdown for t in tasks + ["all"])
  for name in ("be_vs_gamma.png", "speedup_vs_gamma.png", "acceptance_per_position.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in markdown


def test_every_gin_file_the_readme_names_exists():
  readme = (REPO / "README.md").read_text()
  named = set(__import__("re").findall(r"--gin_file (gin/[\w/.-]+\.gin)", readme))
  assert {"gin/eval/smoke.gin", "gin/eval/block_vs_token.gin", "gin/eval/gamma_sweep.gin",
          "gin/eval/trees_budget.gin"} <= named
  assert sorted(n for n in named if not (REPO / n).is_file()) == []


def test_the_grid_runs_each_method_at_its_gammas_and_autoregressive_once(tmp_path, monkeypatch):
  """The orchestration alone (models, encoding and decoding replaced by stand-ins): autoregressive once per
  temperature, every other method at suite.gammas unless method_gammas overrides it, categories innermost with only
  the first one compiling (warm afterwards), one padded width for all."""
  import types
  calls = []
  model = types.SimpleNamespace(stop_ids=(0,))
  monkeypatch.setattr(sources, "load_models", lambda *a, **k: (model, [model], 0.0))
  monkeypatch.setattr(prompts_lib, "encode_prompts", lambda m, rows, chat, system: [[1] * (10 + len(r["text"]) % 50) for r in rows])
  monkeypatch.setattr(methods_lib, "check_methods_fit", lambda *a, **k: 0)

  def run_method(method, target, drafter, ids, width, *, gamma, temperature, warm, **kw):
    calls.append((method, gamma, temperature, warm, width))
    row = dict(method=method, temperature=temperature, gamma=None if method == "autoregressive" else gamma,
               lossy=False, prompts=len(ids), tokens_generated=8, target_calls=4, target_calls_per_token=0.5,
               wall_s=1.0, prefill_s=0.5, decode_s=0.5, tokens_per_s=8.0, decode_tokens_per_s=16.0,
               compiles_while_timed=0)
    if method != "autoregressive":
      row.update(block_efficiency=2.0, draft_acceptance_rate=0.5, acceptance_per_position=[0.5] * gamma,
                 draft_nodes=gamma)
    return row, []

  monkeypatch.setattr(harness, "run_method", run_method)
  report = suite.suite_job(prompts="default", methods=("autoregressive", "token", "block"), gammas=(2, 4),
                           method_gammas={"block": (8,)}, temperatures=(1.0, 0.0), out_dir=str(tmp_path / "run"),
                           plots=False, progress=False, target="smollm2-135m", drafter="smollm2-135m")
  grid = [("autoregressive", None, 1.0), ("token", 2, 1.0), ("token", 4, 1.0), ("block", 8, 1.0),
          ("autoregressive", None, 0.0), ("token", 2, 0.0), ("token", 4, 0.0), ("block", 8, 0.0)]
  executed = [(m, None if m == "autoregressive" else g, t) for m, g, t, warm, _ in calls if not warm]
  # Executed grouped by γ (rows that may share a prefill one after the other), written in the grid's order.
  assert executed == sorted(grid, key=lambda r: (-1 if r[1] is None else r[1], grid.index(r)))
  assert [(r["method"], r["gamma"], r["temperature"]) for r in report["results"] if r["task"] == "all"] == grid
  assert len(calls) == 3 * len(grid) and len({w for *_, w in calls}) == 1 and calls[0][4] % 64 == 0
  assert [c[3] for c in calls[:3]] == [False, True, True]  # code compiles, chat and math reuse it
  assert len(report["results"]) == 4 * len(grid) and (tmp_path / "run" / "report.md").exists()


def test_a_lossy_grid_measures_fidelity_and_plots_speed_against_it(tmp_path, monkeypatch):
  """With a lossy rule in the grid (fidelity on by default), every row gets the target's mean log-likelihood of its
  emitted tokens (stand-in numbers here), the pooled row pools sums over categories, Δ is taken against
  autoregressive sampling of the same category, and tradeoff.png joins the plots and the report; a lossless grid
  measures nothing unless asked."""
  import types
  model = types.SimpleNamespace(stop_ids=(0,))
  monkeypatch.setattr(sources, "load_models", lambda *a, **k: (model, [model], 0.0))
  monkeypatch.setattr(prompts_lib, "encode_prompts", lambda m, rows, chat, system: [[1] * 5 for _ in rows])
  monkeypatch.setattr(methods_lib, "check_methods_fit", lambda *a, **k: 0)
  logp = {"autoregressive": -1.0, "block": -1.1, "mtad": -0.5}
  shapes = set()

  def run_method(method, target, drafter, ids, width, *, gamma, temperature, warm, **kw):
    row = dict(method=method, temperature=temperature, gamma=None if method == "autoregressive" else gamma,
               lossy=method == "mtad", prompts=len(ids), tokens_generated=4 * len(ids), target_calls=2 * len(ids),
               target_calls_per_token=0.5, wall_s=1.0, prefill_s=0.5, decode_s=0.5, tokens_per_s=4.0 * len(ids),
               decode_tokens_per_s=8.0, compiles_while_timed=0)
    if method != "autoregressive":
      row.update(block_efficiency=2.0, draft_acceptance_rate=0.5, acceptance_per_position=[0.5] * gamma,
                 draft_nodes=gamma)
    return row, [[method] * 4 for _ in ids]  # outputs tagged by method, for the stand-in scorer

  def loglik(target_model, prompt_ids, outputs, width, window):
    shapes.add((width, window))
    n = sum(map(len, outputs))
    return logp[outputs[0][0]] * n, n, []

  monkeypatch.setattr(harness, "run_method", run_method)
  monkeypatch.setattr(suite.fidelity_lib, "target_loglik", loglik)
  run = tmp_path / "run"
  report = suite.suite_job(prompts="default", prompts_per_task=None, methods=("autoregressive", "block", "mtad"),
                           gammas=(2,), temperatures=(1.0,), max_new_tokens=8, out_dir=str(run), progress=False,
                           target="smollm2-135m", drafter="smollm2-135m")
  assert report["settings"]["fidelity"] is True
  rows = {(r["task"], r["method"]): r for r in report["results"]}
  assert len(shapes) == 1  # one scoring shape for every category: one compiled program
  for task in ("code", "chat", "math"):
    assert rows[(task, "mtad")]["mean_logp"] == pytest.approx(-0.5)
    assert rows[(task, "mtad")]["delta_logp_vs_ar"] == pytest.approx(0.5)
    assert rows[(task, "autoregressive")]["delta_logp_vs_ar"] == 0.0
  pooled = rows[("all", "block")]
  assert pooled["loglik_tokens"] == sum(rows[(t, "block")]["loglik_tokens"] for t in ("code", "chat", "math"))
  assert pooled["delta_logp_vs_ar"] == pytest.approx(-0.1)
  assert (run / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  markdown = (run / "report.md").read_text()
  assert "](tradeoff.png)" in markdown and "Δ log p" in markdown
  with open(run / "results.csv", newline="") as f:
    assert {r["mean_logp"] for r in csv.DictReader(f)} != {""}

  lossless = suite.suite_job(prompts="default", methods=("autoregressive", "block"), gammas=(2,),
                             temperatures=(1.0,), out_dir=str(tmp_path / "plain"), plots=False, progress=False,
                             target="smollm2-135m", drafter="smollm2-135m")
  assert lossless["settings"]["fidelity"] is False
  assert all("mean_logp" not in r for r in lossless["results"])
