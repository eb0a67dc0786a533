"""Trained artifacts on disk: an ``.npz`` of arrays plus a ``.json`` record naming it and holding its SHA-256.

An :class:`Artifact` describes one kind (BPD heads, the SPRINTER head, the SD² map, the n-gram LM); the record names
the npz as ``<stem>_file`` and its digest as ``<stem>_sha256`` (``<stem>`` = the npz's name without ``.npz``)::

    HEADS = Artifact("heads.npz", "heads.json", what="BPD heads", absent="is not ...", remedy="rerun ...")
    HEADS.save(workdir, arrays, info, {"num_heads": 4, "d_model": 896})   # npz, then json: both atomic
    arrays, record = HEADS.load(workdir, convert={"num_heads": int}, names=("w1_HxDxD",), dtype=np.float32)

:meth:`Artifact.load` is :meth:`Artifact.read_record` (the json alone) then :meth:`Artifact.read_arrays`. Errors
name the file and the problem: FileNotFoundError for a missing directory or file, ValueError for a json that is
unreadable, of another format or lacking a field, and for an npz whose SHA-256 differs from the record's
(truncated, corrupted or tampered) or that is not a readable archive of the named arrays. Shape checks are the
caller's.

Caches of collected data (the target's samples, SPRINTER's labels, BPD's hidden states) are one npz that carries its
own settings: :func:`save_tagged` writes the arrays with a JSON ``meta`` inside, :func:`load_tagged` reads them back,
and :func:`changed_settings` names the settings a cache was made with that differ from a run's; :func:`read_matching`
is the one "read it if it was made like this, else refuse naming the differences" every such cache goes through.
NumPy and the standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import zipfile
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["atomic_write", "Artifact", "save_tagged", "load_tagged", "changed_settings", "read_matching"]


def atomic_write(path, data: bytes) -> None:
  """Write ``data`` to ``path`` through a temporary file in the same directory, fsynced and renamed over it: a
  killed writer leaves the old file or none, never a truncated one."""
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def save_tagged(path, arrays: Mapping[str, Any], meta: Mapping, *, names: Sequence[str] = ()) -> pathlib.Path:
  """Write ``arrays`` and ``meta`` (a JSON-able dict: how they were made, stored as the array ``meta``) to ``path``
  (an ``.npz``), atomically. ``names``: arrays that must be among ``arrays`` (ValueError naming those missing)."""
  missing = sorted(set(names) - set(arrays))
  if missing:
    raise ValueError(f"{pathlib.Path(path).name}: arrays {missing} missing")
  if "meta" in arrays:
    raise ValueError("an array may not be named 'meta' (it holds the settings)")
  buffer = io.BytesIO()
  np.savez(buffer, meta=np.asarray(json.dumps(dict(meta), sort_keys=True)),
           **{k: np.asarray(v) for k, v in arrays.items()})
  atomic_write(path, buffer.getvalue())
  return pathlib.Path(path)


def load_tagged(path, names: Sequence[str], *, what: str, redo: str) -> tuple[dict[str, np.ndarray], dict]:
  """``(arrays, meta)`` of a :func:`save_tagged` file: the arrays of ``names`` (as stored) and its settings.
  FileNotFoundError when ``path`` is absent; ValueError ``"<path> is not a readable <what> file (…); <redo>"`` when
  it is truncated, not an npz, lacks an array or holds no JSON object as ``meta``."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no {what} file {path}")
  try:
    with np.load(path, allow_pickle=False) as z:
      meta = json.loads(str(z["meta"]))
      if not isinstance(meta, dict):
        raise ValueError("its meta is not a JSON object")
      arrays = {k: np.asarray(z[k]) for k in names}
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
    raise ValueError(f"{path} is not a readable {what} file ({type(e).__name__}: {e}); {redo}") from None
  return arrays, meta


def changed_settings(meta: Mapping, saved: Mapping, *, compare_saved_keys: bool = True) -> list[str]:
  """The keys whose values differ between a run's settings ``meta`` and those a file was ``saved`` with, sorted;
  keys only ``saved`` has count too unless ``compare_saved_keys`` is False (files that also record facts found
  while collecting, such as V and D)."""
  keys = set(meta) | set(saved) if compare_saved_keys else set(meta)
  return sorted(k for k in keys if meta.get(k) != saved.get(k))


def read_matching(path, meta: Mapping, load: Callable[[pathlib.Path], tuple[Any, Mapping]], *, redo: str,
                  compare_saved_keys: bool = True):
  """The data of the cache ``path`` (read by ``load(path) -> (data, saved_meta)``, e.g. a :func:`load_tagged`
  call) when it exists and was made with ``meta``'s settings; None when absent. A cache made with other settings is
  a ValueError ``"<path> was collected with other settings (<keys> differ); use a fresh work directory or <redo>"``
  (keys as :func:`changed_settings` with ``compare_saved_keys``); ``load``'s own ValueError (a damaged file)
  passes through."""
  path = pathlib.Path(path)
  if not path.exists():
    return None
  data, saved = load(path)
  changed = changed_settings(meta, saved, compare_saved_keys=compare_saved_keys)
  if changed:
    raise ValueError(f"{path} was collected with other settings ({', '.join(changed)} differ); use a fresh work "
                     f"directory or {redo}")
  return data


@dataclasses.dataclass(frozen=True)
class Artifact:
  """One kind of stored artifact: ``<directory>/<npz_name>`` and ``<directory>/<json_name>``.

  ``what`` names the directory in errors ("BPD heads directory … does not exist"); ``absent`` ends the message for a
  directory without the json (``"<json> not found: <directory> <absent>"``: what the directory should have been and
  how to make one); ``remedy`` ends the messages for a damaged file ("rerun the heads' training job"). ``format``
  is the record's ``format`` field, written and checked.
  """
  npz_name: str
  json_name: str
  what: str
  absent: str
  remedy: str
  format: int = 1

  @property
  def file_key(self) -> str:
    return f"{pathlib.Path(self.npz_name).stem}_file"

  @property
  def sha256_key(self) -> str:
    return f"{pathlib.Path(self.npz_name).stem}_sha256"

  def paths(self, directory, record: Mapping | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """``(json_path, npz_path)`` in ``directory``: the npz that ``record`` names (its base name only), else
    ``npz_name``."""
    directory = pathlib.Path(directory).expanduser()
    npz_name = self.npz_name if record is None else pathlib.Path(str(record[self.file_key])).name
    return directory / self.json_name, directory / npz_name

  def save(self, directory, arrays: Mapping[str, Any], info: Mapping | None = None,
           fields: Mapping | None = None) -> pathlib.Path:
    """Write ``arrays`` (``np.savez``, names as given) to the npz and the record ``{**info, "format": format,
    **fields, <stem>_file, <stem>_sha256}`` (JSON, indent 2) to the json, each atomically, the npz first (a json
    always names a complete npz). ``directory`` is created. Returns the json's path."""
    directory = pathlib.Path(directory)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    record = {**(info or {}), "format": self.format, **(fields or {}), self.file_key: self.npz_name,
              self.sha256_key: hashlib.sha256(data).hexdigest()}
    text = json.dumps(record, indent=2) + "\n"  # before writing: a record that is not JSON-able writes nothing
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / self.npz_name, data)
    path = directory / self.json_name
    atomic_write(path, text.encode())
    return path

  def read_record(self, directory, *, required: Sequence[str] = (),
                  convert: Mapping[str, Callable] | None = None) -> dict:
    """The json's record. It must be a JSON object of this ``format`` with the npz's name and digest, every key of
    ``required`` and of ``convert``; ``convert[key]`` replaces ``record[key]`` by its result (e.g. ``int``), and
    an exception there (ValueError, TypeError, KeyError) reports the json as corrupted."""
    directory = pathlib.Path(directory).expanduser()
    if not directory.is_dir():
      raise FileNotFoundError(f"{self.what} directory {directory} does not exist")
    path = directory / self.json_name
    if not path.is_file():
      raise FileNotFoundError(f"{path} not found: {directory} {self.absent}")
    try:
      record = json.loads(path.read_text())
      if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is corrupted ({type(e).__name__}: {e}); {self.remedy}") from None
    if record.get("format") != self.format:
      raise ValueError(f"{path} is of format {record.get('format')!r}; this code reads format {self.format} "
                       f"({self.remedy})")
    try:
      for key in (self.file_key, self.sha256_key, *required, *(convert or {})):
        if key not in record:
          raise KeyError(key)
      for key, fn in (convert or {}).items():
        record[key] = fn(record[key])
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path} is corrupted ({type(e).__name__}: {e}); {self.remedy}") from None
    return record

  def read_arrays(self, directory, record: Mapping, *, names: Sequence[str] = (),
                  dtype=None) -> dict[str, np.ndarray]:
    """Every array of the npz that ``record`` (:meth:`read_record`) names, after checking its SHA-256; each one
    of ``names`` must be there. ``dtype``: cast them all (a failed cast reports the npz as corrupted)."""
    json_path, npz_path = self.paths(directory, record)
    if not npz_path.is_file():
      raise FileNotFoundError(f"{npz_path} not found (named by {json_path}); {self.remedy}")
    data = npz_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record[self.sha256_key]:
      raise ValueError(f"{npz_path} is corrupted: its SHA-256 does not match the one in {json_path}; "
                       f"{self.remedy}")
    try:
      with np.load(io.BytesIO(data), allow_pickle=False) as z:
        missing = [name for name in names if name not in z.files]
        if missing:
          raise KeyError(f"no arrays {missing}")
        return {name: np.asarray(z[name], dtype) for name in z.files}
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
      raise ValueError(f"{npz_path} is corrupted ({type(e).__name__}: {e}); {self.remedy}") from None

  def load(self, directory, *, required: Sequence[str] = (), convert: Mapping[str, Callable] | None = None,
           names: Sequence[str] = (), dtype=None) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, record)``: :meth:`read_record` then :meth:`read_arrays`."""
    record = self.read_record(directory, required=required, convert=convert)
    return self.read_arrays(directory, record, names=names, dtype=dtype), record
