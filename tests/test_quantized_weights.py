"""Quantized weights through the whole model: ``hub.load_model(weights="quantized")`` keeps SmolLM2's GGUF blocks as
stored (Q4_1 layers, a Q8_0 embedding that is also the tied head), and the decoder computes with exactly the weights
of the dequantized model: every weight bit for bit, the logits bit for bit on the CPU kernel path, the same greedy
tokens, unrolled and stacked; the cache file round-trips and a damaged one is refused."""

import collections
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.models import decoder as dec
from blockspec_jax import sampling
from blockspec_jax.models import hub, quant

PROMPTS = [[1, 504, 3458, 314, 260, 1462, 28], [30, 7263, 2], [17, 19, 23, 29, 31]]


@pytest.fixture(scope="module")
def smol():
  """(dequantized, quantized) SmolLM2-135M, unrolled."""
  return hub.load_model("smollm2-135m", progress=False), hub.load_model("smollm2-135m", progress=False,
                                                                        weights="quantized")


def _leaves(model) -> dict:
  return dict(hub._named_leaves(model.params["params"]))


def test_the_quantized_model_holds_the_dequantized_weights_bit_for_bit(smol):
  dense, quantized = smol
  assert quantized.config == dense.config
  a, b = _leaves(dense), _leaves(quantized)
  assert a.keys() == b.keys()
  kinds = collections.Counter()
  for key, value in b.items():
    if isinstance(value, quant.QuantizedTensor):
      kinds[value.qtype] += 1
      want = np.asarray(a[key])
      np.testing.assert_array_equal(quant.dequantize_np(value).view(np.uint32), want.view(np.uint32), err_msg=key)
    else:
      np.testing.assert_array_equal(np.asarray(value), np.asarray(a[key]), err_msg=key)
  assert kinds == {"Q4_1": 210, "Q8_0": 1}  # 30 layers x 7 linear weights; the embedding (= the tied head)
  dense_bytes = sum(np.asarray(v).nbytes for v in a.values())
  quant_bytes = sum(quant.nbytes(v) if isinstance(v, quant.QuantizedTensor) else np.asarray(v).nbytes
                    for v in b.values())
  print(f"SmolLM2 parameters: float32 {dense_bytes / 2**20:.1f} MiB, quantized {quant_bytes / 2**20:.1f} MiB")
  assert quant_bytes < dense_bytes / 3


def _logits(model, prompts):
  tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  cache = dec.init_cache(model.config, len(prompts), tokens.shape[1])

  @jax.jit
  def run(params, tokens):
    return dec.Decoder(model.config).apply(params, tokens, positions, cache,
                                           dec.causal_mask(positions, tokens.shape[1]))[0]

  return np.asarray(run(model.params, jnp.asarray(tokens)))


def test_logits_and_greedy_tokens_are_the_dequantized_models(smol):
  """The CPU kernel dequantizes each weight to the dequantized model's float32 value in registers and sums in the
  float32 kernel's order: the same logits, bit for bit, so the same greedy tokens. (In the stacked layout, which
  compiles one layer body; stacked = unrolled is the next test.)"""
  from blockspec_jax.decoding import speculative as spec
  dense, quantized = (hub.scanned(m) for m in smol)
  np.testing.assert_array_equal(_logits(quantized, PROMPTS), _logits(dense, PROMPTS))
  tokens, lens = spec.prepare_prompts(PROMPTS)
  keys = jax.random.split(jax.random.key(0), len(PROMPTS))
  runs = [spec.generate_autoregressive(m.params["params"], keys, tokens, lens, target=m.config, max_new_tokens=12,
                                       sampler=sampling.Sampler(0.0)).tokens_BxN for m in (dense, quantized)]
  np.testing.assert_array_equal(np.asarray(runs[1]), np.asarray(runs[0]))


def test_stacked_quantized_layers_give_the_unrolled_logits(smol):
  """Every SmolLM2 layer stores its weights in Q4_1, so the layers stack (codes and scales get an L axis) and the
  scanned decoder computes what the unrolled one does."""
  _, quantized = smol
  stacked = hub.scanned(quantized)
  q = stacked.params["params"]["layers"]["attn"]["q"]["weight"]
  assert isinstance(q, quant.QuantizedTensor) and q.codes_OxC.shape[0] == 30 and q.shape == (576, 576)
  np.testing.assert_array_equal(_logits(stacked, PROMPTS[:2]), _logits(quantized, PROMPTS[:2]))


def _fake(qtype, rows=4, cols=256, seed=0):
  """A QuantizedTensor of random valid blocks (scales 2^-8 as float16)."""
  layout = quant.layout_of(qtype)
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (rows, cols // layout.block, layout.type_size), dtype=np.uint8)
  for at in quant.F16_FIELDS[qtype]:
    raw[..., at:at + 2] = np.frombuffer(np.float16(2 ** -8).tobytes(), np.uint8)
  return quant.quantize_from_gguf(raw.reshape(-1), qtype, (rows, cols))


def test_layers_of_different_block_types_do_not_stack_and_the_error_says_so():
  layers = {f"layers_{i}": {"mlp": {"down": {"weight": _fake(t, seed=i)}}}
            for i, t in enumerate(["Q4_K", "Q6_K", "Q4_K"])}
  with pytest.raises(ValueError, match=r"mlp/down/weight is stored as Q4_K \(4, 256\) in 2 layers, Q6_K \(4, 256\) "
                                       r"in 1 layers.*scan_layers=False"):
    dec.stack_layers(layers, 3)
  same = {f"layers_{i}": {"w": _fake("Q4_K", seed=i)} for i in range(3)}
  stacked = dec.stack_layers(same, 3)["layers"]["w"]
  assert stacked.codes_OxC.shape == (3, 4, 128) and stacked.shape == (4, 256)
  for i in range(3):  # unstacking gives each layer back
    back = dec.unstack_layers({"layers": {"w": stacked}})[f"layers_{i}"]["w"]
    np.testing.assert_array_equal(quant.dequantize_np(back), quant.dequantize_np(same[f"layers_{i}"]["w"]))


def test_a_sound_cache_that_cannot_be_stacked_is_kept(smol, monkeypatch):
  """Asking a mixed-type model (Qwen 1.5B's Q4_K_M) for the stacked layout raises the layout's error and keeps the
  converted file: it is not damaged, and converting it again would end in the same error."""
  from blockspec_jax.models import registry, stacking
  path = hub.converted_cache_path("smollm2-135m", weights="quantized")
  before = registry.file_id(path)

  def mixed(*args, **kwargs):
    raise stacking.UnstackableLayers("stack_layers: attn/v/weight is stored as Q4_K and Q6_K")

  monkeypatch.setattr(hub, "_load", mixed)
  with pytest.raises(stacking.UnstackableLayers, match="attn/v/weight"):
    hub.load_model("smollm2-135m", weights="quantized", scan_layers=True, progress=False)
  assert registry.file_id(path) == before and path.exists()


def test_the_quantized_cache_reads_back_and_a_damaged_one_is_refused(smol, tmp_path):
  _, quantized = smol
  path = hub.converted_cache_path("smollm2-135m", weights="quantized")
  assert path.name == "smollm2-135m.float32.quantized.npz" and path.exists()
  config, params, _ = hub._load(path, quantized.spec, "float32", weights="quantized")
  assert config == quantized.config
  got, want = dict(hub._named_leaves(params["params"])), _leaves(quantized)
  assert got.keys() == want.keys()
  for key in want:
    for a, b in zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="weights"):  # the quantized file is not the dequantized one, and back
    hub._load(path, quantized.spec, "float32")
  damaged = tmp_path / path.name
  shutil.copyfile(path, damaged)
  with open(damaged, "r+b") as f:  # a bit flipped in the middle of the file: inside some member's codes
    f.seek(damaged.stat().st_size // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0x10]))
  with pytest.raises(ValueError, match="CRC-32 mismatch"):
    hub._load(damaged, quantized.spec, "float32", weights="quantized")


def test_weights_argument_errors(tmp_path):
  with pytest.raises(ValueError, match=r"weights must be one of \('dequantized', 'quantized'\), got 'int4'"):
    hub.load_model("smollm2-135m", weights="int4")
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="needs a GGUF file"):
    hub.load_model(str(tmp_path), weights="quantized")


def _trained_run(workdir, recipe, seed):
  """A training run's directory holding ``recipe`` and one checkpoint of its trainable tree, every trainable leaf
  moved off its initial value (LoRA's zero ``B`` included) so that the trained part matters."""
  from blockspec_jax.train import checkpoints as checkpoints_lib
  from blockspec_jax.train import recipe as recipe_lib
  base = hub.load_model(recipe.base, progress=False)
  parts = recipe.split(*recipe.derive(base.config, base.params["params"]))
  leaves, treedef = jax.tree.flatten(parts.trainable)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  moved = [leaf + 0.02 * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)]
  workdir.mkdir()
  recipe_lib.save_recipe(workdir, recipe)
  manager = checkpoints_lib.make_manager(workdir / "checkpoints", max_to_keep=1, every=1)
  checkpoints_lib.save(manager, 5, {"trainable": jax.tree.unflatten(treedef, moved)}, force=True)
  manager.close()
  return str(workdir)


def _strip_adapters(tree):
  return {k: _strip_adapters(v) for k, v in tree.items() if k not in ("lora_a", "lora_b")} if isinstance(tree, dict) \
      else tree


def test_trained_drafters_load_over_the_quantized_base(smol, tmp_path):
  """A LoRA drafter keeps its base's GGUF blocks with the adapters beside them (``x W^T + (x A^T)(sB)^T``: the
  merged weight's function, other float32 roundings), stacked as unrolled, and decodes the dequantized drafter's
  greedy tokens; a drafter of trained layers over the frozen quantized embedding (= tied head) computes what the
  dequantized one does, bit for bit."""
  from blockspec_jax import sources
  from blockspec_jax.decoding import speculative as spec
  from blockspec_jax.train import recipe as recipe_lib
  lora = _trained_run(tmp_path / "lora", recipe_lib.DrafterRecipe("smollm2-135m", layers=(0, 1, 29), lora_rank=4,
                                                                  lora_targets=("q", "v", "down")), seed=1)
  subset = _trained_run(tmp_path / "subset", recipe_lib.DrafterRecipe("smollm2-135m", layers=(0, 1, 29),
                                                                      train_modules=("final_norm",)), seed=2)
  # Trained layers and a quantized embedding: the same logits as the dequantized drafter, bit for bit.
  dense, quantized = (sources.load_model(subset, progress=False, weights=w) for w in hub.WEIGHTS)
  q_leaves = _leaves(quantized)
  assert isinstance(q_leaves["embed.embedding"], quant.QuantizedTensor) and quantized.config == dense.config
  assert not any(k.endswith("lora_a") for k in q_leaves) and quantized.spec.name == dense.spec.name
  np.testing.assert_array_equal(_logits(quantized, PROMPTS[:2]), _logits(dense, PROMPTS[:2]))
  # LoRA beside quantized weights.
  dense, quantized = (sources.load_model(lora, progress=False, weights=w) for w in hub.WEIGHTS)
  q_leaves = _leaves(quantized)
  adapted = [k for k in q_leaves if k.endswith("lora_a")]
  assert len(adapted) == 3 * 3 and isinstance(q_leaves[adapted[0].replace("lora_a", "weight")], quant.QuantizedTensor)
  want, got = _logits(dense, PROMPTS), _logits(quantized, PROMPTS)
  unadapted = hub.LoadedModel(config=quantized.config, params={"params": _strip_adapters(quantized.params["params"])},
                              tokenizer=quantized.tokenizer, spec=quantized.spec)
  assert np.abs(got - _logits(unadapted, PROMPTS)).max() > 1e-2  # the adapters change the function
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
  stacked = sources.load_model(lora, progress=False, weights="quantized", scan_layers=True)
  assert stacked.params["params"]["layers"]["attn"]["q"]["lora_a"].shape == (3, 4, 576)
  np.testing.assert_array_equal(_logits(stacked, PROMPTS), got)
  tokens, lens = spec.prepare_prompts(PROMPTS)
  keys = jax.random.split(jax.random.key(0), len(PROMPTS))
  dense_ids, quant_ids = (np.asarray(spec.generate_autoregressive(
      m.params["params"], keys, tokens, lens, target=m.config, max_new_tokens=6, sampler=sampling.Sampler(0.0)
  ).tokens_BxN) for m in (dense, quantized))
  np.testing.assert_array_equal(quant_ids, dense_ids)


def test_bpd_heads_read_the_quantized_targets_head_bit_for_bit(smol):
  """BPD heads apply the target's own LM head (here SmolLM2's tied Q8_0 embedding) to their outputs: over the
  quantized target the same logits, bit for bit, as over the dequantized one."""
  from blockspec_jax.drafters import heads as heads_lib
  dense, quantized = smol
  heads = heads_lib.init_heads(dense.config.d_model, 3, jax.random.key(3))
  heads["w2_HxDxD"] = 0.05 * jax.random.normal(jax.random.key(5), heads["w2_HxDxD"].shape)  # trained-like heads
  hidden_BxD = jax.random.normal(jax.random.key(4), (2, dense.config.d_model))
  got, want = (np.asarray(heads_lib.heads_logits(
      {"heads": heads, "lm_head": heads_lib.lm_head_weight(m.config, m.params["params"])}, m.config, hidden_BxD, 3))
      for m in (quantized, dense))
  assert isinstance(heads_lib.lm_head_weight(quantized.config, quantized.params["params"]), quant.QuantizedTensor)
  assert got.shape == (2, 3, dense.config.vocab_size)
  np.testing.assert_array_equal(got, want)


def test_training_jobs_load_the_quantized_target_and_check_the_setting():
  """``<job>.target_weights = "quantized"``: the target loads with its GGUF blocks (its samples go through
  ``generate_autoregressive``, whose tokens equal the dequantized model's above) and a drafter of the same name that
  trains loads dequantized beside it; the setting is checked before any model loads and recorded with cached
  samples only when quantized (earlier files stay valid)."""
  from blockspec_jax import checks
  from blockspec_jax.train import job_setup, pools
  from blockspec_jax.train.distill_job import DistillSettings
  from blockspec_jax.train.recipe import DrafterRecipe
  from blockspec_jax.train.sprinter_job import SprinterSettings
  settings = SprinterSettings(target="smollm2-135m", drafter="smollm2-135m", target_weights="quantized")
  target, drafter = job_setup._load(settings, True, lambda *_: "loaded")
  assert isinstance(target.params["params"]["embed"]["embedding"], quant.QuantizedTensor)
  assert not isinstance(drafter.params["params"]["embed"]["embedding"], quant.QuantizedTensor)
  assert settings.meta()["target_weights"] == "quantized"
  assert pools.samples_meta("smollm2-135m", 0, settings.weights_meta())["target_weights"] == "quantized"
  plain = SprinterSettings(target="smollm2-135m", drafter="smollm2-135m")
  assert "target_weights" not in plain.meta() and "target_weights" not in pools.samples_meta(
      "smollm2-135m", 0, plain.weights_meta())
  with pytest.raises(checks.UsageError, match=r"distill_job.target_weights must be one of \('dequantized', "
                                              r"'quantized'\), got 'int4'"):
    DistillSettings(target="smollm2-135m", drafter=DrafterRecipe("smollm2-135m"), target_weights="int4")
  with pytest.raises(checks.UsageError, match="distill_job.target_weights = 'quantized' is for a real target"):
    DistillSettings(target_config=target.config, drafter_config=target.config, target_weights="quantized")


@pytest.mark.slow  # two SmolLM2 loads and sampling programs; the same tokens from both kinds: tested by default above
def test_bench_target_sampling_prints_both_kinds_and_the_same_tokens(capsys):
  from blockspec_jax.eval import bench_target_sampling
  bench_target_sampling.main(["--target", "smollm2-135m", "--rows", "2", "--batch", "2", "--max-new-tokens", "3"])
  printed = capsys.readouterr().out
  assert "dequantized: prompts of" in printed and "quantized: prompts of" in printed and "(width 352)" in printed
  assert "same sampled tokens: True" in printed
  with pytest.raises(SystemExit, match="must be a positive multiple of --batch"):
    bench_target_sampling.main(["--rows", "3", "--batch", "2"])
