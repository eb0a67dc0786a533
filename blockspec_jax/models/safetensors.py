"""Safetensors weight files, read with every header field checked before any tensor is touched.

    files = safetensors_files(directory)              # the index's shards, or every *.safetensors file
    header_len, entries = read_safetensors_header(f)  # validated: dtypes, shapes (Python ints), offsets, no overlaps
    for name, array in iter_tensors(files): ...       # numpy arrays (memory-mapped reads)

A hostile or damaged header (a shape whose byte count overflows int64, offsets past the file or overlapping, unknown
dtypes, malformed entries) is a ValueError naming the file and the entry, raised before anything is allocated.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

__all__ = ["INDEX_FILE", "safetensors_files", "read_safetensors_header", "iter_tensors"]

INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: pathlib.Path) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
  return value


# safetensors dtype names → numpy dtypes (little-endian); FP8 and other exotic types are refused by name.
_ST_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(jnp.bfloat16),
              "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
              "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
# Dtypes of the format that the reader refuses by name (NotImplementedError); any other unknown name is an error.
_ST_UNSUPPORTED = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "U16", "U32", "U64", "C64")
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit



def safetensors_files(directory: os.PathLike | str) -> list[pathlib.Path]:
  """The weight files: the shards named by ``model.safetensors.index.json`` when present, else every
  ``*.safetensors`` file (sorted). FileNotFoundError naming a missing shard or the absence of any file."""
  directory = pathlib.Path(directory)
  index_path = directory / INDEX_FILE
  if index_path.is_file():
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise ValueError(f"{index_path} has no weight_map")
    names = list(dict.fromkeys(weight_map.values()))
    bad = [n for n in names if not isinstance(n, str) or pathlib.PurePath(n).name != n or n in ("", ".", "..")]
    if bad:
      raise ValueError(f"{index_path}: weight_map must name shard files of the directory itself, got {_short(bad[0])}")
    files = [directory / name for name in names]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
      raise FileNotFoundError(f"{directory}: shards named by {INDEX_FILE} are missing: {missing}")
    return files
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{directory} has no *.safetensors files (model weights)")
  return files


def _header_object(pairs: list[tuple[str, Any]]) -> dict:
  """``json.loads`` object hook: a dict, refusing a key given twice (the header would be ambiguous)."""
  seen: set[str] = set()
  for key, _ in pairs:
    if key in seen:
      raise ValueError(f"key {key!r} appears twice")
    seen.add(key)
  return dict(pairs)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _nbytes(shape: list[int], itemsize: int, limit: int) -> int:
  """Bytes of a tensor of ``shape``, exact in Python ints (``[2**32, 2**32]`` does not wrap around as in int64);
  once past ``limit`` the product stops growing (any value above ``limit`` will do for the caller)."""
  if 0 in shape:
    return 0
  nbytes = itemsize
  for d in shape:
    nbytes *= d
    if nbytes > limit:
      break
  return nbytes


def read_safetensors_header(path: os.PathLike | str) -> tuple[int, dict[str, dict]]:
  """``(data offset, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file (``__metadata__``
  dropped).

  Every entry is checked before it is used: the header a JSON object (of at most the file's size and the format's
  100 MB) of objects, ``__metadata__`` an object of strings, ``dtype`` a known name, ``shape`` a list of
  non-negative ints, ``data_offsets`` two ints with 0 <= begin <= end <= the data size and end - begin = elements ×
  item size (exact integer arithmetic), no two tensors overlapping. Raises ValueError naming the file (and the
  tensor) for anything else; NotImplementedError for a safetensors dtype the reader does not handle (e.g. FP8).
  """
  path = pathlib.Path(path)
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
    n = int.from_bytes(head, "little")
    if n > min(_MAX_HEADER_BYTES, size - 8):
      raise ValueError(f"{path} is not a safetensors file (header length {n} does not fit the file: "
                       f"{size - 8} bytes follow the length, and the format allows at most {_MAX_HEADER_BYTES})")
    try:
      header = json.loads(f.read(n), object_pairs_hook=_header_object)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      raise ValueError(f"{path} is not a safetensors file (unreadable header: {e})") from e
  if not isinstance(header, dict):
    raise ValueError(f"{path} is not a safetensors file (its header is a JSON {type(header).__name__}, not an "
                     "object)")
  metadata = header.pop("__metadata__", {})
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise ValueError(f"{path}: the safetensors header's __metadata__ must be an object of strings, got "
                     f"{_short(metadata)}")
  start = 8 + n
  data_size = size - start
  spans = []
  for name, info in header.items():
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
      raise ValueError(f"{where}: its header entry must be an object with dtype, shape and data_offsets, got "
                       f"{_short(info)}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
      raise ValueError(f"{where}: dtype must be a string, got {_short(dtype)}")
    if dtype not in _ST_DTYPES:
      if dtype in _ST_UNSUPPORTED:
        raise NotImplementedError(f"{where} has dtype {dtype!r}; supported: {tuple(_ST_DTYPES)}")
      raise ValueError(f"{where}: dtype {_short(dtype)} is not a safetensors dtype; supported: {tuple(_ST_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
      raise ValueError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
      raise ValueError(f"{where}: data_offsets must be a list of two integers, got {_short(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
      raise ValueError(f"{where}: data_offsets {offsets} do not lie within the file's {data_size} data bytes (the "
                       "file is truncated or damaged)")
    nbytes = _nbytes(shape, _ST_DTYPES[dtype].itemsize, data_size)
    if end - begin != nbytes:
      needs = f"more than the file's {data_size} data bytes" if nbytes > data_size else f"{nbytes} bytes"
      raise ValueError(f"{where}: data_offsets {offsets} span {end - begin} bytes, but {dtype} {_short(shape)} "
                       f"needs {needs}")
    spans.append((begin, end, name))
  spans.sort()
  for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:]):
    if begin1 < end0:
      raise ValueError(f"{path}: tensors {name0!r} and {name1!r} overlap (data_offsets {header[name0]['data_offsets']}"
                       f" and {header[name1]['data_offsets']})")
  return start, header


def iter_tensors(files: list[pathlib.Path], headers: dict[pathlib.Path, tuple[int, dict]] | None = None
                 ) -> Iterator[tuple[str, pathlib.Path, np.ndarray]]:
  """``(name, file, read-only memory-mapped array)`` of every tensor of ``files`` (nothing is read until used);
  ``headers``: ``read_safetensors_header`` of each file when already read."""
  for path in files:
    start, header = headers[path] if headers is not None else read_safetensors_header(path)
    if not header:
      continue
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    try:
      for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = mapped[start + begin:start + end]
        yield name, path, raw.view(_ST_DTYPES[info["dtype"]]).reshape(tuple(info["shape"]))
    finally:
      del mapped


def _tensor_files(headers: dict[pathlib.Path, tuple[int, dict]]) -> dict[str, pathlib.Path]:
  """Tensor name → the file holding it; ValueError for a name in two files."""
  names: dict[str, pathlib.Path] = {}
  for path, (_, header) in headers.items():
    for name in header:
      if name in names:
        raise ValueError(f"{path.parent}: tensor {name} is in both {names[name].name} and {path.name}")
      names[name] = path
  return names
