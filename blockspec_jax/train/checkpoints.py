"""Training checkpoints with integrity: orbax writes them, a SHA-256 record of every file says whether they are intact.

    manager = make_manager(workdir / "checkpoints", max_to_keep=3, every=100)   # orbax CheckpointManager, synchronous
    save(manager, step, state, force=False)            # orbax's save, then the record of that step's files
    found = restore(workdir / "checkpoints", template)  # the newest intact step: Restored(value, step, verified)

Records. After orbax has saved (and finalized) step ``s`` in ``<dir>``, :func:`save` writes
``<dir>_sha256/<s>.json`` (beside the orbax directory, never inside it, so orbax neither sees nor trips over it;
written atomically): the size and SHA-256 of every file under ``<dir>/<s>``. Records of steps orbax has deleted
(``max_to_keep``) are removed at each save, and so is a stale record of a step about to be saved anew.

Restoring. :func:`restore` walks the kept steps newest first. A step is *verified* when its record matches its files
exactly (no file missing, none extra, every size and digest equal); a verified step that orbax restores is used. A
step whose files differ from its record, or that orbax fails to restore for any reason (a zero-length file, a missing
``_METADATA``, anything orbax raises), is *damaged*: one line on stderr names it, the reason and the step used
instead, and the next older step is tried. Orbax's own logging and its asyncio tracebacks during a failed attempt are
held back, and so are asyncio's reports about orbax's abandoned reads that arrive later (up to interpreter exit), so
a damaged step costs that one line, not pages of tracebacks.

A step without a record (saved before records existed, or a run killed between orbax's save and the record) is
*unverified*. It takes its place in the walk, newest first: it is used when orbax restores it, always with a line
saying it was not verified, and passed over as damaged when orbax cannot. So an unverified step is never used
silently, is used only when no newer step is intact, and a newer verified step always wins over it. It is not passed
over for an older verified step: the record is written right after orbax's save, which is atomic (a finished step
directory or none), so the newest step lacking one is almost always a run killed in that short window, with complete
files; a damaged one that orbax still reads cannot be told from it, hence the line. A record that exists but cannot
be read counts as missing (its step is unverified), never as proof.

When no kept step is intact, :class:`DamagedCheckpointError` (a ValueError: a ``checks.UsageError``) says so in one line, naming the directory
and each step's reason, and that deleting the directory starts the run over. When every step is intact but none
restores into the template (a run resumed with other settings), a plain ValueError says that instead. With an
explicit ``step`` there is no fallback: that step damaged is the error. Errors and lines never carry orbax's
traceback: its exception (the innermost cause) is cut to one line of at most about 240 characters.

:func:`restore` only reads. A resumed run (``trainer.fit``) calls :func:`delete_after` on the steps it passed over:
they are newer than the step it resumes from, orbax would refuse to save those steps again, and the run recomputes
them exactly.

Only process 0 of a multi-host run writes or deletes records; every process verifies the same files, so all choose
the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pathlib
import sys
from typing import Any

import jax

from blockspec_jax.artifacts import atomic_write
from blockspec_jax.checks import UsageError

__all__ = ["DamagedCheckpointError", "Restored", "records_dir", "make_manager", "save", "restore", "delete_after",
           "verify_step"]

_FORMAT = 1
_CHUNK = 1 << 20
_PREFIX = "[blockspec_jax]"


class DamagedCheckpointError(UsageError):
  """No usable checkpoint: every kept step (or the one asked for) is damaged. The message is one line (a UsageError:
  the command lines print it without a traceback)."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What :func:`restore` found: the restored tree, its step, whether its files matched their record, and the newer
  steps passed over as ``((step, why), …)``, newest first."""
  value: Any
  step: int
  verified: bool
  skipped: tuple[tuple[int, str], ...] = ()


def records_dir(directory) -> pathlib.Path:
  """Where the records of the checkpoints in ``directory`` live: ``<directory>_sha256`` beside it."""
  directory = pathlib.Path(directory).expanduser().absolute()
  return directory.with_name(f"{directory.name}_sha256")


def _record_path(directory: pathlib.Path, step: int) -> pathlib.Path:
  return records_dir(directory) / f"{int(step)}.json"


def _is_main() -> bool:
  return jax.process_index() == 0


def make_manager(directory, max_to_keep: int, every: int):
  """An orbax ``CheckpointManager`` on ``directory`` (created when absent) saving synchronously every ``every``
  steps (a forced save regardless) and keeping the ``max_to_keep`` newest steps."""
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=every, create=True,
                                         enable_async_checkpointing=False)
  with _quiet():
    return ocp.CheckpointManager(pathlib.Path(directory).expanduser().absolute(), options=options)


def _step_files(step_dir: pathlib.Path) -> dict[str, pathlib.Path]:
  return {p.relative_to(step_dir).as_posix(): p for p in sorted(step_dir.rglob("*")) if not p.is_dir()}


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def _prune_records(directory: pathlib.Path) -> None:
  """Removes the records of steps that are no longer in ``directory`` (deleted by orbax or by hand)."""
  folder = records_dir(directory)
  if not folder.is_dir():
    return
  for path in folder.glob("*.json"):
    if path.stem.isdigit() and not (directory / path.stem).exists():
      path.unlink(missing_ok=True)


def save(manager, step: int, state, force: bool = False) -> bool:
  """Orbax's (synchronous, finalized) save of ``state`` at ``step`` when the manager's interval or ``force`` says so,
  then the record of that step's files (size and SHA-256 of each, written atomically). Returns whether it saved.
  Records of steps no longer kept are removed."""
  import orbax.checkpoint as ocp
  directory = pathlib.Path(manager.directory)
  if _is_main():
    _prune_records(directory)  # includes a stale record of ``step`` left by an earlier run in this directory
  saved = manager.save(step, args=ocp.args.StandardSave(state), force=force)
  manager.wait_until_finished()
  if _is_main():
    if saved:
      step_dir = directory / str(int(step))
      files = {rel: {"size": path.stat().st_size, "sha256": _sha256(path)}
               for rel, path in _step_files(step_dir).items()}
      record = {"format": _FORMAT, "step": int(step), "files": files}
      folder = records_dir(directory)
      folder.mkdir(parents=True, exist_ok=True)
      atomic_write(folder / f"{int(step)}.json", (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    _prune_records(directory)
  return bool(saved)


def _read_record(directory: pathlib.Path, step: int) -> tuple[dict | None, str]:
  """``(files, "")`` of the step's record, or ``(None, why it is unverified)``."""
  path = _record_path(directory, step)
  if not path.is_file():
    return None, (f"no record of its files' SHA-256 in {path.parent}: saved by a version that did not record them, "
                  "or the run stopped before it could")
  try:
    record = json.loads(path.read_text())
    files = record["files"]
    if record.get("format") != _FORMAT or int(record["step"]) != int(step) or not isinstance(files, dict):
      raise ValueError("not a record of this step in this format")
    for rel, entry in files.items():
      if not isinstance(rel, str) or not isinstance(entry["sha256"], str) or not isinstance(entry["size"], int):
        raise ValueError(f"bad entry for {rel!r}")
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return None, f"its record {path} is unreadable ({type(e).__name__}: {e})"
  return files, ""


def verify_step(directory, step: int) -> tuple[bool | None, str]:
  """Whether the files of ``<directory>/<step>`` match their record: ``(True, "")``; ``(False, what differs)``
  (the first difference found: a file missing, one not recorded, a size, then a digest); ``(None, why)`` when the
  step has no readable record."""
  directory = pathlib.Path(directory).expanduser().absolute()
  recorded, why = _read_record(directory, step)
  if recorded is None:
    return None, why
  present = _step_files(directory / str(int(step)))
  missing = sorted(set(recorded) - set(present))
  if missing:
    more = f" (and {len(missing) - 1} more files)" if len(missing) > 1 else ""
    return False, f"{missing[0]} is missing{more}"
  extra = sorted(set(present) - set(recorded))
  if extra:
    return False, f"{extra[0]} was not there when it was saved"
  for rel in sorted(recorded):
    size, want = present[rel].stat().st_size, recorded[rel]["size"]
    if size != want:
      return False, (f"{rel} is empty, {want} bytes when it was saved" if size == 0 else
                     f"{rel} is {size} bytes, {want} when it was saved")
  for rel in sorted(recorded):
    if _sha256(present[rel]) != recorded[rel]["sha256"]:
      return False, f"{rel}: sha256 differs from the one recorded when it was saved"
  return True, ""


def _in_orbax(exc: BaseException | None, tb, obj=None) -> bool:
  """Whether an exception is debris of orbax's failed restore: the ``RuntimeError('Event loop is closed')`` that
  tensorstore's late callbacks raise once orbax has closed its event loop (one per pending read), or an exception
  raised in orbax's own code (``tb`` passes through it), or one reported about a coroutine of orbax's (``obj``:
  its abandoned read coroutines, reported when they are collected)."""
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
    return True
  code = getattr(obj, "cr_code", None)
  if code is not None and _ORBAX_DIR in code.co_filename:
    return True
  while tb is not None:
    if _ORBAX_DIR in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


def _drop_orbax_debris(previous):
  """An unraisable hook that drops what :func:`_in_orbax` recognises and passes everything else to ``previous``."""
  def hook(unraisable):
    if not _in_orbax(unraisable.exc_value, unraisable.exc_traceback, unraisable.object):
      previous(unraisable)
  hook.blockspec_quiet = True
  return hook


class _OrbaxTaskFilter(logging.Filter):
  """Drops asyncio's reports about orbax's tasks: "Task exception was never retrieved" for an exception raised in
  orbax's code, "Task was destroyed but it is pending!" for a task running an orbax coroutine. Orbax runs its reads in
  a loop it closes without cancelling the reads still pending, and asyncio reports those tasks whenever the garbage
  collector reaches them, possibly only at interpreter exit. Every other record passes."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc, tb = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
    if exc is not None and _in_orbax(exc, tb):
      return False
    return not (record.msg and "Task" in str(record.msg) and _ORBAX_DIR in record.getMessage())


_ASYNCIO_FILTER = _OrbaxTaskFilter()


@contextlib.contextmanager
def _quiet():
  """Holds back orbax's absl warnings and asyncio's error logs for the duration, and the debris of a failed restore
  for good: it arrives from tensorstore's threads and the garbage collector after the failure, possibly only at exit,
  so once a block has raised, a filter of ``sys.unraisablehook`` (:func:`_drop_orbax_debris`) and one of the asyncio
  logger (:class:`_OrbaxTaskFilter`) stay in place; they drop nothing else."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  levels = [logger.level for logger in loggers]
  previous = sys.unraisablehook
  installed = getattr(previous, "blockspec_quiet", False)
  if not installed:
    sys.unraisablehook = _drop_orbax_debris(previous)
  asyncio_logger = loggers[1]
  filtered = _ASYNCIO_FILTER in asyncio_logger.filters
  asyncio_logger.addFilter(_ASYNCIO_FILTER)
  for logger in loggers:
    logger.setLevel(logging.CRITICAL + 1)
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    raise
  finally:
    if failed:
      gc.collect()  # asyncio reports never-retrieved task exceptions when the tasks are collected: here, silently
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)
    if not failed and not installed and getattr(sys.unraisablehook, "blockspec_quiet", False):
      sys.unraisablehook = previous
    if not failed and not filtered:
      asyncio_logger.removeFilter(_ASYNCIO_FILTER)


def _one_line(e: BaseException) -> str:
  """``"<type>: <message>"`` of the innermost explicit cause (orbax wraps tensorstore's errors in a generic
  Exception), on one line, at most about 240 characters."""
  seen = {id(e)}
  while e.__cause__ is not None and id(e.__cause__) not in seen:
    e = e.__cause__
    seen.add(id(e))
  text = " ".join(str(e).split())
  if len(text) > 240:
    text = text[:237] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _restore_step(manager, step: int, template) -> tuple[Any, str]:
  """``(tree, "")`` or ``(None, why orbax could not restore it)``; never raises but for KeyboardInterrupt and
  SystemExit."""
  import orbax.checkpoint as ocp
  try:
    with _quiet():
      if template is None:
        args = ocp.args.StandardRestore()
      else:
        args = ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, template))
      return manager.restore(step, args=args), ""
  except Exception as e:  # noqa: BLE001  (whatever orbax or tensorstore raise: reported as one line)
    return None, f"orbax cannot restore it: {_one_line(e)}"


def _step_label(directory: pathlib.Path, step: int) -> str:
  return f"checkpoint step {step} ({directory / str(step)})"


def _say(line: str) -> None:
  print(f"{_PREFIX} {line}", file=sys.stderr, flush=True)


def restore(directory, template=None, *, step: int | None = None, verb: str = "resuming from",
            discarding: bool = False) -> Restored | None:
  """The newest intact checkpoint in ``directory`` (see the module docstring), restored into ``template``'s
  structure (``None``: the saved tree as orbax builds it); None when ``directory`` holds no step.

  ``step``: that step only: it must be kept (ValueError naming the kept steps), and damaged it is a
  :class:`DamagedCheckpointError`; unverified it is restored with a line saying so. ``verb`` words the lines
  (``"resuming from"``, ``"loading"``); ``discarding``: the lines add that the newer steps passed over will be
  deleted (the caller's :func:`delete_after`).
  """
  import orbax.checkpoint as ocp
  directory = pathlib.Path(directory).expanduser().absolute()
  if not directory.is_dir():
    return None
  with _quiet():
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False, read_only=True))
  try:
    kept = sorted(manager.all_steps(), reverse=True)
    if not kept:
      return None
    if step is not None:
      return _restore_one(manager, directory, int(step), kept, template, verb)
    # Steps passed over, as (step, kind, why): kind "damaged" (files differ from their record, or a step without a
    # record that orbax cannot restore) or "unfit" (files as recorded, but orbax cannot restore them into ``template``).
    skipped: list[tuple[int, str, str]] = []
    for s in kept:
      verified, why = verify_step(directory, s)
      if verified is False:
        skipped.append((s, "damaged", why))
        continue
      value, failure = _restore_step(manager, s, template)
      if value is None:
        if verified:
          skipped.append((s, "unfit", f"its files match their record but {failure}"))
        else:
          skipped.append((s, "damaged", f"it is not verified and {failure}"))
        continue
      _report(directory, skipped, s, verb, discarding)
      if not verified:
        _say(f"{_step_label(directory, s)} is not verified ({why}); {verb} it unverified")
      return Restored(value, s, bool(verified), tuple((k, w) for k, _, w in skipped))
    reasons = "; ".join(f"step {s}: {why}" for s, _, why in sorted(skipped, reverse=True))
    if all(kind == "unfit" for _, kind, _ in skipped):
      raise ValueError(f"the checkpoints in {directory} are intact but do not restore into this run's state (saved "
                       f"with other settings?): {reasons}; run with the settings they were saved with, or delete "
                       f"{directory} to start the run over")
    raise DamagedCheckpointError(f"no intact checkpoint in {directory} ({reasons}); delete {directory} to start the "
                                 "run over")
  finally:
    manager.close()


def _restore_one(manager, directory: pathlib.Path, step: int, kept: list[int], template, verb: str) -> Restored:
  if step not in kept:
    raise ValueError(f"no checkpoint of step {step} in {directory}; kept steps: {sorted(kept)}")
  others = ", ".join(str(s) for s in sorted(kept) if s != step) or "none"
  verified, why = verify_step(directory, step)
  if verified is False:
    raise DamagedCheckpointError(f"{_step_label(directory, step)} is damaged ({why}); other kept steps: {others}")
  value, failure = _restore_step(manager, step, template)
  if value is None:
    if verified:
      raise ValueError(f"{_step_label(directory, step)} is intact but does not restore into this state (saved with "
                       f"other settings?): {failure}")
    raise DamagedCheckpointError(f"{_step_label(directory, step)} is damaged (it is not verified and {failure}); "
                                 f"other kept steps: {others}")
  if not verified:
    _say(f"{_step_label(directory, step)} is not verified ({why}); {verb} it unverified")
  return Restored(value, step, bool(verified))


def _report(directory: pathlib.Path, passed, used: int, verb: str, discarding: bool) -> None:
  for s, kind, why in passed:
    what = "cannot be restored" if kind == "unfit" else "is damaged"
    deleted = f" (step {s} is deleted: the run saves it again)" if discarding else ""
    _say(f"{_step_label(directory, s)} {what} ({why}); {verb} step {used} instead{deleted}")


def delete_after(manager, step: int) -> list[int]:
  """Deletes the kept steps newer than ``step`` (those a resumed run passed over; it saves them again) and their
  records. Returns the deleted steps."""
  directory = pathlib.Path(manager.directory)
  newer = sorted(s for s in manager.all_steps() if s > step)
  for s in newer:
    with _quiet():
      manager.delete(s)
    if _is_main():
      _record_path(directory, s).unlink(missing_ok=True)
  return newer
