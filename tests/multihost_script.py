"""One process of a multi-process run on this machine (tests/test_multihost.py starts every process, each on its own
fake CPU devices, joined through ``jax.distributed`` on 127.0.0.1 with gloo collectives).

    python tests/multihost_script.py <process id> <number of processes> <coordinator port> <mode>

``mode``: ``loops`` runs the sharded speculative (block, RSD-C with traversal; T = 1) and autoregressive loops on a
global (data, model) mesh over every process's devices, with the batch given in full to every process and
as each process's own rows, reads the outputs back on every process (``parallel.gather``) and compares them with the
same loops on this process's first device alone; prints ``EQUAL <case>`` per case and ``ALL EQUAL`` at the end.
``train``: three data-parallel train steps of a tiny DistillSpec pair on a data mesh over every process's devices
(every process passing the same global batches) reach the parameters of the same steps on one device (``TRAIN
EQUAL``). ``distill <work dir>``: the distillation smoke job (``gin/train/distill_smoke.gin``, 4 steps) on the
default mesh over every process's devices (the target's continuations drawn and every batch split over ``data``),
stopped after 2 steps (checkpoints through orbax's multi-process path) and run again to resume and finish; every
process writes the summary it returned to ``<work dir>/summary_<process id>.json``; then a batch that does not split
over the devices is refused before anything runs (``BATCH REFUSED``).
``jobs <out dir>``: the SmolLM2 main job at T = 1 and the smoke suite (two categories; ``tests/test_main_job_ids.py``) on the
global mesh (rows over a data axis of every process's devices), each process with its own suite directory
``<out dir>/suite_<process id>``; every process writes the numbers it read back to ``<out dir>/record_<process
id>.json``.
``hang``: joins, then process 1 exits at once while process 0 waits in a collective for it (the test expects process 0
to end with an error, not to hang).
"""

import sys


def main():
  process_id, count, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
  from blockspec_jax import parallel
  parallel.initialize_multihost(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=process_id,
                                initialization_timeout=60, heartbeat_timeout_seconds=10)
  import jax
  assert jax.process_count() == count and len(jax.devices()) == count * len(jax.local_devices()), jax.devices()
  print(f"process {jax.process_index()} of {jax.process_count()}: {len(jax.local_devices())} local devices, "
        f"{len(jax.devices())} in all", flush=True)
  if mode == "hang":
    from jax.experimental import multihost_utils
    if process_id == 1:
      import os
      os._exit(0)  # no goodbye: the others must notice on their own
    multihost_utils.sync_global_devices("waits for a process that is gone")
    print("the collective returned", flush=True)
    return 0
  if mode == "distill":
    return distill(process_id, sys.argv[5])
  if mode == "jobs":
    return jobs(process_id, sys.argv[5])
  return train() if mode == "train" else loops(process_id, count)


def jobs(process_id: int, out_dir: str) -> int:
  import json
  import pathlib
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import test_main_job_ids as ids
  out = pathlib.Path(out_dir)
  record = dict(ids.main_job_record(["run_job.temperatures = (1.0,)"]),
                **ids.smoke_suite_record(out / f"suite_{process_id}", [f"suite.tasks = {ids.SUITE_TASKS!r}"]))
  (out / f"record_{process_id}.json").write_text(json.dumps(record))
  print("JOBS DONE", flush=True)
  return 0


def _distill_pair():
  """``(loss_fn, optimizer, drafter params, frozen, four batches of 8 rows)``: a tiny DistillSpec pair, the same in
  every process (fixed seeds)."""
  import numpy as np

  from blockspec_jax.models import decoder as dec
  from blockspec_jax.train import distill, trainer
  target_cfg = dec.DecoderConfig.tiny(vocab_size=64, matmul="xla")
  drafter_cfg = dec.DecoderConfig.tiny(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                       ffn_dim=32, matmul="xla")
  target, drafter = dec.init_params(target_cfg, 0), dec.init_params(drafter_cfg, 1)
  loss_fn = distill.DistillLoss(target_cfg, drafter_cfg, "fkl", 1.0)
  opt = trainer.make_optimizer("adamw", 1e-3, "cosine", 1, 3, 0.01, 1.0)
  rng = np.random.default_rng(0)
  batches = [{"tokens_BxT": rng.integers(0, 64, (8, 12)).astype(np.int32),
              "mask_BxT": (rng.random((8, 12)) < 0.7).astype(np.float32)} for _ in range(4)]
  return loss_fn, opt, drafter, {"target": target, "drafter": {}}, batches


#: The distillation smoke job's settings for the multi-process test: 4 steps of 16 rows from 32 prompts.
DISTILL_BINDINGS = ("distill_job.num_steps = 4", "distill_job.checkpoint_every = 2", "distill_job.num_prompts = 32",
                    "distill_job.progress = False", "make_optimizer.warmup_steps = 1")


def distill(process_id: int, workdir: str) -> int:
  import json
  import pathlib

  import gin

  from blockspec_jax import checks, cli
  from blockspec_jax.train import distill_job
  gin_file = str(pathlib.Path(__file__).resolve().parents[1] / "gin" / "train" / "distill_smoke.gin")
  cli.parse_gin([gin_file], list(DISTILL_BINDINGS))
  try:
    stopped = distill_job.distill_job(workdir, stop_after=2)
    print(f"stopped: {stopped}", flush=True)
    summary = distill_job.distill_job(workdir)
    print(f"resumed from {summary['resumed_from']}, {summary['steps']} steps", flush=True)
    pathlib.Path(workdir, f"summary_{process_id}.json").write_text(json.dumps(summary))
    try:
      distill_job.distill_job(pathlib.Path(workdir, "refused"), batch_size=6)
    except checks.UsageError as e:
      print(f"BATCH REFUSED: {e}", flush=True)
  finally:
    gin.clear_config()
  print("DISTILL DONE", flush=True)
  return 0


def train():
  import jax
  import numpy as np

  from blockspec_jax import parallel
  from blockspec_jax.train import trainer
  loss_fn, opt, drafter, frozen, batches = _distill_pair()
  results = []
  for mesh in (None, parallel.make_mesh(data=len(jax.devices()), model=1)):
    step = trainer.make_train_step(loss_fn, opt, mesh)
    state = trainer.init_state(drafter, opt)
    for s in range(3):
      state, _ = step(state, frozen, batches[s], jax.random.key(s))
    results.append(parallel.gather(state.trainable))
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])))
  moved = max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in zip(jax.tree.leaves(results[0]),
                                                                         jax.tree.leaves(drafter)))
  print(f"max diff {diff:.3g}, moved {moved:.3g}", flush=True)
  ok = diff <= 1e-6 and moved > 1e-4
  print("TRAIN EQUAL" if ok else "TRAIN DIFFERENT", flush=True)
  return 0 if ok else 1


def loops(process_id, count):
  import jax
  import numpy as np

  from blockspec_jax import parallel, sampling
  from blockspec_jax.decoding import speculative as spec
  from blockspec_jax.drafters import ModelDrafter, make
  from blockspec_jax.models import decoder as dec

  config = dec.DecoderConfig.tiny(vocab_size=64, qkv_bias=True)
  small = dec.DecoderConfig.tiny(vocab_size=64, num_layers=1)
  target, drafter = dec.init_params(config, 0), dec.init_params(small, 1)  # the same seeds: the same parameters in every process
  prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11], [12, 13, 14, 15], [16, 17], [18], [19, 20, 21]]
  tokens, lens = spec.prepare_prompts(prompts)
  keys = jax.random.split(jax.random.key(0), len(prompts))
  devices = len(jax.devices())
  # A chain rule on a data x model mesh, a tree rule on a data-only one (T = 0 and more meshes: the 8-device test).
  cases = ((sampling.Sampler(1.0), ModelDrafter(small), "block", (devices // 2, 2)),
           (sampling.Sampler(1.0), make("rsd_c", config=small, branching=(2, 1, 1)), "traversal", (devices, 1)))
  ok = True
  rows = len(prompts) // count
  mine = slice(process_id * rows, (process_id + 1) * rows)
  for sampler, drafter_obj, rule, (data, model) in cases:
    static = dict(target=config, drafter=drafter_obj, gamma=3, max_new_tokens=12, verifier=rule, sampler=sampler)
    alone = spec.generate_speculative(target, drafter, keys, tokens, lens, **static)
    ar_alone = spec.generate_autoregressive(target, keys, tokens, lens, target=config, max_new_tokens=12,
                                            sampler=sampler)
    mesh = parallel.make_mesh(data, model)
    t_sh, d_sh = parallel.shard_params(target, mesh), parallel.shard_params(drafter, mesh)
    for local in (False, True):
      batch = (keys[mine], tokens[mine], lens[mine]) if local else (keys, tokens, lens)
      k_sh, tok_sh, len_sh = parallel.shard_batch(mesh, *batch, process_local=local)
      out = parallel.sharded_speculative(mesh, t_sh, d_sh, k_sh, tok_sh, len_sh, **static)
      ar = parallel.sharded_autoregressive(mesh, t_sh, k_sh, tok_sh, len_sh, target=config, max_new_tokens=12,
                                           sampler=sampler)
      got, got_ar = parallel.gather((out.tokens_BxN, out.metrics.num_accepted_tokens)), parallel.gather(ar.tokens_BxN)
      same = (np.array_equal(got[0], np.asarray(alone.tokens_BxN))
              and np.array_equal(got[1], np.asarray(alone.metrics.num_accepted_tokens))
              and np.array_equal(got_ar, np.asarray(ar_alone.tokens_BxN)))
      name = f"{rule} T={sampler.temperature} mesh {data}x{model} {'process-local rows' if local else 'full batch'}"
      print(f"{'EQUAL' if same else 'DIFFERENT'} {name}", flush=True)
      ok &= same
  print("ALL EQUAL" if ok else "MISMATCH", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
