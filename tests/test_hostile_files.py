"""Hostile or broken checkpoint files: every one is refused with one clear error naming the file (and the tensor),
fast and before anything large is allocated.

* GGUF (written small with ``gguf.GGUFWriter``, then damaged byte by byte): truncated inside the header, the metadata,
  a tensor info and the data; a tensor offset past the end or off the alignment; a flipped tensor type id (unknown,
  a block size the rows do not fill, a larger type that overlaps the next tensor); a flipped value type id; an array
  length of 2**60; ``block_count`` 10**7 (it ran 63 s into a 12 GB MemoryError) and other sizes the tensors do not
  back. Each: GGUFError (a ValueError) naming the file, in well under the generous bound ``_refused`` allows, with
  the Python heap growing by less than ``MAX_PEAK_BYTES`` (tracemalloc).
* Safetensors (written by hand: 8-byte length, JSON header, data): shape ``[2**32, 2**32]`` (an int64 product wraps to
  0 and passed the old size check), negative and non-integer dimensions, unknown and non-string dtypes, data offsets
  reversed / past the end / overlapping / not matching the shape / malformed, a header length past the file, a header
  that is a list, an entry that is not an object, a ``__metadata__`` that is not an object of strings, a duplicated
  key. Each: ValueError naming the file and the tensor.
* Hugging Face directories (config.json, safetensors and tokenizer.json written by hand): ``num_hidden_layers`` 10**7
  (llama and gemma3_text), fewer layers than the tensors, a vocabulary the embedding does not have, sizes that are
  not integers, shard names outside the directory.
* Converting into a cache without room (``shutil.disk_usage`` patched as ``hub`` sees it): CacheDirError naming the
  directory, the bytes needed and the bytes free, before anything is converted, and nothing half-written is left.
"""

import collections
import errno
import json
import pathlib
import re
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest

from blockspec_jax.models import gguf_convert, hf_convert, hub, registry

MAX_SECONDS = 10.0  # generous: each refusal takes milliseconds; the unchecked 10**7-layer case ran for minutes
MAX_PEAK_BYTES = 64 << 20  # peak Python heap growth (tracemalloc) while refusing; the unchecked case reached 12 GB

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM, FFN = 6, 8, 2, 1, 4, 16
TOKENS = ["a", "b", "c", "ab", "<s>", "</s>"]
LAYER_TENSORS = {  # GGUF name → (HF name, numpy shape)
    "attn_norm": ("input_layernorm", (D,)), "ffn_norm": ("post_attention_layernorm", (D,)),
    "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, D)), "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, D)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, D)), "attn_output": ("self_attn.o_proj", (D, D)),
    "ffn_gate": ("mlp.gate_proj", (FFN, D)), "ffn_up": ("mlp.up_proj", (FFN, D)),
    "ffn_down": ("mlp.down_proj", (D, FFN)),
}


def _refused(fn, error, *patterns):
  """Run ``fn()``, which must raise ``error``; returns the message after checking that it matches every regex of
  ``patterns`` and that refusing took less than MAX_SECONDS and MAX_PEAK_BYTES of Python heap."""
  tracemalloc.start()
  start = time.perf_counter()
  try:
    with pytest.raises(error) as info:
      fn()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  message = str(info.value)
  for pattern in patterns:
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
  assert seconds < MAX_SECONDS, f"refusing took {seconds:.1f} s: {message}"
  assert peak < MAX_PEAK_BYTES, f"refusing allocated {peak / 2**20:.0f} MiB: {message}"
  return message


# ----------------------------------------------------------------------------------------------------------------
# GGUF


def _write_gguf(path: pathlib.Path, block_count=2, layers=2, metadata=None) -> pathlib.Path:
  """A tiny llama GGUF (F32 tensors, byte-level BPE tokenizer) that converts and loads; ``metadata``: extra or
  replaced ``llama.*`` keys as ``{key: value}`` (ints as uint32, strings as strings)."""
  w = gguf.GGUFWriter(str(path), "llama")
  meta = {"block_count": block_count, "embedding_length": D, "attention.head_count": HEADS,
          "attention.head_count_kv": KV_HEADS, "feed_forward_length": FFN, "context_length": 64}
  meta.update(metadata or {})
  for key, value in meta.items():
    (w.add_uint32 if isinstance(value, int) else w.add_string)(f"llama.{key}", value)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(1e4)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(TOKENS)
  w.add_token_merges(["a b"])
  w.add_token_types([1, 1, 1, 1, 3, 3])
  w.add_eos_token_id(5)
  rng = np.random.default_rng(0)
  w.add_tensor("token_embd.weight", rng.normal(size=(VOCAB, D)).astype(np.float32))
  w.add_tensor("output_norm.weight", np.ones(D, np.float32))
  for i in range(layers):
    for name, (_, shape) in LAYER_TENSORS.items():
      w.add_tensor(f"blk.{i}.{name}.weight", rng.normal(size=shape).astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
  """``(path, bytes, reader)`` of a valid tiny GGUF (the reader gives the byte offsets to damage)."""
  path = _write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf")
  return path, path.read_bytes(), gguf.GGUFReader(str(path))


def _damaged(tmp_path, data: bytes, name: str, cut: int | None = None, at: int | None = None, new: bytes = b""
             ) -> pathlib.Path:
  """``data`` cut after ``cut`` bytes, or with ``new`` written over it at ``at``, saved as ``tmp_path/name``."""
  if cut is not None:
    data = data[:cut]
  if at is not None:
    data = data[:at] + new + data[at + len(new):]
  path = tmp_path / name
  path.write_bytes(data)
  return path


def _tensor_info(reader, index: int) -> dict:
  """Byte offsets of the fields of tensor info ``index``: name, dims, type id, data offset."""
  tensor = reader.tensors[index]
  name_at = tensor.field.offset + 8
  dims_at = name_at + len(tensor.name.encode()) + 4
  type_at = dims_at + 8 * len(tensor.shape)
  return dict(name=tensor.name, name_at=name_at, dims_at=dims_at, type_at=type_at, offset_at=type_at + 4,
              offset=int(tensor.data_offset) - reader.data_offset)


def test_the_tiny_gguf_converts(good_gguf):
  """The undamaged file converts (so every refusal below is about the damage)."""
  config, params = gguf_convert.convert(good_gguf[0])
  assert (config.num_layers, config.vocab_size, config.d_model) == (2, VOCAB, D)
  assert params["params"]["layers_1"]["mlp"]["down"]["weight"].shape == (D, FFN)


@pytest.mark.parametrize("where", ["header", "metadata", "tensor name", "tensor dims", "data start", "data end"])
def test_truncated_gguf(where, good_gguf, tmp_path):
  path, data, reader = good_gguf
  last = _tensor_info(reader, -1)
  cut, pattern = {
      "header": (10, r"it ends at byte 10, inside the header"),
      "metadata": (reader.fields["tokenizer.ggml.tokens"].offset + 40,
                   r"inside metadata entry 'tokenizer\.ggml\.tokens'"),
      "tensor name": (last["name_at"] + 3, rf"inside tensor info #{len(reader.tensors) - 1}"),
      "tensor dims": (last["dims_at"] + 3, rf"inside the tensor info of '{re.escape(last['name'])}'"),
      "data start": (reader.data_offset + 3, r"tensor 'token_embd\.weight' \(F32, shape \(6, 8\)\) needs bytes "
                                             rf"{reader.data_offset} to {reader.data_offset + VOCAB * D * 4}"),
      "data end": (len(data) - 7, rf"tensor '{re.escape(last['name'])}' \(F32, shape \(8, 16\)\) needs bytes \d+ to "
                                  rf"{len(data)}, but the file ends at byte {len(data) - 7}"),
  }[where]
  bad = _damaged(tmp_path, data, f"cut-{where.replace(' ', '-')}.gguf", cut=cut)
  _refused(lambda: gguf_convert.read_gguf(bad), gguf_convert.GGUFError, re.escape(str(bad)),
           "truncated or damaged", pattern)


@pytest.mark.parametrize("size", [0, 3])
def test_too_short_to_be_gguf(size, good_gguf, tmp_path):
  bad = _damaged(tmp_path, good_gguf[1], "short.gguf", cut=size)
  _refused(lambda: gguf_convert.read_gguf(bad), gguf_convert.GGUFError, re.escape(str(bad)), "not a GGUF file")


def test_tensor_offset_past_the_end_or_off_alignment(good_gguf, tmp_path):
  _, data, reader = good_gguf
  last = _tensor_info(reader, -1)
  past = _damaged(tmp_path, data, "past.gguf", at=last["offset_at"], new=struct.pack("<Q", 1 << 40))
  _refused(lambda: gguf_convert.read_gguf(past), gguf_convert.GGUFError, re.escape(str(past)),
           rf"truncated or damaged: tensor '{re.escape(last['name'])}' .* needs bytes {reader.data_offset + (1 << 40)} "
           rf"to \d+, but the file ends at byte {len(data)}")
  skewed = _damaged(tmp_path, data, "skewed.gguf", at=last["offset_at"], new=struct.pack("<Q", last["offset"] + 4))
  _refused(lambda: gguf_convert.read_gguf(skewed), gguf_convert.GGUFError, re.escape(str(skewed)),
           rf"tensor '{re.escape(last['name'])}' .* starts at byte {last['offset'] + 4} of the data section, not a "
           r"multiple of its alignment 32")


@pytest.mark.parametrize("type_id,pattern", [
    (200, r"tensor 'token_embd\.weight' has type id 200, which is not a GGML tensor type"),
    (int(gguf.GGMLQuantizationType.Q8_0), r"tensor 'token_embd\.weight' \(Q8_0, shape \(6, 8\)\): rows of 8 values are "
                                          r"not a whole number of Q8_0 blocks of 32"),
    (int(gguf.GGMLQuantizationType.F64), r"tensors 'token_embd\.weight' and 'output_norm\.weight' overlap"),
])
def test_flipped_tensor_type_id(type_id, pattern, good_gguf, tmp_path):
  _, data, reader = good_gguf
  first = _tensor_info(reader, 0)
  bad = _damaged(tmp_path, data, f"type-{type_id}.gguf", at=first["type_at"], new=struct.pack("<I", type_id))
  _refused(lambda: gguf_convert.read_gguf(bad), gguf_convert.GGUFError, re.escape(str(bad)), pattern)


def test_flipped_metadata_type_and_huge_array(good_gguf, tmp_path):
  _, data, reader = good_gguf
  field = reader.fields["tokenizer.ggml.tokens"]
  type_at = field.offset + 8 + len("tokenizer.ggml.tokens")
  bad_type = _damaged(tmp_path, data, "value-type.gguf", at=type_at, new=struct.pack("<I", 99))
  _refused(lambda: gguf_convert.read_gguf(bad_type), gguf_convert.GGUFError, re.escape(str(bad_type)),
           r"metadata entry 'tokenizer\.ggml\.tokens' has value type id 99, which is not a GGUF value type")
  huge = _damaged(tmp_path, data, "huge-array.gguf", at=type_at + 8, new=struct.pack("<Q", 1 << 60))
  _refused(lambda: gguf_convert.read_gguf(huge), gguf_convert.GGUFError, re.escape(str(huge)),
           rf"truncated or damaged: metadata entry 'tokenizer\.ggml\.tokens' lists {1 << 60} strings, more than the "
           r"\d+ bytes left in the file can hold")


def test_damaged_gguf_through_load_model(good_gguf, tmp_path):
  """What a user of ``load_model`` sees, and the cache keeps nothing."""
  _, data, reader = good_gguf
  bad = _damaged(tmp_path, data, "model.gguf", cut=reader.data_offset + 100)
  cache = tmp_path / "cache"
  _refused(lambda: hub.load_model(bad, cache_dir=cache, progress=False), gguf_convert.GGUFError,
           re.escape(str(bad)), "truncated or damaged")
  assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_block_count_ten_million(tmp_path):
  """The case that ran 63 s into a 12 GB MemoryError: refused from the tensor names, through convert and
  load_model."""
  path = _write_gguf(tmp_path / "deep.gguf", block_count=10**7)
  pattern = (r"GGUF metadata 'llama\.block_count' is 10000000, but layers 2-9999999 have no tensors \(the tensors "
             r"are those of 2 layers: blk\.N with N in 0-1\)")
  _refused(lambda: gguf_convert.convert(path), gguf_convert.GGUFError, re.escape(str(path)), pattern)
  _refused(lambda: hub.load_model(path, cache_dir=tmp_path / "cache", progress=False), gguf_convert.GGUFError,
           re.escape(str(path)), pattern)


def test_gguf_sizes_the_tensors_do_not_back(tmp_path):
  fewer = _write_gguf(tmp_path / "fewer.gguf", block_count=1)
  _refused(lambda: gguf_convert.convert(fewer), gguf_convert.GGUFError, re.escape(str(fewer)),
           r"tensors with no place in Decoder: \['blk\.1\.attn_norm\.weight', .*; GGUF metadata 'llama\.block_count' "
           r"is 1, but there are tensors of layers up to 1")
  gap = _write_gguf(tmp_path / "gap.gguf", block_count=3, layers=2)
  _refused(lambda: gguf_convert.convert(gap), gguf_convert.GGUFError, r"'llama\.block_count' is 3, but layer 2 has "
           r"no tensors")
  vocab = _write_gguf(tmp_path / "vocab.gguf", metadata={"vocab_size": 10**9})
  _refused(lambda: gguf_convert.convert(vocab), gguf_convert.GGUFError, re.escape(str(vocab)),
           r"tensor token_embd\.weight has shape \(6, 8\), expected \(1000000000, 8\) for embed/embedding \(the "
           r"metadata's sizes: vocab 1000000000, d_model 8")
  heads = _write_gguf(tmp_path / "heads.gguf", metadata={"attention.head_count": 4, "attention.head_count_kv": 4})
  _refused(lambda: gguf_convert.convert(heads), gguf_convert.GGUFError, re.escape(str(heads)),
           r"tensor blk\.0\.attn_k\.weight has shape \(4, 8\), expected \(8, 8\)")
  text = _write_gguf(tmp_path / "text.gguf", metadata={"embedding_length": "eight"})
  _refused(lambda: gguf_convert.convert(text), gguf_convert.GGUFError, re.escape(str(text)),
           r"GGUF metadata 'llama\.embedding_length' must be a positive integer, got 'eight'")


# ----------------------------------------------------------------------------------------------------------------
# Safetensors


def _safetensors(path: pathlib.Path, header, data: bytes = bytes(40), length: int | None = None) -> pathlib.Path:
  """A safetensors file written by hand: ``length`` (default: the header's) as 8 little-endian bytes, the JSON
  ``header`` (a str is written as is), ``data``."""
  text = (header if isinstance(header, str) else json.dumps(header)).encode()
  path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
  return path


GOOD_HEADER = {"__metadata__": {"format": "pt"},
               "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
               "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}


def _with(name: str, **entry) -> dict:
  header = json.loads(json.dumps(GOOD_HEADER))
  header[name].update(entry)
  return header


def test_the_hand_written_safetensors_reads(tmp_path):
  path = _safetensors(tmp_path / "good.safetensors", GOOD_HEADER, np.arange(10, dtype="<f4").tobytes())
  tensors = {name: np.array(value) for name, _, value in hf_convert.iter_tensors([path])}
  np.testing.assert_array_equal(tensors["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
  np.testing.assert_array_equal(tensors["b"], np.arange(6, 10, dtype=np.float32))


@pytest.mark.parametrize("case,header,error,pattern", [
    ("huge-shape", _with("a", shape=[2**32, 2**32], data_offsets=[0, 0]), ValueError,
     r"tensor 'a': data_offsets \[0, 0\] span 0 bytes, but F32 \[4294967296, 4294967296\] needs more than the file's "
     r"40 data bytes"),
    ("negative-dims", _with("a", shape=[-2, -3]), ValueError,
     r"tensor 'a': shape must be a list of non-negative integers, got \[-2, -3\]"),
    ("float-dims", _with("a", shape=[2.0, 3]), ValueError, r"tensor 'a': shape must be a list of non-negative"),
    ("string-dims", _with("a", shape=["2", 3]), ValueError, r"tensor 'a': shape must be a list of non-negative"),
    ("bool-dims", _with("a", shape=[True, 6]), ValueError, r"tensor 'a': shape must be a list of non-negative"),
    ("shape-not-a-list", _with("a", shape=6), ValueError, r"tensor 'a': shape must be a list"),
    ("unknown-dtype", _with("b", dtype="F33"), ValueError, r"tensor 'b': dtype 'F33' is not a safetensors dtype"),
    ("dtype-not-a-string", _with("b", dtype=4), ValueError, r"tensor 'b': dtype must be a string, got 4"),
    ("fp8-dtype", _with("b", dtype="F8_E4M3"), NotImplementedError, r"tensor 'b' has dtype 'F8_E4M3'; supported"),
    ("reversed", _with("a", data_offsets=[24, 0]), ValueError,
     r"tensor 'a': data_offsets \[24, 0\] do not lie within the file's 40 data bytes"),
    ("past-the-end", _with("b", shape=[6], data_offsets=[24, 48]), ValueError,
     r"tensor 'b': data_offsets \[24, 48\] do not lie within the file's 40 data bytes"),
    ("negative-offset", _with("a", data_offsets=[-8, 16]), ValueError, r"tensor 'a': data_offsets \[-8, 16\] do not"),
    ("overlapping", _with("b", data_offsets=[16, 32]), ValueError,
     r"tensors 'a' and 'b' overlap \(data_offsets \[0, 24\] and \[16, 32\]\)"),
    ("not-the-shape", _with("a", data_offsets=[0, 20]), ValueError,
     r"tensor 'a': data_offsets \[0, 20\] span 20 bytes, but F32 \[2, 3\] needs 24 bytes"),
    ("three-offsets", _with("a", data_offsets=[0, 12, 24]), ValueError,
     r"tensor 'a': data_offsets must be a list of two integers, got \[0, 12, 24\]"),
    ("no-offsets", {"a": {"dtype": "F32", "shape": [2]}}, ValueError,
     r"tensor 'a': data_offsets must be a list of two integers, got None"),
    ("entry-not-an-object", {"a": [0, 24]}, ValueError, r"tensor 'a': its header entry must be an object"),
    ("header-a-list", [GOOD_HEADER["a"]], ValueError, r"is not a safetensors file \(its header is a JSON list"),
    ("metadata-a-list", dict(GOOD_HEADER, __metadata__=["pt"]), ValueError,
     r"__metadata__ must be an object of strings, got \['pt'\]"),
    ("metadata-not-strings", dict(GOOD_HEADER, __metadata__={"step": 3}), ValueError,
     r"__metadata__ must be an object of strings"),
    ("duplicate-key", '{"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, '
                      '"a": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}', ValueError,
     r"not a safetensors file \(unreadable header: key 'a' appears twice\)"),
    ("not-json", '{"a": ', ValueError, r"not a safetensors file \(unreadable header"),
])
def test_hostile_safetensors_header(case, header, error, pattern, tmp_path):
  path = _safetensors(tmp_path / f"{case}.safetensors", header)
  _refused(lambda: hf_convert.read_safetensors_header(path), error, re.escape(str(path)), pattern)


def test_header_length_past_the_file(tmp_path):
  for length in (1000, 2**63):
    path = _safetensors(tmp_path / f"long-{length}.safetensors", GOOD_HEADER, length=length)
    _refused(lambda: hf_convert.read_safetensors_header(path), ValueError, re.escape(str(path)),
             rf"is not a safetensors file \(header length {length} does not fit the file")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directories


def _hf_dir(directory: pathlib.Path, layers=2, **config) -> pathlib.Path:
  """A tiny llama checkpoint directory written by hand (safetensors package, a WordLevel tokenizer.json);
  ``config`` replaces config.json fields."""
  from safetensors.numpy import save_file
  from tokenizers import Tokenizer, models
  directory.mkdir()
  rng = np.random.default_rng(0)
  tensors = {"model.embed_tokens.weight": rng.normal(size=(VOCAB, D)).astype(np.float32),
             "model.norm.weight": np.ones(D, np.float32)}
  for i in range(layers):
    for hf_name, shape in LAYER_TENSORS.values():
      tensors[f"model.layers.{i}.{hf_name}.weight"] = rng.normal(size=shape).astype(np.float32)
  save_file(tensors, str(directory / "model.safetensors"))
  fields = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=D,
                intermediate_size=FFN, num_hidden_layers=layers, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, tie_word_embeddings=True, rms_norm_eps=1e-5)
  fields.update(config)
  (directory / "config.json").write_text(json.dumps(fields))
  Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="a")).save(
      str(directory / "tokenizer.json"))
  return directory


def test_the_hand_written_hf_dir_loads(tmp_path):
  model = hub.load_model(_hf_dir(tmp_path / "good"), progress=False)
  assert (model.config.num_layers, model.config.vocab_size, model.config.tie_embeddings) == (2, VOCAB, True)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_num_hidden_layers_ten_million(model_type, tmp_path):
  directory = _hf_dir(tmp_path / "deep", num_hidden_layers=10**7, model_type=model_type, architectures=None)
  _refused(lambda: hub.load_model(directory, progress=False), ValueError,
           re.escape(str(directory / "config.json")) + r": num_hidden_layers is 10000000, but layers 2-9999999 have "
           r"no tensors \(the tensors are those of 2 layers: model\.layers\.N with N in 0-1\)")


def test_hf_sizes_the_tensors_do_not_back(tmp_path):
  fewer = _hf_dir(tmp_path / "fewer", num_hidden_layers=1)
  _refused(lambda: hub.load_model(fewer, progress=False), ValueError,
           re.escape(str(fewer)) + r": tensors with no place in Decoder \(llama, 1 layers\): "
           r"\['model\.layers\.1\..*; config\.json's num_hidden_layers is 1, but there are tensors of layers up to 1")
  vocab = _hf_dir(tmp_path / "vocab", vocab_size=10**9)
  _refused(lambda: hub.load_model(vocab, progress=False), ValueError,
           re.escape(str(vocab / "model.safetensors")) + r": tensor model\.embed_tokens\.weight has shape \(6, 8\), "
           r"expected \(1000000000, 8\) for embed/embedding \(config\.json's sizes: vocab 1000000000")
  text = _hf_dir(tmp_path / "text", hidden_size="8")
  _refused(lambda: hub.load_model(text, progress=False), ValueError,
           re.escape(str(text / "config.json")) + r": hidden_size must be a positive integer, got '8'")
  heads = _hf_dir(tmp_path / "heads", num_attention_heads=0)
  _refused(lambda: hub.load_model(heads, progress=False), ValueError,
           r"num_attention_heads must be a positive integer, got 0")


def test_shard_names_outside_the_directory(tmp_path):
  directory = _hf_dir(tmp_path / "ckpt")
  for shard in ("../model.safetensors", "/etc/passwd", 7):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    _refused(lambda: hf_convert.safetensors_files(directory), ValueError,
             r"model\.safetensors\.index\.json: weight_map must name shard files of the directory itself")


# ----------------------------------------------------------------------------------------------------------------
# Disk space before converting


def _disk_with(free_bytes):
  """A ``shutil.disk_usage`` whose disk has ``free_bytes`` free (a list: one value per call, the last repeated)."""
  frees = list(free_bytes) if isinstance(free_bytes, (list, tuple)) else [free_bytes]
  usage = collections.namedtuple("usage", "total used free")

  def disk_usage(path):
    free = frees.pop(0) if len(frees) > 1 else frees[0]
    return usage(10**12, 10**12 - free, free)
  return disk_usage


def _files(directory: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_no_room_for_the_converted_cache(good_gguf, tmp_path, monkeypatch):
  """Refused before converting (estimated from the tensor shapes), naming the directory, the need and the free
  space; nothing is left in the cache; with room again the same call works."""
  path, cache = good_gguf[0], tmp_path / "cache"
  converted = cache / "converted"
  real_convert = gguf_convert.convert
  with monkeypatch.context() as m:
    m.setattr(hub.shutil, "disk_usage", _disk_with(1000))
    m.setattr(gguf_convert, "convert", lambda *a, **k: pytest.fail("converted without room for the result"))
    message = _refused(lambda: hub.load_model(path, cache_dir=cache, progress=False), registry.CacheDirError,
                       rf"the disk holding cache directory {re.escape(str(converted))} is full \(need about 64 "
                       r"MiB, have 1000 bytes free\)", r"Nothing half-written was kept", r"BLOCKSPEC_JAX_CACHE")
  print(message)
  assert _files(cache) == ["converted"]
  model = hub.load_model(path, cache_dir=cache, progress=False)
  assert model.config.num_layers == 2 and gguf_convert.convert is real_convert
  assert [f for f in _files(cache) if f.endswith(".npz")] == [f"converted/{model.spec.cache_name}.float32.npz"]


def test_room_gone_while_converting(good_gguf, tmp_path, monkeypatch):
  """Room before converting but not after (another writer filled the disk): the exact size is checked again before
  writing, and nothing half-written is left."""
  cache = tmp_path / "cache"
  monkeypatch.setattr(hub.shutil, "disk_usage", _disk_with([10**12, 1000]))
  with pytest.raises(registry.CacheDirError, match=r"converted parameters local-gguf-\w+\.float32\.npz: the disk "
                                                   r"holding cache directory .* is full \(need about \d+ bytes, have "
                                                   r"1000 bytes free\)") as info:
    hub.load_model(good_gguf[0], cache_dir=cache, progress=False)
  assert info.value.errno == errno.ENOSPC
  assert _files(cache) == ["converted"]
