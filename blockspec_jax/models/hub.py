"""One call from a registry name or a local checkpoint to a ready model: config, parameters, tokenizer.

    model = load_model("smollm2-135m", dtype="float32")     # or a GGUF file / Hugging Face directory path
    logits_BxTxV, cache = Decoder(model.config).apply(model.params, tokens_BxT, positions_BxT, cache, mask_BxTxS)
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))

The first load fetches the GGUF (registry.fetch_gguf), converts it (gguf_convert.convert) and writes
``<cache>/converted/<name>.<dtype>.npz``: one array per parameter (key = tree path joined by ".") plus ``__meta__``,
a JSON string with the config, the tokenizer and the GGUF's SHA-256. Later loads read only that file (no GGUF
parsing, no dequantisation). A cache file that cannot be read, or was made from another GGUF or format version, is
deleted (with a message on stderr) and rebuilt. Converting holds ``registry.cache_lock`` on
``<cache>/converted/<name>.<dtype>.npz.lock`` (a second process waits, then loads the first one's file); the file is
written as ``….npz.partial-<pid>`` and renamed, so a killed run leaves nothing that is read (the next conversion
deletes it). An unwritable cache directory is reported before fetching or converting, and so is a disk without room
for the converted file (estimated from the GGUF's tensor shapes and the dtype, plus a margin): a ``CacheDirError``
naming the directory, the space needed and the space free, before anything is dequantised or written.

Bring your own checkpoint: ``name`` may instead be a path (``model.spec`` is then a ``LocalSource`` whose ``name`` is
the absolute path):

* a GGUF file (llama, qwen2, gemma3): converted like a registry model and cached as
  ``<cache>/converted/local-gguf-<first 16 hex digits of the file's SHA-256>.<dtype>.npz``. The cache is keyed by
  content, so a file edited in place is converted again and copies share one entry; the price is hashing the file
  on every load (about a second per GB), small next to converting.
* a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``, ``tokenizer.json``; llama, qwen2,
  gemma3_text or gemma3): read directly on every load, no cache (the weights are already float; see hf_convert).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import shutil
import sys
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.models import gguf_convert, hf_convert, quant, registry, stacking
from blockspec_jax.models.decoder import DecoderConfig, stack_layers
from blockspec_jax.models.tokenizer import TokenizerWrapper, tokenizer_from_gguf

__all__ = ["LoadedModel", "LocalSource", "WEIGHTS", "load_model", "converted_cache_path"]

#: ``load_model(weights=)``: "dequantized" (every tensor converted to ``dtype``) or "quantized" (GGUF blocks kept).
WEIGHTS = ("dequantized", "quantized")

_FORMAT_VERSION = 3  # 2: linear weights stored (out, in) as "weight"; 3: Gemma tokenizer without invented ids
_META_KEY = "__meta__"
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_MEMBER_OVERHEAD_BYTES = 1 << 10  # zip local and central headers and the .npy header of one array, rounded up
_DISK_MARGIN_BYTES = 64 << 20  # the metadata (tokenizer JSON) and room to spare, as registry keeps before a fetch


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  """A real model ready for ``Decoder(config).apply(params, ...)``; ``params = {"params": tree}`` (jax arrays)."""
  config: DecoderConfig
  params: Any
  tokenizer: TokenizerWrapper
  spec: registry.ModelSpec | LocalSource  # where it came from; ``spec.name`` names it in messages and paths

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Token ids that end a generation (EOS)."""
    return () if self.tokenizer.eos_id is None else (self.tokenizer.eos_id,)


@dataclasses.dataclass(frozen=True)
class LocalSource:
  """A checkpoint ``load_model`` was given by path: ``name`` is its absolute path (as a string), ``kind`` "gguf"
  (a GGUF file; ``sha256`` of its bytes keys the converted cache) or "hf" (a Hugging Face directory)."""
  name: str
  kind: str
  path: pathlib.Path
  sha256: str | None = None

  @property
  def cache_name(self) -> str:
    """Stem of the converted cache file of a GGUF (``converted_cache_path(cache_name, dtype)``)."""
    return f"local-gguf-{self.sha256[:16]}"


def _looks_like_path(name: str) -> bool:
  return any(sep and sep in name for sep in (os.sep, os.altsep)) or name.startswith(("~", ".")) or \
      name.lower().endswith(".gguf")


def _source(name: str | os.PathLike, checksum: bool = True) -> registry.ModelSpec | LocalSource:
  """The registry entry ``name``, or the checkpoint at path ``name``; clear errors for everything else.
  ``checksum=False`` skips hashing a GGUF file (its ``sha256`` is then None): for checks that load nothing."""
  if isinstance(name, str) and name in registry.MODELS:
    return registry.MODELS[name]
  known = ", ".join(sorted(registry.MODELS))
  path = pathlib.Path(name).expanduser()
  if path.is_dir():
    return LocalSource(name=str(path.resolve()), kind="hf", path=path.resolve())
  if path.is_file():
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise ValueError(f"{path} is a file but not a GGUF file (it starts with {magic!r}, not b'GGUF'); load_model "
                       "accepts a registry name, a GGUF file or a Hugging Face checkpoint directory")
    return LocalSource(name=str(path.resolve()), kind="gguf", path=path.resolve(),
                       sha256=registry.sha256_file(path) if checksum else None)
  if not isinstance(name, str) or _looks_like_path(name):
    raise FileNotFoundError(f"model path {os.fspath(name)!r} does not exist (and it is not a registry name; known "
                            f"models: {known})")
  raise ValueError(f"unknown model {name!r}: neither a registry name (known models: {known}) nor an existing path; "
                   "load_model also accepts the path of a GGUF file or of a Hugging Face checkpoint directory")


def _load_hf_dir(spec: LocalSource, dtype: str, progress: bool) -> LoadedModel:
  """Tokenizer and parameters of a Hugging Face checkpoint directory, straight from its files (no cache)."""
  hf_convert.check_checkpoint_dir(spec.path)
  # Unsupported families, broken headers and sizes the tensors do not back fail before any tensor data is read.
  hf_convert.read_checkpoint_config(spec.path, dtype)
  tokenizer = hf_convert.tokenizer_from_hf(spec.path)
  config, params = hf_convert.convert(spec.path, dtype=dtype, progress=progress)
  _device_put_in_place(params)
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, spec=spec)


def converted_cache_path(name: str, dtype: str = "float32", cache_dir: os.PathLike | str | None = None,
                         weights: str = "dequantized") -> pathlib.Path:
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else registry.default_cache_dir()
  stem = f"{name}.{dtype}" if weights == "dequantized" else f"{name}.{dtype}.{weights}"
  return cache / "converted" / f"{stem}.npz"


def _named_leaves(tree: dict):
  """``(key, leaf)`` of a parameter tree, key = the tree path joined by "."; a QuantizedTensor is one leaf."""
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, quant.QuantizedTensor))[0]:
    yield ".".join(k.key for k in key_path), leaf


def _config_to_json(config: DecoderConfig) -> dict:
  fields = dataclasses.asdict(config)
  fields["dtype"] = jnp.dtype(config.dtype).name
  return fields


def _config_from_json(fields: dict) -> DecoderConfig:
  fields = dict(fields)
  fields["dtype"] = _DTYPE_NAMES[fields["dtype"]]
  return DecoderConfig(**fields)


def _check_free_space(directory: pathlib.Path, needed: int, what: str) -> None:
  """Raise ``registry.CacheDirError`` (errno ENOSPC, the wording of a full disk) naming ``directory``, the ``needed``
  bytes and the free ones, when the disk holding ``directory`` (which must exist) has fewer than ``needed`` free."""
  free = shutil.disk_usage(directory).free
  if free < needed:
    raise registry.cache_dir_error(directory, what, OSError(
        errno.ENOSPC, f"need about {_mib(needed)}, have {_mib(free)} free"))


def _mib(n: int) -> str:
  if n < 1 << 20:
    return f"{n} bytes"
  return f"{n / 2**20:.1f} MiB" if n < 10 << 20 else f"{n / 2**20:.0f} MiB"


def _save(path: pathlib.Path, config: DecoderConfig, params: dict, tokenizer: TokenizerWrapper, dtype: str,
          spec: registry.ModelSpec, weights: str = "dequantized") -> None:
  arrays, quantized = {}, {}
  for key, leaf in _named_leaves(params["params"]):
    if isinstance(leaf, quant.QuantizedTensor):  # its arrays as members "<key>.<field>", its type in the metadata
      quantized[key] = dict(qtype=leaf.qtype, shape=list(leaf.shape))
      for field in leaf.layout.fields:
        arrays[f"{key}.{field}"] = np.asarray(getattr(leaf, field))
      continue
    leaf = np.asarray(leaf)
    arrays[key] = leaf.view(np.uint16) if dtype == "bfloat16" else leaf  # .npy cannot spell bfloat16
  meta = dict(format=_FORMAT_VERSION, name=spec.name, dtype=dtype, gguf_sha256=spec.sha256,
              config=_config_to_json(config), tokenizer=tokenizer.to_json(), weights=weights, quantized=quantized)
  arrays[_META_KEY] = np.array(json.dumps(meta))
  tmp = path.with_name(path.name + f".partial-{os.getpid()}")  # not *.npz: never taken for a cache file
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The exact size of what follows (the estimate before converting may have been made with less in the cache).
    _check_free_space(path.parent, sum(a.nbytes + _MEMBER_OVERHEAD_BYTES for a in arrays.values()),
                     f"converted parameters {path.name}")
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())  # the renamed file must hold these bytes even after a crash
    os.replace(tmp, path)
  except registry.CacheDirError:
    raise
  except OSError as e:  # ENOSPC, EDQUOT, EROFS, EACCES...: all about the cache directory
    raise registry.cache_dir_error(path.parent, f"converted parameters {path.name}", e) from e
  finally:
    tmp.unlink(missing_ok=True)  # also on KeyboardInterrupt; a SIGKILL leaves it to the next conversion


#: Host arrays read from the cache start on this boundary: XLA's CPU client then takes them as device buffers
#: without a copy (``jax.device_put`` aliases a 64-byte-aligned, C-contiguous array).
_ALIGN = 64


def _aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on a ``_ALIGN``-byte boundary."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _stored_members(path: pathlib.Path) -> dict | None:
  """``{name: (member start, data offset, shape, dtype, CRC-32)}`` of the ``.npy`` members of an uncompressed
  ``.npz`` (what ``np.savez`` writes), read from the zip directory and each member's local and ``.npy`` headers; None
  when a member is compressed or not a plain C-ordered array (then the file is read with ``np.load``)."""
  import struct
  members = {}
  with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
    for info in archive.infolist():
      if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
        return None
      f.seek(info.header_offset)
      local = f.read(30)
      if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"member {info.filename} has no local zip header")
      name_len, extra_len = struct.unpack("<HH", local[26:30])
      start = info.header_offset + 30 + name_len + extra_len
      f.seek(start)
      version = np.lib.format.read_magic(f)
      shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(f))
      if fortran or dtype.hasobject:
        return None
      members[info.filename[:-4]] = (start, f.tell(), tuple(shape), dtype, info.CRC)
  return members


def _read_into(f, member, out: np.ndarray, name: str) -> None:
  """Fill the contiguous array ``out`` with the array bytes of ``member`` (:func:`_stored_members`) of the open file
  ``f`` (one copy, from the page cache straight into ``out``) and check the member's CRC-32 over its header and those
  bytes, as the zip reader would: a flipped bit or a short file is a ValueError (the cache is then rebuilt)."""
  import zlib
  start, offset, _, _, crc = member
  view = memoryview(out.reshape(-1).view(np.uint8))
  f.seek(start)
  seen = zlib.crc32(f.read(offset - start))
  done = 0
  while done < len(view):
    n = f.readinto(view[done:])
    if not n:
      raise ValueError(f"{name}: the file ends {len(view) - done} bytes early")
    done += n
  if zlib.crc32(view, seen) != crc:
    raise ValueError(f"{name}: CRC-32 mismatch (the file is damaged)")


def _load(path: pathlib.Path, spec: registry.ModelSpec, dtype: str, stacked: bool = False,
          weights: str = "dequantized"):
  """``(config, params numpy tree, tokenizer)`` from a cache file; raises ValueError if it is stale or broken.

  Every parameter is read once, from the file into its final 64-byte-aligned host array (which the device then
  takes without a copy); with ``stacked`` the layers' leaves go straight into their ``[L, ...]`` arrays (the
  decoding layout, ``config.scan_layers``), so stacking costs no second copy of the model. Every member's CRC-32 is
  checked as ``np.load``'s zip reader checks it. The same bytes as ``np.load`` (tested), into which a compressed or
  unusual file falls back."""
  with np.load(path, allow_pickle=False) as npz:
    meta = json.loads(str(npz[_META_KEY]))
    if meta.get("format") != _FORMAT_VERSION or meta.get("gguf_sha256") != spec.sha256 or meta.get("dtype") != dtype \
        or meta.get("weights", "dequantized") != weights:
      raise ValueError("made by another format version, GGUF file, dtype or weights")
    config = _config_from_json(meta["config"])
    expected = gguf_convert.param_shapes(config)
    quantized = meta.get("quantized") or {}
    keys = set(npz.files) - {_META_KEY}
    if keys != _member_names(expected, quantized):
      raise ValueError("parameter names do not match the config")
    tokenizer = TokenizerWrapper.from_json(meta["tokenizer"])
    members = _stored_members(path)
    if members is None or quantized:  # read unrolled (np.load for an unusual file), then stack on the host
      tree = _read_unrolled(path, npz, members, expected, quantized, dtype)
      model = LoadedModel(config=config, params={"params": tree}, tokenizer=tokenizer, spec=spec)
      model = scanned(model, consume=True) if stacked else model
      return model.config, model.params, tokenizer
  layer_names = {f"layers_{i}": i for i in range(config.num_layers)} if stacked else {}
  tree: dict = {}
  with open(path, "rb") as f:
    for param_path, shape in expected.items():
      member = members[".".join(param_path)]
      _, _, file_shape, file_dtype, _ = member
      _check_shape(param_path, file_shape, shape)
      layer = layer_names.get(param_path[0])
      if layer is None:
        value = _aligned_empty(shape, file_dtype)
        _read_into(f, member, value, ".".join(param_path))
        _parent(tree, param_path)[param_path[-1]] = _as_dtype(value, dtype)
        continue
      inner = ("layers",) + param_path[1:]
      node = _parent(tree, inner)
      if inner[-1] not in node:
        node[inner[-1]] = _as_dtype(_aligned_empty((config.num_layers,) + tuple(shape), file_dtype), dtype)
      _read_into(f, member, node[inner[-1]][layer].view(file_dtype), ".".join(param_path))
  if stacked:
    config = dataclasses.replace(config, scan_layers=True)
  return config, {"params": tree}, tokenizer


def _member_names(expected: dict, quantized: dict) -> set[str]:
  """The members a cache file of parameters ``expected`` holds, the ``quantized`` ones as their arrays."""
  names = set()
  for param_path in expected:
    key = ".".join(param_path)
    if key in quantized:
      names.update(f"{key}.{field}" for field in quant.layout_of(quantized[key]["qtype"]).fields)
    else:
      names.add(key)
  return names


def _read_unrolled(path: pathlib.Path, npz, members: dict | None, expected: dict, quantized: dict, dtype: str
                   ) -> dict:
  """The unrolled parameter tree of a cache file: every member read once (CRC-checked, into an aligned array; with
  ``members`` None, an unusual file, by ``np.load``), each ``quantized`` weight rebuilt from its arrays and checked
  (``quant`` validates codes and scales against its type and logical shape)."""
  tree: dict = {}
  with open(path, "rb") as f:
    def read(name):
      if members is None:
        return npz[name]
      value = _aligned_empty(members[name][2], members[name][3])
      _read_into(f, members[name], value, name)
      return value

    for param_path, shape in expected.items():
      key = ".".join(param_path)
      if key in quantized:
        record = quantized[key]
        _check_shape(param_path, record["shape"], shape)
        arrays = {field: read(f"{key}.{field}") for field in quant.layout_of(record["qtype"]).fields}
        value = quant.QuantizedTensor(qtype=str(record["qtype"]), shape=tuple(shape), **arrays)
        quant.check_tensor(value)
      else:
        value = _as_dtype(read(key), dtype)
        _check_shape(param_path, value.shape, shape)
      _parent(tree, param_path)[param_path[-1]] = value
  return tree


def _check_shape(param_path, shape, expected) -> None:
  if tuple(shape) != tuple(expected):
    raise ValueError(f"{'/'.join(param_path)} has shape {tuple(shape)}, expected {tuple(expected)}")


def _as_dtype(value: np.ndarray, dtype: str) -> np.ndarray:
  """A cached array in its model dtype (bfloat16 is stored as its uint16 bits: ``.npy`` cannot spell it)."""
  return value.view(jnp.bfloat16) if dtype == "bfloat16" else value


def _parent(tree: dict, param_path) -> dict:
  """The dict of ``tree`` that holds ``param_path``'s leaf, made on the way."""
  node = tree
  for key in param_path[:-1]:
    node = node.setdefault(key, {})
  return node


def _estimated_bytes(contents: gguf_convert.GGUFContents, dtype: str, weights: str = "dequantized") -> int:
  """Disk space the converted cache file of ``contents`` needs: its parameters in ``dtype`` (quantized ones at their
  layout's bytes per weight), the zip and .npy headers of each (three for a quantized one), and a margin for the
  metadata."""
  quantized = weights == "quantized"
  return (gguf_convert.converted_nbytes(contents, dtype, quantized=quantized)
          + (3 if quantized else 1) * _MEMBER_OVERHEAD_BYTES * (len(contents.tensors) + 1) + _DISK_MARGIN_BYTES)


def _gguf_tokenizer(contents) -> TokenizerWrapper:
  """``tokenizer_from_gguf`` of the file's metadata; its errors name the file."""
  try:
    return tokenizer_from_gguf(contents.metadata)
  except NotImplementedError as e:
    raise NotImplementedError(f"{contents.path}: {e}") from e
  except (ValueError, TypeError, KeyError, AttributeError) as e:  # metadata of the wrong types in a damaged file
    raise gguf_convert.GGUFError(f"{contents.path}: unusable tokenizer metadata ({type(e).__name__}: {e})") from e


def _try_load(path: pathlib.Path, spec: registry.ModelSpec, dtype: str, stacked: bool = False,
              weights: str = "dequantized"):
  """``_load(path, ...)``, or None (with a message) when the file is unusable; the caller rebuilds it. A sound file
  that cannot be stacked (``stacking.UnstackableLayers``) is kept and the error raised."""
  try:
    return _load(path, spec, dtype, stacked, weights)
  except stacking.UnstackableLayers:
    raise  # the file is sound; the layout asked for cannot hold it
  except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
    print(f"[blockspec_jax] converted cache {path} is unusable ({type(e).__name__}: {e}); deleting it and "
          "converting again", file=sys.stderr)
    return None


def load_model(name: str | os.PathLike, dtype: str = "float32", cache_dir: os.PathLike | str | None = None,
               progress: bool = True, scan_layers: bool = False, weights: str = "dequantized") -> LoadedModel:
  """Load registry model ``name`` (fetched once, converted once), or the checkpoint at path ``name``, with
  parameters in ``dtype``.

  Args:
    name: a key of ``registry.MODELS``; or the path of a GGUF file (llama / qwen2 / gemma3; converted once and
      cached by its SHA-256); or the path of a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``
      single or sharded, ``tokenizer.json``; model_type llama / qwen2 / gemma3_text / gemma3; read on every load).
    dtype: "float32" or "bfloat16" (parameters and the config's compute dtype).
    cache_dir: cache directory (default ``registry.default_cache_dir()``: $BLOCKSPEC_JAX_CACHE or
      ~/.cache/blockspec_jax); holds the GGUF and ``converted/<name>.<dtype>.npz`` (``local-gguf-<sha>`` for a
      GGUF path).
    progress: progress bars while fetching and converting.
    scan_layers: the decoding layout: layers stacked (``decoder.stack_layers``, ``config.scan_layers``), so every
      program compiles one layer body instead of L copies. The default is the unrolled layout (``layers_{i}``) that
      conversion, LoRA and the training code address layer by layer. Stacking happens on the host arrays before
      they move to the device, one group of leaves at a time.
    weights: "dequantized" (every tensor converted to ``dtype``), or "quantized": a GGUF's block-quantized weights
      kept as stored (:class:`~blockspec_jax.models.quant.QuantizedTensor`: codes and per-group scales, about 4-6x
      fewer bytes than float32; they dequantize to the float32 weights of "dequantized" bit for bit), cached as
      ``converted/<name>.<dtype>.quantized.npz``; norms and biases follow ``dtype``. A GGUF that stores one weight
      in different block types across layers (Q4_K_M files) cannot be stacked (``scan_layers`` raises ValueError
      naming the weight); Hugging Face directories hold float weights only.
  Returns:
    LoadedModel; ``.spec`` is the registry ModelSpec, or a LocalSource whose ``name`` is the absolute path.
  Raises:
    ValueError: unknown name (neither a registry name nor an existing path), a file that is not GGUF, bad dtype;
      tensors that are missing or have no place in the Decoder (named); a truncated, damaged or inconsistent GGUF
      (``gguf_convert.GGUFError``) or Hugging Face file (named, with the tensor), sizes the tensors do not back.
    FileNotFoundError: a path that does not exist; a directory without config.json, *.safetensors or
      tokenizer.json (named).
    NotImplementedError: an architecture / model_type the Decoder cannot run (named, with the supported ones).
    registry.FetchError: the GGUF of a registry model could not be downloaded or verified.
    registry.CacheDirError: the cache directory is not writable, or its disk has no room for the converted file
      (checked before converting, from the tensor shapes and ``dtype``).
  """
  spec = _source(name)
  if dtype not in _DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPE_NAMES)}, got {dtype!r}")
  if weights not in WEIGHTS:
    raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
  if isinstance(spec, LocalSource) and spec.kind == "hf":
    if weights == "quantized":
      raise ValueError(f"weights='quantized' needs a GGUF file; {spec.path} is a Hugging Face directory of float "
                       "weights")
    model = _load_hf_dir(spec, dtype, progress)
    return scanned(model, consume=True) if scan_layers else model
  if isinstance(spec, registry.ModelSpec) and spec.arch not in gguf_convert.SUPPORTED_ARCHS:
    gguf_convert.config_from_gguf({}, spec.arch)  # raises NotImplementedError naming what Decoder lacks
  path = converted_cache_path(spec.cache_name if isinstance(spec, LocalSource) else spec.name, dtype, cache_dir,
                              weights)
  loaded = _load_or_convert(spec, path, dtype, cache_dir, weights, progress, scan_layers)
  config, params, tokenizer = loaded
  del loaded
  model = LoadedModel(config=config, params=params, tokenizer=tokenizer, spec=spec)
  if scan_layers:  # on the host arrays, before they move to the device (read stacked already: nothing to do)
    model = scanned(model, consume=True)
  _device_put_in_place(model.params)
  return model


def _load_or_convert(spec, path: pathlib.Path, dtype: str, cache_dir, weights: str, progress: bool,
                     scan_layers: bool) -> tuple:
  """``(config, params, tokenizer)`` from the converted file ``path``, converting ``spec``'s GGUF into it first when
  it is absent or unusable (once, under a lock other processes share: one that converted it meanwhile is read)."""
  name = spec.name
  seen = registry.file_id(path)
  loaded = None if seen is None else _try_load(path, spec, dtype, scan_layers, weights)
  if loaded is not None:
    return loaded
  registry.check_writable_dir(path.parent, f"the converted parameters of {name} ({dtype})")  # before any work
  with registry.cache_lock(path.with_name(path.name + ".lock"), f"converting {name} ({dtype}) into {path}") as locked:
    now = registry.file_id(path)
    if now is not None and now != seen:
      loaded = _try_load(path, spec, dtype, scan_layers, weights)  # converted by another process meanwhile
    if loaded is None:
      loaded = _convert_into(path, spec, dtype, cache_dir, weights, progress, replace=now is not None, locked=locked)
  return loaded


def _convert_into(path: pathlib.Path, spec, dtype: str, cache_dir, weights: str, progress: bool, *, replace: bool,
                  locked) -> tuple:
  """Convert ``spec``'s GGUF (fetched for a registry model) and save it as ``path`` (``replace``: in place of an
  unusable file there), holding the conversion lock ``locked``; returns ``(config, params, tokenizer)``."""
  name = spec.name
  registry.remove_stale(path.parent, path.name + ".partial-", locked)  # left by killed runs
  if replace:
    try:
      path.unlink(missing_ok=True)
    except OSError as e:
      raise registry.cache_dir_error(path.parent, f"a fresh {path.name} in place of the unusable one", e) from e
  gguf_path = spec.path if isinstance(spec, LocalSource) else registry.fetch_gguf(spec, cache_dir, progress=progress)
  contents = gguf_convert.read_gguf(gguf_path)
  tokenizer = _gguf_tokenizer(contents)  # before the long part: a broken tokenizer fails fast
  # The tensor infos give the size before converting (a stand-in without them, as tests install, is checked by _save
  # alone, with the exact size).
  if isinstance(contents, gguf_convert.GGUFContents):
    _check_free_space(path.parent, _estimated_bytes(contents, dtype, weights), f"the converted parameters of "
                      f"{name} ({dtype}, {path.name})")
  config, params_np = gguf_convert.convert(contents, dtype=dtype, progress=progress, quantized=weights == "quantized")
  del contents
  _save(path, config, params_np, tokenizer, dtype, spec, weights)
  return config, params_np, tokenizer


def scanned(model: LoadedModel, consume: bool = False) -> LoadedModel:
  """``model`` in the decoding layout (layers stacked, ``config.scan_layers``; the same model, bit for bit).
  ``consume``: take the layers out of ``model``'s own parameter dict while stacking (no second copy; only for a model
  nothing else holds)."""
  if model.config.scan_layers:
    return model
  params = stack_layers(model.params["params"], model.config.num_layers, consume=consume)
  return dataclasses.replace(model, config=dataclasses.replace(model.config, scan_layers=True),
                             params={"params": params})


def _device_put_in_place(tree: dict) -> None:
  """Replace every numpy leaf of ``tree`` by a device array, one at a time, dropping the host copy as it goes: peak
  memory is the model plus one tensor, not two copies of the model (1.5B in float32: 6 GB instead of 12 GB). On
  the CPU a 64-byte-aligned leaf (what :func:`_load` reads) becomes the device buffer itself, without a copy."""
  for key, value in tree.items():
    if isinstance(value, dict):
      _device_put_in_place(value)
    else:
      tree[key] = jax.block_until_ready(jax.device_put(value))
      del value


def check_model_name(name: str | os.PathLike) -> None:
  """Raise the error :func:`load_model` would raise for a name that is neither a registry name nor an existing
  checkpoint path, without loading or hashing anything (jobs call it before their first model load)."""
  _source(name, checksum=False)
