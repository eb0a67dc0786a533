"""A generic trainer: any pytree of trainable parameters, any loss, one device or a data-parallel mesh.

    loss_fn(trainable, frozen, batch, key) -> (loss f32 [], aux {name: f32 []})

    optimizer = make_optimizer("adamw", learning_rate=1e-3, schedule="cosine", warmup_steps=10, total_steps=200)
    state = init_state(trainable, optimizer)                     # TrainState(step, trainable, opt_state)
    step = make_train_step(loss_fn, optimizer, mesh=None)        # jitted (state, frozen, batch, key) -> (state, m)
    result = fit(loss_fn=..., optimizer=..., trainable=..., frozen=..., batch_fn=..., key=key,
                 workdir="results/train/job", loop=Loop(num_steps=200))

``frozen`` (the target, a drafter's frozen layers, a base model under LoRA) is an argument of the step, never part
of the optimizer state, so optimizer moments exist only for trainable leaves.

Determinism and exact resume: step ``s`` uses ``batch_fn(s, trainable)`` (a pure function of the step number and
the current trainable parameters, which on-policy data needs) and ``jax.random.fold_in(key, s)``; checkpoints hold
the whole :class:`TrainState` (exact float32 arrays), so a run stopped after ``k`` steps and resumed by a new
:func:`fit` call on the same workdir reaches bit-identical parameters to an uninterrupted run.

Data (and model) parallelism: with a ``mesh`` (``blockspec_jax.parallel.make_mesh``; :class:`Loop`'s ``mesh`` for
:func:`fit`) the step is the same jitted function on inputs placed on the mesh: every batch leaf split over its
``data`` axis by its leading dimension, the frozen decoder parameters (a target the loss reads) over ``model`` as
``parallel`` lays out a model, the trainable parameters, optimizer state and key replicated. The loss is a mean over
the *global* batch (jit's semantics are global), so the gradient and the update equal one device's up to the order
of floating-point reductions.

Outputs of :func:`fit` in ``workdir``: ``metrics.jsonl`` (one JSON object per step, flushed at every write, so a
killed run keeps its curve; ``programs_compiled``: the programs XLA compiled inside that step's call, nonzero only at
a run's first step when nothing recompiles per step; lines past the restored step are dropped on resume),
``checkpoints/`` (orbax ``CheckpointManager``: every ``checkpoint_every`` steps, ``max_to_keep`` kept, and a final one), beside it
``checkpoints_sha256/`` (each kept step's file sizes and SHA-256, checked on resume: a damaged step is passed over
for the previous intact one, see :mod:`blockspec_jax.train.checkpoints`), and ``loss.png`` (when matplotlib is
installed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from blockspec_jax import parallel, runtime
from blockspec_jax.checks import check_int
from blockspec_jax.train import checkpoints as checkpoints_lib

__all__ = ["TrainState", "OPTIMIZERS", "SCHEDULES", "make_schedule", "make_optimizer", "by_part", "init_state",
           "train_step", "make_train_step", "FitResult", "Loop", "fit", "batch_indices", "fit_examples", "read_metrics",
           "eval_curves", "plot_losses", "restore_latest"]

LossFn = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, dict]]
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "constant")
DATA_AXIS = "data"


@struct.dataclass
class TrainState:
  """What a step changes: the step count (int32 []), the trainable pytree and the optimizer state over it."""
  step: jax.Array
  trainable: Any
  opt_state: Any


def make_schedule(learning_rate: float, schedule: str = "cosine", warmup_steps: int = 0,
                  total_steps: int = 1000) -> optax.Schedule:
  """Linear warmup from 0 over ``warmup_steps``, then ``"constant"`` or ``"cosine"`` decay to 0 at ``total_steps``."""
  if schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
  if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
    raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got warmup_steps = "
                     f"{warmup_steps}, total_steps = {total_steps}")
  if schedule == "cosine":
    if 0 < warmup_steps == total_steps:
      raise ValueError(f"a cosine schedule needs warmup_steps < total_steps (nothing is left to decay over), got "
                       f"warmup_steps = total_steps = {total_steps}")
    if warmup_steps == 0:
      return optax.cosine_decay_schedule(learning_rate, total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, total_steps)
  if warmup_steps == 0:
    return optax.constant_schedule(learning_rate)
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                               optax.constant_schedule(learning_rate)], [warmup_steps])


def make_optimizer(name: str = "adamw", learning_rate: float = 1e-3, schedule: str = "cosine",
                   warmup_steps: int = 0, total_steps: int = 1000, weight_decay: float = 0.0,
                   clip_norm: float | None = 1.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, accumulate: int = 1) -> optax.GradientTransformation:
  """``clip_by_global_norm(clip_norm)`` (left out when None or 0) then the optimizer with the learning-rate schedule.

  ``name``: "adamw" (decoupled ``weight_decay``), "adam" or "sgd" (plain, no momentum); ValueError otherwise.
  ``accumulate = k > 1``: gradient accumulation (``optax.MultiSteps``): the gradients of ``k`` consecutive steps are
  averaged, then clipped and applied as one update (parameters change on every k-th step only), so batch b with
  ``k`` is the update of batch ``k * b`` at the memory of batch b. ``total_steps`` still counts steps (micro-batches);
  the schedule runs over the ``ceil(total_steps / k)`` updates, and ``warmup_steps`` counts updates. The
  accumulated gradient and the micro-step counter are part of the optimizer state, so a run checkpointed between
  two updates resumes exactly.
  """
  if name not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
  accumulate = check_int(accumulate, "accumulate", hint=" (steps per update)")
  if accumulate > 1:
    inner = make_optimizer(name, learning_rate, schedule, warmup_steps, -(-total_steps // accumulate),
                           weight_decay, clip_norm, b1, b2, eps)
    return optax.MultiSteps(inner, every_k_schedule=accumulate).gradient_transformation()
  lr = make_schedule(learning_rate, schedule, warmup_steps, total_steps)
  if name == "adamw":
    opt = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  elif name == "adam":
    opt = optax.adam(lr, b1=b1, b2=b2, eps=eps)
  else:
    opt = optax.sgd(lr)
  if clip_norm:
    if clip_norm < 0:
      raise ValueError(f"clip_norm must be > 0 (or None / 0 for no clipping), got {clip_norm}")
    return optax.chain(optax.clip_by_global_norm(clip_norm), opt)
  return opt


def by_part(optimizers: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
  """One optimizer per top-level part of a dict trainable tree (``{"steer": adamw 3e-4, "drafter": adamw 1e-4}``):
  each part is updated, clipped and scheduled by its own (``optax.multi_transform``); ValueError at ``init`` when
  the tree's parts are not exactly the optimizers' names."""
  optimizers = dict(optimizers)

  def labels(tree):
    if not isinstance(tree, dict) or set(tree) != set(optimizers):
      parts = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
      raise ValueError(f"by_part: the trainable tree's parts {parts} are not the optimizers' {sorted(optimizers)}")
    return {name: jax.tree.map(lambda _, name=name: name, part) for name, part in tree.items()}

  return optax.multi_transform(optimizers, labels)


def init_state(trainable, optimizer: optax.GradientTransformation) -> TrainState:
  """Step 0: the optimizer state is built over ``trainable`` only."""
  if not jax.tree.leaves(trainable):
    raise ValueError("no trainable parameters (the trainable tree has no leaves)")
  return TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable, opt_state=optimizer.init(trainable))


def train_step(state: TrainState, frozen, batch, key: jax.Array, *, loss_fn: LossFn,
               optimizer: optax.GradientTransformation) -> tuple[TrainState, dict]:
  """One pure update: gradients of ``loss_fn`` in the trainable tree, the optimizer's update, ``step + 1``.

  Returns ``(new_state, metrics)``; metrics are ``loss``, ``grad_norm`` (before clipping) and the loss's aux values.
  """
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.trainable, frozen, batch, key)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
  trainable = optax.apply_updates(state.trainable, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **dict(aux)}
  return TrainState(step=state.step + 1, trainable=trainable, opt_state=opt_state), metrics


def _mesh_context(mesh: Mesh | None):
  if mesh is None:
    return contextlib.nullcontext()
  return jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh | None = None, *,
                    donate: bool = False):
  """The jitted step ``(state, frozen, batch, key) -> (state, metrics)``.

  ``donate``: the step takes its input state's buffers for the new state (``donate_argnums``), so the old and the new
  state (trainable parameters and optimizer moments: 12 bytes a parameter under Adam in float32) never coexist; the
  state passed in is deleted by the call, and any array it shares with the caller (the initial parameters) with it.
  :func:`fit` donates, on a copy of a fresh state.

  With ``mesh``: inputs are put on the mesh first (batch leaves split over ``data`` by their leading dimension,
  which must be a multiple of the axis size; decoder parameters inside ``frozen`` over ``model`` as
  ``parallel.param_shardings`` lays them out, so a ``(data, model)`` mesh holds a frozen target split over ``model``;
  the state and the key replicated), outputs come back replicated, and the call runs under the mesh (so mesh-aware
  layers, e.g. the decoder's linear kernels, take their sharded path).
  Each call builds (and on first use compiles) a new step: hold on to it rather than calling this per step.
  """
  return _make_train_step(loss_fn, optimizer, mesh, donate)


def _make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh | None, donate: bool):
  donated = (0,) if donate else ()
  step = jax.jit(lambda state, frozen, batch, key: train_step(state, frozen, batch, key, loss_fn=loss_fn,
                                                              optimizer=optimizer), donate_argnums=donated)
  if mesh is None:
    return step
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P(DATA_AXIS))
  data_size = mesh.shape[DATA_AXIS]
  # no in_shardings: every input is placed below (committed), and the program takes the placement it is given
  sharded = jax.jit(lambda state, frozen, batch, key: train_step(state, frozen, batch, key, loss_fn=loss_fn,
                                                                 optimizer=optimizer),
                    out_shardings=replicated, donate_argnums=donated)

  def call(state, frozen, batch, key):
    for leaf in jax.tree.leaves(batch):
      if np.ndim(leaf) == 0 or np.shape(leaf)[0] % data_size:
        raise ValueError(f"every batch leaf needs a leading batch dimension divisible by the data axis size "
                         f"{data_size}; got shape {np.shape(leaf)}")
    # parallel.put_global: jax.device_put on one host; across hosts each places what its devices hold (every host
    # passes the same state and the same global batch)
    state, key = jax.tree.map(lambda x: parallel.put_global(x, replicated), (state, key))
    frozen = parallel.shard_params(frozen, mesh)
    batch = jax.tree.map(lambda x: parallel.put_global(x, rows), batch)
    with _mesh_context(mesh):
      return sharded(state, frozen, batch, key)

  call.jitted = sharded
  return call


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loop:
  """How :func:`fit` runs: the steps, the checkpoints, the evaluations, the output and the devices (the settings every
  training job passes through unchanged; its own loss, data and optimizer are :func:`fit`'s other arguments)."""
  num_steps: int
  """Steps of the run (a resume continues to this many)."""
  checkpoint_every: int = 100
  """Save every this many steps (and always after the last step)."""
  max_to_keep: int = 3
  """The newest checkpoints kept."""
  eval_every: int = 0
  """``eval_fn`` after every this many steps and the last one (0: never)."""
  progress: bool = True
  """A tqdm bar over the steps (after the compiling step's line)."""
  plot: bool = True
  """``loss.png`` beside ``metrics.jsonl`` at the end (process 0; needs matplotlib)."""
  stop_after: int | None = None
  """Stop (with a checkpoint) once this many steps are done, as if killed: for resume tests."""
  mesh: Mesh | None = None
  """A ``(data, model)`` mesh (:func:`make_train_step`): every batch leaf split over ``data``, the frozen decoder
  parameters over ``model``; None: one device."""

  def __post_init__(self):
    check_int(self.num_steps, "num_steps")
    if self.checkpoint_every < 1 or self.max_to_keep < 1:
      raise ValueError(f"checkpoint_every and max_to_keep must be >= 1, got {self.checkpoint_every}, "
                       f"{self.max_to_keep}")
    check_int(self.eval_every, "eval_every", 0)
    if self.stop_after is not None:
      check_int(self.stop_after, "stop_after")


@dataclasses.dataclass(frozen=True)
class FitResult:
  state: TrainState
  history: list          # the metrics dicts of this call's steps (metrics.jsonl holds all of them)
  resumed_from: int | None  # the checkpoint step this call restored, None for a fresh start
  seconds: float


def _to_python(metrics: dict) -> dict:
  return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}


def read_metrics(path) -> list[dict]:
  """The JSON lines of a ``metrics.jsonl`` (a truncated last line, from a killed writer, is skipped)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def eval_curves(rows: list[dict], points: Mapping[str, Sequence[tuple[int, float]]] | None = None
                ) -> dict[str, list[tuple[int, float]]]:
  """``{name: [(step, value), …] by step}`` for every ``eval_*`` metric of ``rows`` and of ``points`` (more points
  measured outside the loop); where both have a step, the rows' value is kept."""
  points = points or {}
  curves = {}
  for name in sorted({k for r in rows for k in r if k.startswith("eval_")} | set(points)):
    by_step = {int(step): float(value) for step, value in points.get(name, ())}
    by_step.update((int(r["step"]), float(r[name])) for r in rows if name in r)
    curves[name] = sorted(by_step.items())
  return curves


def plot_losses(rows: list[dict], path, points: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> bool:
  """The loss (and any ``eval_*`` metric) against the step as a PNG; False (nothing written) without matplotlib.

  ``points``: more ``(step, value)`` points of ``eval_*`` curves, measured outside the training loop (a job's
  held-out metric before the first step and after the last); a step the rows already have keeps the rows' value."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  steps = [r["step"] for r in rows if "loss" in r]
  fig, ax = plt.subplots(figsize=(6, 4))
  losses = [r["loss"] for r in rows if "loss" in r]
  ax.plot(steps, losses, label="train loss", alpha=0.5 if len(losses) > 16 else 1.0)
  if len(losses) > 16:  # small batches give a jagged curve: its running mean over 8 steps beside it
    window = 8
    means = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], means, label=f"train loss, mean of {window} steps")
  for name, pts in eval_curves(rows, points).items():
    ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log" if all(r["loss"] > 0 for r in rows if "loss" in r) and steps else "linear")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def restore_latest(directory, template: TrainState) -> TrainState | None:
  """The newest intact checkpoint in ``directory`` restored into ``template``'s structure, or None when there is none.

  Intact: see :mod:`blockspec_jax.train.checkpoints` (a damaged newer step is passed over with a line on stderr;
  none intact is a :class:`~blockspec_jax.train.checkpoints.DamagedCheckpointError`)."""
  found = checkpoints_lib.restore(directory, template)
  return None if found is None else found.value


def _resume(workdir: pathlib.Path, state: TrainState) -> tuple[TrainState, int | None, float]:
  """``(state, resumed_from, seconds_before)``: the newest intact checkpoint of ``workdir`` (damaged newer ones are
  passed over, a line each, and deleted by :func:`fit`) with ``metrics.jsonl`` cut back to its step and the training
  seconds of the earlier calls (a resumed run's total goes on from there); else ``state``, None and 0 with no stale
  ``metrics.jsonl`` (a fresh run). Only process 0 of a multi-host run reads or rewrites ``metrics.jsonl`` (the others
  get 0 seconds: they write no metrics)."""
  metrics_path = workdir / "metrics.jsonl"
  restored = checkpoints_lib.restore(workdir / "checkpoints", state, discarding=True)
  main = runtime.is_main_process()  # only process 0 of a multi-host run keeps metrics.jsonl
  if restored is None:
    if main and metrics_path.exists():
      metrics_path.unlink()  # a fresh run: no stale curve from an earlier run without checkpoints
    return state, None, 0.0
  if not main:
    return restored.value, restored.step, 0.0
  kept = [r for r in read_metrics(metrics_path) if r.get("step", 0) <= restored.step]
  metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
  seconds_before = float(kept[-1].get("seconds_total", kept[-1].get("seconds", 0.0))) if kept else 0.0
  return restored.value, restored.step, seconds_before


def fit(*, loss_fn: LossFn, optimizer: optax.GradientTransformation, trainable, frozen,
        batch_fn: Callable[[int, Any], Any], key: jax.Array, workdir, loop: Loop,
        eval_fn: Callable[[int, Any], dict] | None = None, label: str = "train step") -> FitResult:
  """Train ``trainable`` for ``loop.num_steps`` steps, resuming from ``<workdir>/checkpoints`` when it holds one.

  Args:
    loss_fn: ``(trainable, frozen, batch, key) -> (loss, aux)``.
    trainable: the initial trainable pytree (ignored when a checkpoint is restored, but it gives the structure).
    frozen: the pytree of non-trained inputs of the loss.
    batch_fn: ``(step, trainable) -> batch``, a pure function of its arguments (exact resume depends on it).
    key: the run's key; step ``s`` gets ``fold_in(key, s)``.
    loop: the steps, checkpoints, evaluations, output and mesh (:class:`Loop`).
    eval_fn: ``eval_fn(step, trainable) -> {name: float}`` after every ``loop.eval_every``-th step and the last one,
      logged as ``eval_<name>`` in that step's metrics line.
    label: the compiling line's name for the step.
  """
  num_steps, checkpoint_every, max_to_keep = loop.num_steps, loop.checkpoint_every, loop.max_to_keep
  eval_every, progress, plot, stop_after, mesh = loop.eval_every, loop.progress, loop.plot, loop.stop_after, loop.mesh
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  metrics_path = workdir / "metrics.jsonl"
  state, resumed_from, seconds_before = _resume(workdir, init_state(trainable, optimizer))
  if resumed_from is None:  # the steps donate their state: a fresh one is copied, so the caller's arrays survive
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
  # Multi-host sharing one work directory: every process has read the checkpoints before any creates or prunes them.
  runtime.sync_processes("blockspec_jax.fit: checkpoints read")
  start = int(state.step)
  end = num_steps if stop_after is None else min(num_steps, stop_after)
  step_fn = make_train_step(loss_fn, optimizer, mesh, donate=True)
  if mesh is not None:
    frozen = parallel.shard_params(frozen, mesh)  # placed once (each step's placement is then a no-op)
  manager = checkpoints_lib.make_manager(workdir / "checkpoints", max_to_keep, checkpoint_every)
  if resumed_from is not None:
    checkpoints_lib.delete_after(manager, resumed_from)  # the damaged steps past it: saved again below
  history: list[dict] = []
  t0 = time.perf_counter()
  bar = None
  try:
    # metrics.jsonl (and the loss plot) from process 0 only: every process of a multi-host run computes the same rows
    with (open(metrics_path, "a") if runtime.is_main_process() else contextlib.nullcontext()) as log:
      for step in range(start, end):
        batch = batch_fn(step, state.trainable)
        step_key = jax.random.fold_in(key, step)
        compiled_before = runtime.backend_compiles()
        with runtime.compiling(label, when=step == start):
          state, metrics = step_fn(state, frozen, batch, step_key)
          if step == start:
            jax.block_until_ready(state)
        row = {"step": step + 1, **_to_python(metrics),
               "programs_compiled": runtime.backend_compiles() - compiled_before}
        if not math.isfinite(row["loss"]):
          raise FloatingPointError(f"loss is {row['loss']} at step {step + 1}")
        done = step + 1
        if eval_fn is not None and eval_every and (done % eval_every == 0 or done == num_steps):
          row.update({f"eval_{k}": float(v) for k, v in eval_fn(done, state.trainable).items()})
        row["seconds"] = time.perf_counter() - t0
        row["seconds_total"] = seconds_before + row["seconds"]
        row["peak_rss_gb"] = runtime.peak_rss_gb()
        if log is not None:
          log.write(json.dumps(row) + "\n")
          log.flush()
        history.append(row)
        checkpoints_lib.save(manager, done, state, force=(done == end))
        if progress and bar is None:  # opened after the compiling step, so the two do not share a line
          from tqdm import tqdm
          bar = tqdm(total=num_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
        if bar is not None:
          bar.update(1)
          bar.set_postfix(loss=f"{row['loss']:.4g}")
    if start == end and manager.latest_step() != end:
      checkpoints_lib.save(manager, end, state, force=True)
    manager.wait_until_finished()
  finally:
    manager.close()
    if bar is not None:
      bar.close()
  if plot and runtime.is_main_process():
    plot_losses(read_metrics(metrics_path), workdir / "loss.png")
  return FitResult(state=state, history=history, resumed_from=resumed_from, seconds=time.perf_counter() - t0)


def batch_indices(num: int, batch_size: int, seed: int, step: int) -> np.ndarray:
  """int64 [batch_size]: the example indices of step ``step``'s minibatch. Epoch ``e`` visits the examples in the
  order of ``numpy.random.default_rng([seed, e]).permutation(num)``; a batch may straddle two epochs."""
  flat = step * batch_size + np.arange(batch_size, dtype=np.int64)
  epochs, offsets = flat // num, flat % num
  out = np.empty_like(flat)
  for e in np.unique(epochs):
    perm = np.random.default_rng([seed, int(e)]).permutation(num)
    out[epochs == e] = perm[offsets[epochs == e]]
  return out


def fit_examples(examples: dict, *, batch_size: int, seed: int, loop: Loop, learning_rate: float,
                 optimizer: optax.GradientTransformation | None = None, **fit_kwargs) -> FitResult:
  """:func:`fit` on examples held in memory (numpy arrays of one leading size ``N``, keyed by their names in the
  batch): step ``s``'s batch is ``{name: jnp.asarray(array[batch_indices(N, batch_size, seed, s)])}``, the run's
  key ``jax.random.key(seed)``; ``optimizer`` defaults to ``make_optimizer("adamw", learning_rate, "cosine",
  total_steps=loop.num_steps)``. ``fit_kwargs``: :func:`fit`'s other arguments (``loss_fn``, ``trainable``,
  ``frozen``, ``workdir``, ``eval_fn``, ``label``)."""
  sizes = {int(np.shape(array)[0]) for array in examples.values()}
  if len(sizes) != 1:
    raise ValueError(f"the examples must share their leading size, got {sorted(sizes)}")
  num = sizes.pop()
  if optimizer is None:
    optimizer = make_optimizer("adamw", learning_rate, "cosine", total_steps=loop.num_steps)

  def batch_fn(step, trainable):
    del trainable
    idx = batch_indices(num, batch_size, seed, step)
    return {name: jnp.asarray(array[idx]) for name, array in examples.items()}

  return fit(optimizer=optimizer, batch_fn=batch_fn, key=jax.random.key(seed), loop=loop, **fit_kwargs)
