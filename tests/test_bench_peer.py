"""bench_peer's arithmetic on synthetic worker reports (peer_analysis, peer_report, bench_peer's --from-json):
baselines, ideals, verdicts, drift, fastest γ, (b), (c), bf16."""

import json

import pytest

from blockspec_jax.eval import bench_peer, peer_analysis, peer_report


def _row(method, t, gamma, tokens_per_s, decode_tokens_per_s, be=None, repeat=0):
  row = dict(method=method, temperature=t, gamma=gamma, repeat=repeat, tokens_per_s=tokens_per_s,
             decode_tokens_per_s=decode_tokens_per_s, prefill_s=1.0, decode_s=96 / decode_tokens_per_s,
             tokens_generated=96, target_calls=96 if method == "autoregressive" else 40, wall_s=96 / tokens_per_s)
  if be is not None:
    row["block_efficiency"] = be
  return row


def _ours(dtype="float32", scale=1.0):
  # c = 100 / 250 = 0.4; v(γ) = 1.2 for γ = 2 (3-token pass 300 ms / 250 ms), 1.4 for γ = 4.
  return dict(engine="ours", dtype=dtype, position=180, prompt_ids=[[1, 2]], stop_ids=[7],
              target_forward_ms={"1": 250.0, "3": 300.0, "5": 350.0}, drafter_forward_ms=100.0, peak_rss_gb=9.0,
              results=[
                  _row("autoregressive", 1.0, None, 2.0 * scale, 2.5 * scale),
                  _row("token", 1.0, 2, 2.35 * scale, 3.0 * scale, be=2.2),
                  _row("block", 1.0, 2, 2.2 * scale, 3.2 * scale, be=2.4),
                  _row("token", 1.0, 4, 2.1 * scale, 2.9 * scale, be=2.6),
                  _row("block", 1.0, 4, 2.3 * scale, 3.4 * scale, be=2.9),
                  _row("autoregressive", 1.0, None, 1.6 * scale, 2.0 * scale, repeat=1),
              ])


def test_analyse_figures_and_verdicts():
  hf = dict(engine="hf", prompt_ids=[[1, 2]], stop_ids=[7], peak_rss_gb=8.0, results=[
      dict(method="autoregressive", temperature=1.0, gamma=None, tokens_per_s=1.5, tokens_generated=96,
           target_calls=96, wall_s=64.0),
      dict(method="assisted", temperature=1.0, gamma=4, tokens_per_s=1.5, block_efficiency=2.5, tokens_generated=96,
           target_calls=38, wall_s=64.0)])
  bf16 = _ours("bfloat16", scale=0.5)
  out = peer_analysis.analyse(_ours(), bf16, hf)
  costs, checks = out["costs"], out["checks"]
  assert costs["float32"]["c"] == pytest.approx(0.4)
  assert costs["float32"]["v"] == pytest.approx({1: 1.0, 3: 1.2, 5: 1.4})
  block4 = next(r for r in out["rows"] if r["engine"] == "ours-f32" and r["method"] == "block" and r["gamma"] == 4)
  # Baselines: the faster autoregressive pass (2.0 end to end, 2.5 decode), not the slower one after the sweep.
  assert block4["speedup"] == pytest.approx(2.3 / 2.0)
  assert block4["decode_speedup"] == pytest.approx(3.4 / 2.5)
  assert block4["ideal"] == pytest.approx(2.9 / (1 + 4 * 0.4))
  assert block4["ideal_refined"] == pytest.approx(2.9 / (4 * 0.4 + 1.4))
  # The loop's own autoregressive step: 1 / 2.5 tok/s = 400 ms, so c = 100 / 400 = 0.25 there.
  assert costs["float32"]["c_loop"] == {"1.0": pytest.approx(0.25)}
  assert block4["ideal_loop"] == pytest.approx(2.9 / (1 + 4 * 0.25))
  a2, a4 = sorted(checks["a"], key=lambda a: a["gamma"])
  assert a4["decode_ratio"] == pytest.approx((3.4 / 2.5) / (2.9 / 2.6)) and a4["decode_passed"] and a4["passed"]
  # γ = 2: ideal 2.4 / 1.8 = 1.33; decode phase 1.28 (96%) passes, end to end 1.10 (82.5%) misses.
  assert a2["ratio"] == pytest.approx(0.825) and not a2["passed"]
  assert a2["decode_ratio"] == pytest.approx(0.96) and a2["decode_passed"]
  assert checks["drift"]["1.0"] == dict(tokens_per_s=[2.0, 1.6], decode_tokens_per_s=[2.5, 2.0])
  fastest = checks["fastest"]["1.0"]
  assert (fastest["gamma"], fastest["method"]) == (2, "token")
  assert (fastest["decode_gamma"], fastest["decode_method"]) == (4, "block")
  assert [(c["gamma"], c["passed"]) for c in checks["c"]] == [(2, True), (4, True)]
  assert checks["c"][1]["gain"] == pytest.approx(2.9 / 2.6 - 1)
  (b,) = checks["b"]
  assert b["ratio"] == pytest.approx(2.3 / 1.5) and b["passed"]
  # bf16 rows pair with the f32 row of the same method, γ and pass.
  ar_again = next(x for x in checks["bf16"] if x["method"] == "autoregressive" and x["repeat"] == 1)
  assert ar_again["bf16"] == pytest.approx(0.8) and ar_again["ratio"] == pytest.approx(0.5)
  assert len(checks["bf16"]) == 6


def test_report_prints(capsys):
  args = bench_peer.parse_args(["--quick"])
  ours = _ours()
  out = peer_analysis.analyse(ours, {}, {})
  peer_report.print_report(out, ours, {}, {}, args)
  printed = capsys.readouterr().out
  assert "drift at T=1" in printed and "(a) T=1 γ=4: decode phase 1.36x" in printed
  assert "autoregressive (again)" in printed and "c = 0.400" in printed


def test_interleaved_median_ms_times_round_robin_after_one_warm_up_each():
  from blockspec_jax.eval import bench_verify
  order = []
  calls = {name: (lambda n=name: order.append(n) or n, ()) for name in ("a", "b", "c")}
  out = bench_verify.interleaved_median_ms(calls, reps=3)
  assert order == ["a", "b", "c"] * 4  # warm-up round, then 3 timed rounds, every call once per round
  assert set(out) == {"a", "b", "c"} and all(ms >= 0 for ms in out.values())
  assert bench_verify.median_ms(lambda: order.append("x"), (), 2) >= 0 and order[-3:] == ["x"] * 3


def test_time_breakdown_splits_an_iteration_into_forwards_and_the_rest():
  checks = peer_analysis.analyse(_ours(), {}, {})["checks"]
  ar = next(b for b in checks["time"] if b["method"] == "autoregressive")
  assert ar["iteration_ms"] == pytest.approx(400.0) and ar["rest_ms"] == pytest.approx(150.0)  # 96 / 2.5 s, 96 steps
  assert len([b for b in checks["time"] if b["method"] == "autoregressive"]) == 1  # not the pass after the sweep
  b4 = next(b for b in checks["time"] if b["method"] == "block" and b["gamma"] == 4)
  # 96 / 3.4 s over 40 iterations = 705.9 ms = 4 x 100 (drafter) + 350 (5-token target pass) + rest.
  assert b4["iteration_ms"] == pytest.approx(1e3 * 96 / 3.4 / 40)
  assert (b4["drafter_ms"], b4["verify_ms"]) == (400.0, 350.0)
  assert b4["rest_ms"] == pytest.approx(b4["iteration_ms"] - 750.0) and b4["tokens_per_call"] == pytest.approx(2.4)


def test_from_json_reprints_a_saved_run(tmp_path, capsys):
  args = bench_peer.parse_args(["--quick"])
  config = {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")}
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(dict(config=config, workers=dict(ours=_ours(), bf16={}, hf={}))))
  assert bench_peer.main(["--from-json", str(path)]) == 0
  printed = capsys.readouterr().out
  assert "(a) T=1 γ=4: decode phase 1.36x" in printed and "time T=1 block γ=4: 706 ms per iteration" in printed
  path.write_text("{}")
  with pytest.raises(SystemExit, match="not a bench_peer JSON"):
    bench_peer.main(["--from-json", str(path)])


def test_gguf_rows_compare_ours_on_quantized_weights_with_llama_cpp(capsys):
  quant = dict(prompt_ids=[[1, 2]], peak_rss_gb=3.8, results=[
      _row("autoregressive", 0.0, None, 5.0, 10.0), _row("block", 0.0, 4, 6.0, 12.5, be=3.0),
      _row("autoregressive", 0.0, None, 4.0, 9.0, repeat=1)])
  llama = dict(prompt_ids=[[1, 2]], peak_rss_gb=2.1, results=[_row("autoregressive", 0.0, None, 20.0, 25.0)])
  peer_report.print_gguf_rows({}, quant, llama)
  printed = capsys.readouterr().out
  assert "ours quantized   autoregressive   0  - |   5.00   10.00" in printed and "0.40" in printed  # 10 / 25
  assert "ours quantized   block            0  4 |   6.00   12.50" in printed and "0.50" in printed
  assert "ours quantized autoregressive at T=0: 0.40 of llama.cpp's decode rate (target ≥ 0.8) MISS" in printed
  assert "(again)" not in printed and "WARNING" not in printed
  peer_report.print_gguf_rows({}, {}, {})
  assert capsys.readouterr().out == ""
  with pytest.raises(SystemExit):
    bench_peer.parse_args(["--engines", "ours,llama"])


def test_llama_cpp_engine_decodes_one_token_at_a_time_and_names_its_extra(monkeypatch):
  """The llama.cpp worker's loop on a stand-in model: the prompt evaluated once, then each sampled token fed back,
  until a stop id or the budget, sampling from the full distribution at the given temperature; without the bindings
  installed, the error names the package and its build flags."""
  import sys
  from blockspec_jax.eval import peer_llamacpp

  class Stub:
    def __init__(self):
      self.evals, self.samples = [], []

    def reset(self):
      self.evals.append("reset")

    def eval(self, ids):
      self.evals.append(list(ids))

    def sample(self, **kw):
      self.samples.append(kw)
      return 10 + len(self.samples)

  llm = Stub()
  out = peer_llamacpp.decode(llm, [1, 2, 3], 1.0, max_new_tokens=4, stop_ids=[99])
  assert out["ids"] == [11, 12, 13, 14] and llm.evals == ["reset", [1, 2, 3], [11], [12], [13]]
  assert llm.samples[0] == dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, temp=1.0, repeat_penalty=1.0)
  llm = Stub()
  assert peer_llamacpp.decode(llm, [5], 0.0, max_new_tokens=8, stop_ids=[12])["ids"] == [11, 12]  # the stop id kept
  assert out["prefill_s"] >= 0 and out["decode_s"] >= 0
  monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
  with pytest.raises(SystemExit, match=r"llama-cpp-python==0\.3\.36.*GGML_NATIVE=OFF"):
    peer_llamacpp.import_llama_cpp()
