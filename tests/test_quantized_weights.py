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
  float32 kernel's order: the same logits, bit for bit, so the same greedy tokens."""
  from blockspec_jax.decoding import speculative as spec
  dense, quantized = smol
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
