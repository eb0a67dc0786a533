"""Time-to-first-result benchmark (blockspec_jax.eval.bench_startup): the work it counts is exact, the job runs on
SmolLM2 and reports every figure, bad settings fail in one line before a model loads."""

import json

import gin
import jax
import jax.numpy as jnp
import pytest

from blockspec_jax import sources
from blockspec_jax.eval import bench_startup
from blockspec_jax.models import decoder as dec
from helpers import tiny_config


def test_linear_params_counts_the_layers_linear_weights_only():
  config = tiny_config(vocab_size=64)  # D 32, F 64, 4 heads / 2 KV of 8, 2 layers
  params = dec.init_params(config, 0)
  d, f, kv = 32, 64, 2 * 8
  per_layer = d * d + 2 * kv * d + d * d + 3 * d * f  # q, k and v, o, gate / up / down
  assert bench_startup.linear_params(params) == 2 * per_layer
  assert bench_startup.linear_params(dec.stack_layers(params, 2)) == 2 * per_layer  # the stacked layout counts alike


def test_matmul_peak_and_memory_bandwidth_are_positive_rates():
  assert bench_startup.matmul_gflops(128, jnp.float32, repeats=2) > 0
  assert bench_startup.memory_gbps(8, repeats=2) > 0


@pytest.mark.parametrize("tie", [False, True])
def test_decode_weight_bytes_reads_the_embedding_table_only_when_it_is_the_lm_head(tie):
  config = tiny_config(vocab_size=64, tie_embeddings=tie)
  params = dec.init_params(config, 0)
  every = sum(leaf.size * 4 for leaf in jax.tree_util.tree_leaves(params))  # float32
  table = 64 * 32 * 4
  assert bench_startup.decode_weight_bytes(params, tie) == (every if tie else every - table)
  bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert bench_startup.decode_weight_bytes(bf16, tie) * 2 == bench_startup.decode_weight_bytes(params, tie)


def test_bench_on_smollm2_reports_every_figure(tmp_path, capsys):
  out = tmp_path / "startup.json"
  gin.clear_config()
  try:
    assert bench_startup.main(["--gin_param", "bench_startup.target = 'smollm2-135m'",
                               "--gin_param", "bench_startup.drafter = 'smollm2-135m'",
                               "--gin_param", "bench_startup.gamma = 2",
                               "--gin_param", "bench_startup.dtypes = ('float32',)",
                               "--gin_param", "bench_startup.layouts = ('scanned',)",
                               "--gin_param", "bench_startup.weights = ('quantized',)",
                               "--gin_param", "bench_startup.verify_tokens = (3, 5)",
                               "--gin_param", "bench_startup.prompt_width = 32",
                               "--gin_param", "bench_startup.max_new_tokens = 4",
                               "--gin_param", "bench_startup.matmul_size = 256",
                               "--gin_param", "bench_startup.bandwidth_mib = 16",
                               "--gin_param", "bench_startup.repeats = 1",
                               "--gin_param", f"bench_startup.output_json = '{out}'"]) == 0
  finally:
    gin.clear_config()
  report = json.loads(out.read_text())
  # bfloat16, the unrolled layout and dequantized weights run the same code (docs/results: every dtype and layout)
  assert [(r["dtype"], r["layout"], r["weights"]) for r in report["rows"]] == [("float32", "scanned", "quantized")]
  for r in report["rows"]:
    for key in ("matmul_gflops", "load_s", "prefill_lower_s", "prefill_compile_s", "decode_lower_s",
                "decode_compile_s", "prefill_s", "prefill_tokens_per_s", "prefill_gflops", "decode_tokens_per_s",
                "first_token_s", "prefill_fraction_of_peak", "decode_bytes_per_token", "decode_roofline_tokens_per_s",
                "decode_fraction_of_roofline"):
      assert r[key] > 0, key
    assert r["prefill_tokens_per_s"] == pytest.approx(32 / r["prefill_s"])
    assert r["prefill_fraction_of_peak"] == pytest.approx(r["prefill_gflops"] / r["matmul_gflops"])
    roofline = report["memory_gbps"] * 1e9 / r["decode_bytes_per_token"]
    assert r["decode_roofline_tokens_per_s"] == pytest.approx(roofline)
    assert r["decode_fraction_of_roofline"] == pytest.approx(r["decode_tokens_per_s"] / roofline)
    assert r["block_compile_s"] == pytest.approx(sum(r[f"block_{k}"] for k in (
        "prefill_lower_s", "prefill_compile_s", "decode_lower_s", "decode_compile_s")))
    assert r["block_first_token_s"] > r["block_compile_s"] > 0 and r["drafter_load_s"] > 0
    assert 40e6 < r["decode_bytes_per_token"] < 100e6  # SmolLM2's Q4_1 layers and Q8_0 head as stored (float32: 540 MB)
    assert sorted(r["forward_ms"]) == ["1", "3", "5"] and sorted(r["verify_cost"]) == ["2", "4"]
    assert r["verify_cost"]["2"] == pytest.approx(r["forward_ms"]["3"] / r["forward_ms"]["1"])
  assert "first token s" in capsys.readouterr().out


@pytest.mark.parametrize("param, message", [("bench_startup.prompt_width = 0", "prompt_width"),
                                            ("bench_startup.dtypes = ('float16',)", "dtype must be"),
                                            ("bench_startup.target = 'nope'", "nope"),
                                            ("bench_startup.gamma = 0", "gamma must be"),
                                            ("bench_startup.bandwidth_mib = 0", "bandwidth_mib"),
                                            ("bench_startup.layouts = ('stacked',)", "layouts must name"),
                                            ("bench_startup.weights = ('int4',)", "weights must name"),
                                            ("bench_startup.verify_tokens = (0,)", "verify_tokens must be")])
def test_bad_settings_fail_before_a_model_loads(param, message, capsys, monkeypatch):
  monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  gin.clear_config()
  try:
    with pytest.raises(SystemExit) as exc:
      bench_startup.main(["--gin_param", param])
  finally:
    gin.clear_config()
  assert exc.value.code == 2 and message in capsys.readouterr().err
