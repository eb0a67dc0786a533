"""Bring your own checkpoint: ``hub.load_model`` on a GGUF file path and on Hugging Face checkpoint directories.

* Tiny random llama / qwen2 / gemma3_text / gemma3 (multimodal) models written by transformers' ``save_pretrained``
  (one of them sharded): our logits equal transformers' on the same directory (every weight name, the gemma3
  ``1 + w`` norms, local layers, query_pre_attn_scalar, tied heads).
* SmolLM2-135M (the registry GGUF, already cached by the real-model tests) rewritten by transformers as an HF
  directory: ``load_model(dir)`` equals ``load_model("smollm2-135m")`` (logits, greedy tokens, tokenizer ids, special
  tokens, chat template); ``load_model(path_to_gguf)`` equals it too and is cached by the file's SHA-256.
* Every error: missing path, unknown name, non-GGUF file, each missing file of a directory (and a missing shard),
  unsupported model_type / architectures / rope scaling, missing, extra and misshapen tensors.

Qwen2.5-Coder-0.5B and Gemma 3 270M variants of the SmolLM2 check are marked ``heavy``.
"""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.models import Decoder, causal_mask, gguf_convert, hf_convert, hub, init_cache, registry

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# The two SmolLM2 paths hold bit-equal weights and differ only in the rotary layout (GGUF's permuted q/k rows with
# interleaved pairs vs HF's rotate-half): float rounding only. Measured max |Δ| 7.2e-5 to 7.8e-5 (logits up to ~34).
LOGIT_ATOL = 2e-4
TINY_ATOL = 1e-5
NUM_NEW_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 * 23?\nA:",
]
TEXTS = [
    "Hello, world!",
    "",
    "  leading  spaces\tand\ttabs\n\n\nnew lines   ",
    "Numbers 1234567890, 3.14159 and 0x1F",
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\r\n",
    "Ünïcödé: naïve café, 日本語のテキスト, Привет мир, emoji 🙂🚀",
    "<|im_start|>user\nhi<|im_end|>\n",
]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _logits_and_greedy(model, prompts_ids, num_new):
  """``(f32 [B, V] logits at each prompt's last position, int [B, num_new] greedy tokens)`` by full forwards over
  one fixed [B, P + num_new] buffer: a single compile per config (``generate_autoregressive`` is tested elsewhere;
  here only the weights and the config are in question)."""
  b = len(prompts_ids)
  lengths_B = np.array([len(p) for p in prompts_ids], np.int32)
  width = int(lengths_B.max()) + num_new
  tokens_BxL = np.zeros((b, width), np.int32)
  for i, ids in enumerate(prompts_ids):
    tokens_BxL[i, :len(ids)] = ids
  positions_BxL = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (b, width))
  config = model.config

  @jax.jit
  def last_logits(params, tokens_BxL, lengths_B):
    mask = causal_mask(positions_BxL, width, lengths_B)
    logits_BxLxV, _ = Decoder(config).apply(params, tokens_BxL, positions_BxL, init_cache(config, b, width), mask)
    return logits_BxLxV[jnp.arange(b), lengths_B - 1]

  first, generated = None, []
  for _ in range(num_new):
    logits_BxV = np.asarray(last_logits(model.params, tokens_BxL, lengths_B))
    first = logits_BxV if first is None else first
    next_B = logits_BxV.argmax(-1)
    tokens_BxL[np.arange(b), lengths_B] = next_B
    generated.append(next_B)
    lengths_B = lengths_B + 1
  return first, np.stack(generated, axis=1)


def _hf_dir_from_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
  """Write the HF checkpoint directory transformers makes of a GGUF (float32 weights, tokenizer.json...)."""
  tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                            dtype=torch.float32)
  # The weights are dequantised float32 tensors; transformers only refuses to save because the GGUF quantizer is
  # still attached.
  model.hf_quantizer = None
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  model.save_pretrained(out_dir, safe_serialization=True)
  tok.save_pretrained(out_dir)
  del model
  return out_dir


def _check_same_model(ours, reference, prompts_ids, name, atol=0.0, rel=0.0):
  """Logits at the prompts' last positions within ``atol + rel * max |reference logit|`` and equal greedy
  continuations."""
  ours_logits, ours_greedy = _logits_and_greedy(ours, prompts_ids, NUM_NEW_TOKENS)
  ref_logits, ref_greedy = _logits_and_greedy(reference, prompts_ids, NUM_NEW_TOKENS)
  atol = atol + rel * float(np.abs(ref_logits).max())
  max_diff = float(np.abs(ours_logits - ref_logits).max())
  print(f"\n{name}: max |Δ last-position logit| = {max_diff:.3g} (max |logit| {float(np.abs(ref_logits).max()):.1f}, "
        f"atol {atol:.3g}); greedy rows equal: {[bool(r) for r in (ours_greedy == ref_greedy).all(axis=1)]}")
  np.testing.assert_allclose(ours_logits, ref_logits, atol=atol, rtol=0)
  np.testing.assert_array_equal(ours_greedy, ref_greedy)


def _check_same_tokenizer(ours, reference, texts):
  for text in texts:
    assert ours.encode(text) == reference.encode(text), text
    assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
  assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.add_eos) == (reference.bos_id, reference.eos_id,
                                                                    reference.add_bos, reference.add_eos)
  assert ours.encode(texts[0], add_special_tokens=True) == reference.encode(texts[0], add_special_tokens=True)


def _tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy_dir(src: pathlib.Path, dst: pathlib.Path, skip=()) -> pathlib.Path:
  """``dst`` with symlinks to ``src``'s files (cheap copies of big checkpoints), minus ``skip``."""
  dst.mkdir()
  for f in src.iterdir():
    if f.name not in skip:
      (dst / f.name).symlink_to(f)
  return dst


# ----------------------------------------------------------------------------------------------------------------
# Tiny random models of each family, written by transformers


def _tiny_tokenizer_json(path: pathlib.Path, vocab_size: int):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
  vocab.update({f"w{i}": i for i in range(4, vocab_size)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path))


def _tiny_config(family: str):
  common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)
  if family == "llama":
    return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                    rms_norm_eps=1e-5, tie_word_embeddings=False)
  if family == "qwen2":
    return transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                                    tie_word_embeddings=True)
  text = dict(common, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})
  if family == "gemma3_text":
    return transformers.Gemma3TextConfig(**text)
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14)
  return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                   image_token_index=299, boi_token_index=297, eoi_token_index=298)


TINY_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "gemma3": "Gemma3ForConditionalGeneration"}


def _tiny_model(family: str, directory: pathlib.Path, max_shard_size=None):
  """A tiny random ``family`` model saved to ``directory`` (with a tokenizer.json); returns the torch model."""
  torch.manual_seed(0)
  model = getattr(transformers, TINY_CLASSES[family])(_tiny_config(family)).eval()
  gemma = family.startswith("gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # gemma norms are w in x * (1 + w): random around 0; the others around 1
        p.normal_(0.0 if gemma else 1.0, 0.3)
      else:
        p.normal_(0.0, 0.2)
  kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
  model.save_pretrained(directory, safe_serialization=True, **kwargs)
  _tiny_tokenizer_json(directory / "tokenizer.json", 300)
  return model


@pytest.mark.parametrize("family", list(TINY_CLASSES))
def test_tiny_hf_models_match_transformers(family, tmp_path):
  sharded = family == "qwen2"
  torch_model = _tiny_model(family, tmp_path, max_shard_size="50KB" if sharded else None)
  files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
  assert (len(files) > 1) == sharded and (tmp_path / "model.safetensors.index.json").exists() == sharded
  model = hub.load_model(tmp_path, progress=False)
  c = model.config
  assert c.rope_style == "half" and c.qkv_bias == (family == "qwen2")
  assert c.tie_embeddings == (family != "llama") and ("lm_head" in model.params["params"]) == (family == "llama")
  if family.startswith("gemma3"):
    assert c.norm_plus_one and c.qk_norm and c.post_norms and c.embed_scale and c.query_scale == 24 ** -0.5
    assert c.layer_types == ("sliding", "sliding", "full") and c.sliding_window == 4
    assert (c.rope_theta, c.rope_theta_local) == (1e6, 1e3)
  ids = np.random.default_rng(0).integers(4, 296, size=(2, 12))
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32)[None], (2, 12))
  ours, _ = Decoder(c).apply(model.params, jnp.asarray(ids, jnp.int32), positions, init_cache(c, 2, 12),
                             causal_mask(positions, 12))
  with torch.no_grad():
    ref = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
  print(f"\n{family}: max |Δ logit| = {float(np.abs(np.asarray(ours) - ref).max()):.3g} "
        f"(max |logit| {float(np.abs(ref).max()):.2f})")
  np.testing.assert_allclose(np.asarray(ours), ref, atol=TINY_ATOL, rtol=1e-5)
  assert (model.tokenizer.bos_id, model.tokenizer.eos_id, model.tokenizer.pad_id) == (2, 1, 0)
  assert model.tokenizer.encode("w5 w17 w299") == [5, 17, 299]


def test_tiny_hf_bfloat16_and_extra_files(tmp_path):
  _tiny_model("gemma3_text", tmp_path)
  f32 = hub.load_model(tmp_path, progress=False)
  bf16 = hub.load_model(str(tmp_path), dtype="bfloat16", progress=False)
  assert bf16.config.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
  np.testing.assert_array_equal(np.asarray(bf16.params["params"]["layers_0"]["attn_norm"]["scale"]),
                                np.asarray(f32.params["params"]["layers_0"]["attn_norm"]["scale"]).astype(
                                    jnp.bfloat16))
  # bfloat16 safetensors (what most released checkpoints hold) read into float32 exactly.
  model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
  bf16_dir = tmp_path / "bf16"
  model.save_pretrained(bf16_dir)
  shutil.copy(tmp_path / "tokenizer.json", bf16_dir)
  (bf16_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": {"content": "<eos>"},
                                                              "add_bos_token": True}))
  (bf16_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  from_bf16 = hub.load_model(bf16_dir, progress=False)
  _tree_equal(from_bf16.params, jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32),
                                             f32.params))
  tok = from_bf16.tokenizer
  assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
  assert tok.encode("w7", add_special_tokens=True) == [2, 7]
  assert tok.apply_chat_template([{"role": "user", "content": "w9"}]) == "w9"


def test_safetensors_reader_matches_the_package(tmp_path):
  from safetensors.numpy import load_file
  _tiny_model("llama", tmp_path)
  path = tmp_path / "model.safetensors"
  theirs = load_file(str(path))
  ours = {name: np.array(value) for name, _, value in hf_convert.iter_tensors([path])}
  assert set(ours) == set(theirs)
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name], value)
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
  with pytest.raises(ValueError, match="not a safetensors file"):
    hf_convert.read_safetensors_header(bad)


# ----------------------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tiny-llama")
  _tiny_model("llama", directory)
  return directory


def test_error_path_does_not_exist(tmp_path):
  for missing in (tmp_path / "no-such-model.gguf", tmp_path / "no-such-dir", "./no-such-dir", "~/no/such.gguf"):
    with pytest.raises(FileNotFoundError, match=r"model path .*no[-/]such.* does not exist.*known models: .*smollm2"):
      hub.load_model(missing, progress=False)


def test_error_unknown_name():
  with pytest.raises(ValueError, match=r"unknown model 'smollm9'.*known models: .*qwen2\.5-coder-0\.5b.*smollm2-135m"
                                       r".*path of a GGUF file or of a Hugging Face checkpoint directory"):
    hub.load_model("smollm9")


def test_error_file_is_not_gguf(tmp_path):
  path = tmp_path / "model.bin"
  path.write_bytes(b"PK\x03\x04 not a gguf")
  with pytest.raises(ValueError, match=r"model\.bin is a file but not a GGUF file"):
    hub.load_model(path)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_error_directory_missing_file(missing, tiny_llama_dir, tmp_path):
  directory = _copy_dir(tiny_llama_dir, tmp_path / "ckpt", skip=(missing,))
  name = "*.safetensors" if missing.endswith(".safetensors") else missing
  with pytest.raises(FileNotFoundError, match=r"not a usable Hugging Face checkpoint directory: missing (\S+)") as e:
    hub.load_model(directory, progress=False)
  listed = str(e.value).split("missing ", 1)[1].split(" (expected")[0]
  assert listed.startswith(name) and listed.count(",") == 0, listed  # exactly the one missing file


def test_error_directory_missing_shard(tiny_llama_dir, tmp_path):
  directory = _copy_dir(tiny_llama_dir, tmp_path / "ckpt", skip=("model.safetensors",))
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
  with pytest.raises(FileNotFoundError, match=r"shards named by model\.safetensors\.index\.json are missing: "
                                              r"\['model-00001-of-00002\.safetensors'\]"):
    hub.load_model(directory, progress=False)


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "mistral", r"model_type 'mistral' is not supported; supported model types: llama, qwen2, "
                              r"gemma3_text, gemma3"),
    ("architectures", ["LlamaForSequenceClassification"],
     r"architecture 'LlamaForSequenceClassification' is not supported for model_type 'llama'; supported "
     r"architectures: LlamaForCausalLM"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
     r"rope type 'llama3' \(llama\) is not supported"),
])
def test_error_unsupported_config(field, value, message, tiny_llama_dir, tmp_path):
  directory = _copy_dir(tiny_llama_dir, tmp_path / "ckpt", skip=("config.json",))
  config = json.loads((tiny_llama_dir / "config.json").read_text())
  config[field] = value
  (directory / "config.json").write_text(json.dumps(config))
  with pytest.raises(NotImplementedError, match=message):
    hub.load_model(directory, progress=False)


_LLAMA_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=3, hidden_size=16,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=32, vocab_size=50)
_GEMMA3_CONFIG = dict(_LLAMA_CONFIG, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=8,
                      sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.mark.parametrize("base,field,value,error,message", [
    (_LLAMA_CONFIG, "hidden_act", "gelu", NotImplementedError,
     r"config\.json: hidden_act 'gelu' is not supported for llama; supported: 'silu'"),
    (_LLAMA_CONFIG, "attention_bias", True, NotImplementedError,
     r"config\.json: attention_bias=true \(llama\) is not supported by Decoder"),
    (_GEMMA3_CONFIG, "final_logit_softcapping", 30.0, NotImplementedError,
     r"config\.json: final_logit_softcapping=30\.0 \(gemma3\) is not supported by Decoder"),
    (_GEMMA3_CONFIG, "hidden_activation", "silu", NotImplementedError,
     r"hidden_activation 'silu' is not supported for gemma3; supported: 'gelu_pytorch_tanh'"),
    (_GEMMA3_CONFIG, "layer_types", ["full_attention"], ValueError,
     r"config\.json: layer_types has 1 entries for 3 layers"),
    (_GEMMA3_CONFIG, "layer_types", "sliding_attention", ValueError, r"layer_types must be a list of strings"),
    (_GEMMA3_CONFIG, "layer_types", ["full_attention", "chunked_attention", "full_attention"], NotImplementedError,
     r"layer_types \['chunked_attention'\] are not supported; supported: \('full_attention', 'sliding_attention'\)"),
])
def test_config_from_hf_names_what_the_decoder_cannot_express(base, field, value, error, message):
  hf_convert.config_from_hf(base)  # the base configs are valid
  with pytest.raises(error, match=message):
    hf_convert.config_from_hf(dict(base, **{field: value}))


def test_config_from_hf_gemma3_layer_kinds_from_the_list_or_the_pattern():
  config = hf_convert.config_from_hf(_GEMMA3_CONFIG)
  assert config.layer_types == ("sliding", "sliding", "full") and config.sliding_window == 4
  assert config.qk_norm and config.post_norms and config.embed_scale
  without_list = {k: v for k, v in _GEMMA3_CONFIG.items() if k != "layer_types"}
  assert hf_convert.config_from_hf(dict(without_list, sliding_window_pattern=2)).layer_types == (
      "sliding", "full", "sliding")
  assert not hf_convert.config_from_hf(_LLAMA_CONFIG).qk_norm


def test_error_missing_and_extra_tensors(tiny_llama_dir, tmp_path):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
  extra = _copy_dir(tiny_llama_dir, tmp_path / "extra", skip=("model.safetensors",))
  save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32),
             "model.layers.7.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]},
            str(extra / "model.safetensors"))
  with pytest.raises(ValueError, match=r"tensors with no place in Decoder \(llama, 3 layers\): "
                                       r"\['model\.layers\.0\.self_attn\.q_norm\.weight', "
                                       r"'model\.layers\.7\.mlp\.up_proj\.weight'\]"):
    hub.load_model(extra, progress=False)
  missing = _copy_dir(tiny_llama_dir, tmp_path / "missing", skip=("model.safetensors",))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(missing / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing tensors for \['layers_1/mlp/up/weight'\] \(e\.g\. "
                                       r"'model\.layers\.1\.mlp\.up_proj\.weight'\)"):
    hub.load_model(missing, progress=False)
  wrong = _copy_dir(tiny_llama_dir, tmp_path / "wrong", skip=("model.safetensors",))
  tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)
  save_file(tensors, str(wrong / "model.safetensors"))
  with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(64, 31\), expected "
                                       r"\(64, 32\)"):
    hub.load_model(wrong, progress=False)


# ----------------------------------------------------------------------------------------------------------------
# SmolLM2-135M: GGUF path, and the HF directory transformers makes of it


@pytest.fixture(scope="module")
def smol_gguf():
  return registry.fetch_gguf("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def smol_ref():
  return hub.load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def smol_hf_dir(tmp_path_factory, smol_gguf):
  return _hf_dir_from_gguf(smol_gguf, tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="module")
def smol_hf(smol_hf_dir):
  return hub.load_model(smol_hf_dir, progress=False)


@pytest.mark.slow  # converts SmolLM2 to an HF directory; tiny HF directories are checked by default
def test_smollm2_hf_dir_config(smol_hf, smol_ref, smol_hf_dir):
  assert isinstance(smol_hf.spec, hub.LocalSource) and smol_hf.spec.kind == "hf"
  assert smol_hf.spec.name == str(smol_hf_dir.resolve())
  assert smol_hf.config.rope_style == "half" and smol_ref.config.rope_style == "interleaved"
  assert dataclasses.replace(smol_hf.config, rope_style="interleaved") == smol_ref.config
  assert "lm_head" not in smol_hf.params["params"]


@pytest.mark.slow  # converts SmolLM2 to an HF directory; tiny HF directories are checked by default
def test_smollm2_hf_dir_matches_gguf(smol_hf, smol_ref):
  prompts_ids = [smol_ref.tokenizer.encode(p) for p in PROMPTS]
  _check_same_model(smol_hf, smol_ref, prompts_ids, "smollm2-135m HF dir vs GGUF", atol=LOGIT_ATOL)


def test_an_hf_dir_loads_in_the_stacked_layout_too(tiny_llama_dir):
  """``scan_layers=True`` on a Hugging Face directory: the same parameters, stacked over the layers."""
  import numpy as np
  from blockspec_jax.models import decoder as dec
  unrolled = hub.load_model(tiny_llama_dir, progress=False)
  stacked = hub.load_model(tiny_llama_dir, progress=False, scan_layers=True)
  assert stacked.config == dataclasses.replace(unrolled.config, scan_layers=True)
  jax.tree.map(np.testing.assert_array_equal, dec.unstack_layers(stacked.params["params"]), unrolled.params["params"])


@pytest.mark.slow  # converts SmolLM2 to an HF directory; its tokenizer alone is checked by default (below)
def test_smollm2_hf_dir_stop_ids(smol_hf, smol_ref):
  assert smol_hf.stop_ids == smol_ref.stop_ids == (2,)


def test_smollm2_hf_tokenizer_matches_gguf(smol_gguf, smol_ref, tmp_path):
  """The tokenizer files transformers writes for SmolLM2's GGUF read back as our GGUF tokenizer: the same ids, pad
  id and chat template (the whole HF directory, weights included, is the slow tier's)."""
  from blockspec_jax.models import hf_convert
  tok = transformers.AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
  tok.save_pretrained(tmp_path)
  ours = hf_convert.tokenizer_from_hf(tmp_path)
  _check_same_tokenizer(ours, smol_ref.tokenizer, TEXTS + PROMPTS)
  assert ours.pad_id == smol_ref.tokenizer.pad_id
  assert ours.apply_chat_template(CHAT) == smol_ref.tokenizer.apply_chat_template(CHAT)


def test_smollm2_gguf_path_matches_registry(smol_gguf, smol_ref, tmp_path, monkeypatch):
  model = hub.load_model(str(smol_gguf), cache_dir=tmp_path, progress=False)
  sha = registry.MODELS["smollm2-135m"].sha256
  assert model.spec == hub.LocalSource(name=str(smol_gguf.resolve()), kind="gguf", path=smol_gguf.resolve(),
                                       sha256=sha)
  assert model.config == smol_ref.config
  _tree_equal(model.params, smol_ref.params)
  assert model.tokenizer.tokenizer.to_str() == smol_ref.tokenizer.tokenizer.to_str()
  cache_file = hub.converted_cache_path(f"local-gguf-{sha[:16]}", "float32", tmp_path)
  assert cache_file.exists()
  # Second load: from the cache, no conversion.
  monkeypatch.setattr(gguf_convert, "convert", lambda *a, **k: pytest.fail("converted again"))
  again = hub.load_model(smol_gguf, cache_dir=tmp_path, progress=False)
  _tree_equal(again.params, smol_ref.params)


# ----------------------------------------------------------------------------------------------------------------
# Heavy: Qwen2.5-Coder-0.5B and Gemma 3 270M through the same GGUF → HF directory round trip


@pytest.mark.heavy
@pytest.mark.parametrize("name,rel", [("qwen2.5-coder-0.5b", 1e-4), ("gemma3-270m", 1e-4)])
def test_heavy_hf_dir_matches_gguf(name, rel, tmp_path):
  reference = hub.load_model(name, progress=False)
  directory = _hf_dir_from_gguf(registry.fetch_gguf(name, progress=False), tmp_path / "hf")
  ours = hub.load_model(directory, progress=False)
  assert ours.config.norm_plus_one == name.startswith("gemma3")
  gemma = name.startswith("gemma3")
  prompts_ids = [reference.tokenizer.encode(p, add_special_tokens=gemma) for p in PROMPTS]
  _check_same_model(ours, reference, prompts_ids, f"{name} HF dir vs GGUF", rel=rel)
  _check_same_tokenizer(ours.tokenizer, reference.tokenizer, TEXTS + PROMPTS)
