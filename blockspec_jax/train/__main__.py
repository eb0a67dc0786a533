"""Training jobs: ``python -m blockspec_jax.train --gin_file gin/train/<job>.gin [--gin_param B] [--workdir DIR]``.

The one job so far is DistillSpec (``distill_job``): a frozen target, a drafter distilled toward it with a token-level
divergence (:mod:`blockspec_jax.train.distill`) by the generic trainer (:mod:`blockspec_jax.train.trainer`). Gin is
used here only (library modules never import it): ``distill_job.*`` binds the job, ``make_optimizer.*`` the
optimizer (``total_steps`` defaults to the job's ``num_steps``), and ``<scope>/tiny_decoder.*`` random tiny models
(``distill_job.target_config = @target/tiny_decoder()``).

Outputs in the workdir (default ``results/train/<gin file stem>``): ``config.gin`` (the operative config),
``metrics.jsonl`` (a line per step), ``checkpoints/`` (resumed from when present: re-running the command continues
a stopped run), ``loss.png`` (with matplotlib) and, at the end, ``metrics.json``: ``heldout_tv_before``,
``heldout_tv_after`` (mean total variation drafter vs target on the held-out prompts' generated positions),
``final_loss``, ``steps``, ``seconds`` and the settings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import gin
import jax

from blockspec_jax import jobs, parallel
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, params as params_lib, trainer

make_optimizer = gin.external_configurable(trainer.make_optimizer, "make_optimizer")


@gin.configurable
def tiny_decoder(vocab_size: int = 64, d_model: int = 32, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 8, ffn_dim: int = 64, max_len: int = 512,
                 matmul: str = "auto") -> decoder_lib.DecoderConfig:
  """A small random decoder's config (``DecoderConfig.tiny`` with these fields)."""
  return decoder_lib.DecoderConfig.tiny(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        ffn_dim=ffn_dim, max_len=max_len, matmul=matmul)


def _check_int(value, name: str, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise jobs.UsageError(f"distill_job.{name} must be an integer >= {low}, got {value!r}")
  return value


@gin.configurable
def distill_job(workdir, *, target_config=gin.REQUIRED, drafter_config=gin.REQUIRED, target_seed: int = 0,
                drafter_seed: int = 1, num_prompts: int = 128, prompt_len: int = 8, max_new_tokens: int = 16,
                heldout_fraction: float = 0.125, batch_size: int = 16, source: str = "fixed",
                on_policy_fraction: float = 0.5, divergence: str = "fkl", temperature: float = 1.0,
                sample_temperature: float = 1.0, beta: float = 0.5, trainable_layers=None, num_steps: int = 100,
                checkpoint_every: int = 50, max_to_keep: int = 2, seed: int = 0, progress: bool = True,
                data_parallel: bool = False) -> dict:
  """DistillSpec on random tiny models and random prompts; returns the ``metrics.json`` summary.

  ``trainable_layers``: None trains the whole drafter; a list of layer indices trains those layers only (the rest,
  embeddings and head included, frozen). ``temperature`` is the divergence's, ``sample_temperature`` the decoding
  temperature (continuations and the held-out TV). ``data_parallel``: split every batch over all devices (a
  ``(data, 1)`` mesh; ``batch_size`` must be a multiple of the device count), same updates as one device.
  """
  t0 = time.perf_counter()
  for name, value, low in (("num_prompts", num_prompts, 2), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1),
                           ("num_steps", num_steps, 1), ("checkpoint_every", checkpoint_every, 1),
                           ("max_to_keep", max_to_keep, 1)):
    _check_int(value, name, low)
  try:
    loss_fn = distill.DistillLoss(target_config, drafter_config, divergence, temperature, beta)
    optimizer = make_optimizer(total_steps=num_steps)
  except ValueError as e:
    raise jobs.UsageError(str(e)) from None
  mesh = None
  if data_parallel:
    mesh = parallel.make_mesh(model=1)
    if batch_size % mesh.shape[parallel.DATA]:
      raise jobs.UsageError(f"distill_job.batch_size = {batch_size} must be a multiple of the "
                            f"{mesh.shape[parallel.DATA]} devices with data_parallel = True")
  target_params = decoder_lib.init_params(target_config, target_seed)
  drafter_params = decoder_lib.init_params(drafter_config, drafter_seed)
  if trainable_layers is None:
    trainable, frozen_drafter = drafter_params, {}
  else:
    trainable, frozen_drafter = params_lib.partition(drafter_params, params_lib.layers_trainable(trainable_layers))
  prompts_NxP, prompt_len_N = distill.random_prompts(num_prompts, prompt_len, target_config.vocab_size, seed)
  try:
    data = distill.make_distill_data(target_config, target_params, drafter_config, prompts_NxP, prompt_len_N,
                                     batch_size=batch_size, max_new_tokens=max_new_tokens,
                                     sample_temperature=sample_temperature, source=source,
                                     on_policy_fraction=on_policy_fraction, heldout_fraction=heldout_fraction,
                                     seed=seed)
  except ValueError as e:
    raise jobs.UsageError(str(e)) from None
  tv_before = distill.heldout_tv(drafter_params, target_params, data)
  result = trainer.fit(loss_fn=loss_fn, optimizer=optimizer, trainable=trainable,
                       frozen={"target": target_params, "drafter": frozen_drafter},
                       batch_fn=distill.make_batch_fn(data, frozen_drafter), num_steps=num_steps,
                       key=jax.random.key(seed), workdir=workdir, checkpoint_every=checkpoint_every,
                       max_to_keep=max_to_keep, progress=progress, label="distill train step", mesh=mesh)
  final_params = params_lib.merge(result.state.trainable, frozen_drafter)
  tv_after = distill.heldout_tv(final_params, target_params, data)
  rows = trainer.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
  summary = {
      "heldout_tv_before": tv_before, "heldout_tv_after": tv_after,
      "final_loss": rows[-1]["loss"] if rows else None, "final_train_tv": rows[-1]["tv"] if rows else None,
      "steps": int(result.state.step), "resumed_from": result.resumed_from,
      "seconds": time.perf_counter() - t0, "train_seconds": result.seconds,
      "num_train_prompts": int(len(data.train_idx)), "num_heldout_prompts": int(len(data.heldout_idx)),
      "divergence": divergence, "source": source, "temperature": temperature,
      "sample_temperature": sample_temperature, "trainable_params": params_lib.count_params(result.state.trainable),
      "device": jax.devices()[0].platform, "data_parallel_devices": mesh.size if mesh is not None else 1,
  }
  (pathlib.Path(workdir) / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def default_workdir(gin_files) -> pathlib.Path:
  """``results/train/<stem of the last gin file>`` (relative to the working directory)."""
  return pathlib.Path("results") / "train" / pathlib.Path(gin_files[-1]).stem


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_param", action="append", default=[])
  parser.add_argument("--workdir", help="output folder (default results/train/<gin file stem>)")
  args = parser.parse_args(argv)
  with jobs.cli_errors(parser.prog):
    if not args.gin_file:
      raise jobs.UsageError("give a job with --gin_file gin/train/<job>.gin")
    gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
    workdir = pathlib.Path(args.workdir) if args.workdir else default_workdir(args.gin_file)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.gin").write_text(gin.config_str())  # what was bound; the operative config replaces it
    summary = distill_job(workdir)
    (workdir / "config.gin").write_text(gin.operative_config_str())
  print(json.dumps(summary, indent=2))
  print(f"held-out TV {summary['heldout_tv_before']:.4f} -> {summary['heldout_tv_after']:.4f} after "
        f"{summary['steps']} steps ({summary['seconds']:.1f} s); outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
