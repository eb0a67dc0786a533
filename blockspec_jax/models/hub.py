"""One call from a registry name to a ready model: config, parameters, tokenizer.

    model = load_model("smollm2-135m", dtype="float32")
    logits_BxTxV, cache = Decoder(model.config).apply(model.params, tokens_BxT, positions_BxT, cache, mask_BxTxS)
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))

The first load fetches the GGUF (registry.fetch_gguf), converts it (gguf_convert.convert) and writes
``<cache>/converted/<name>.<dtype>.npz``: one array per parameter (key = tree path joined by ".") plus ``__meta__``,
a JSON string with the config, the tokenizer and the GGUF's SHA-256. Later loads read only that file (no GGUF
parsing, no dequantisation). A cache file that cannot be read, or was made from another GGUF or format version, is
deleted (with a message on stderr) and rebuilt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.models import gguf_convert, registry
from blockspec_jax.models.decoder import DecoderConfig
from blockspec_jax.models.tokenizer import TokenizerWrapper, tokenizer_from_gguf

__all__ = ["LoadedModel", "load_model", "converted_cache_path"]

_FORMAT_VERSION = 3  # 2: linear weights stored (out, in) as "weight"; 3: Gemma tokenizer without invented ids
_META_KEY = "__meta__"
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  """A real model ready for ``Decoder(config).apply(params, ...)``; ``params = {"params": tree}`` (jax arrays)."""
  config: DecoderConfig
  params: Any
  tokenizer: TokenizerWrapper
  spec: registry.ModelSpec

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Token ids that end a generation (EOS)."""
    return () if self.tokenizer.eos_id is None else (self.tokenizer.eos_id,)


def converted_cache_path(name: str, dtype: str = "float32", cache_dir: os.PathLike | str | None = None
                         ) -> pathlib.Path:
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else registry.default_cache_dir()
  return cache / "converted" / f"{name}.{dtype}.npz"


def _config_to_json(config: DecoderConfig) -> dict:
  fields = dataclasses.asdict(config)
  fields["dtype"] = jnp.dtype(config.dtype).name
  return fields


def _config_from_json(fields: dict) -> DecoderConfig:
  fields = dict(fields)
  fields["dtype"] = _DTYPE_NAMES[fields["dtype"]]
  return DecoderConfig(**fields)


def _save(path: pathlib.Path, config: DecoderConfig, params: dict, tokenizer: TokenizerWrapper, dtype: str,
          spec: registry.ModelSpec) -> None:
  arrays = {}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params["params"])[0]:
    key = ".".join(k.key for k in key_path)
    leaf = np.asarray(leaf)
    arrays[key] = leaf.view(np.uint16) if dtype == "bfloat16" else leaf  # .npy cannot spell bfloat16
  meta = dict(format=_FORMAT_VERSION, name=spec.name, dtype=dtype, gguf_sha256=spec.sha256,
              config=_config_to_json(config), tokenizer=tokenizer.to_json())
  arrays[_META_KEY] = np.array(json.dumps(meta))
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + f".partial-{os.getpid()}.npz")
  try:
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def _load(path: pathlib.Path, spec: registry.ModelSpec, dtype: str):
  """``(config, params numpy tree, tokenizer)`` from a cache file; raises ValueError if it is stale or broken."""
  with np.load(path, allow_pickle=False) as npz:
    meta = json.loads(str(npz[_META_KEY]))
    if meta.get("format") != _FORMAT_VERSION or meta.get("gguf_sha256") != spec.sha256 or meta.get("dtype") != dtype:
      raise ValueError("made by another format version, GGUF file or dtype")
    config = _config_from_json(meta["config"])
    expected = gguf_convert.param_shapes(config)
    keys = set(npz.files) - {_META_KEY}
    if keys != {".".join(p) for p in expected}:
      raise ValueError("parameter names do not match the config")
    tree: dict = {}
    for param_path, shape in expected.items():
      value = npz[".".join(param_path)]
      if dtype == "bfloat16":
        value = value.view(jnp.bfloat16)
      if value.shape != shape:
        raise ValueError(f"{'/'.join(param_path)} has shape {value.shape}, expected {shape}")
      node = tree
      for key in param_path[:-1]:
        node = node.setdefault(key, {})
      node[param_path[-1]] = value
  return config, {"params": tree}, TokenizerWrapper.from_json(meta["tokenizer"])


def load_model(name: str, dtype: str = "float32", cache_dir: os.PathLike | str | None = None,
               progress: bool = True) -> LoadedModel:
  """Fetch (once), convert (once) and load registry model ``name`` with parameters in ``dtype``.

  Args:
    name: a key of ``registry.MODELS``.
    dtype: "float32" or "bfloat16" (parameters and the config's compute dtype).
    cache_dir: cache directory (default ``registry.default_cache_dir()``: $BLOCKSPEC_JAX_CACHE or
      ~/.cache/blockspec_jax); holds the GGUF and ``converted/<name>.<dtype>.npz``.
    progress: progress bars while fetching and converting.
  Raises:
    ValueError: unknown name or dtype.  NotImplementedError: an architecture Decoder cannot run.
    registry.FetchError: the GGUF could not be downloaded or verified.
  """
  spec = registry.get_spec(name)
  if dtype not in _DTYPE_NAMES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPE_NAMES)}, got {dtype!r}")
  if spec.arch not in gguf_convert.SUPPORTED_ARCHS:
    gguf_convert.config_from_gguf({}, spec.arch)  # raises NotImplementedError naming what Decoder lacks
  path = converted_cache_path(name, dtype, cache_dir)
  loaded = None
  if path.exists():
    try:
      loaded = _load(path, spec, dtype)
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
      print(f"[blockspec_jax] converted cache {path} is unusable ({type(e).__name__}: {e}); deleting it and "
            "converting again", file=sys.stderr)
      path.unlink(missing_ok=True)
  if loaded is None:
    gguf_path = registry.fetch_gguf(spec, cache_dir, progress=progress)
    contents = gguf_convert.read_gguf(gguf_path)
    config, params_np = gguf_convert.convert(contents, dtype=dtype, progress=progress)
    tokenizer = tokenizer_from_gguf(contents.metadata)
    del contents
    _save(path, config, params_np, tokenizer, dtype, spec)
    loaded = config, params_np, tokenizer
  config, params, tokenizer = loaded
  del loaded
  _device_put_in_place(params)
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, spec=spec)


def _device_put_in_place(tree: dict) -> None:
  """Replace every numpy leaf of ``tree`` by a device array, one at a time, dropping the host copy as it goes: peak
  memory is the model plus one tensor, not two copies of the model (1.5B in float32: 6 GB instead of 12 GB)."""
  for key, value in tree.items():
    if isinstance(value, dict):
      _device_put_in_place(value)
    else:
      tree[key] = jax.block_until_ready(jax.device_put(value))
      del value
