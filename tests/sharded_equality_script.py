"""Run on 8 CPU devices (the test sets XLA_FLAGS before JAX starts): sharded decoding = one device, token for token.

Prints one line per case and "ALL EQUAL" at the end; exits 1 on a mismatch. ``--extended`` adds the evaluation and
label-collection cases (eval.paired's chain table and a trees arm, the training jobs' label collections; the slow
tier), each of which reuses the sharded loops and row padding the default cases check.
"""

import sys

import chex
import jax
import numpy as np

from blockspec_jax import parallel, sampling
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter, make
from blockspec_jax.models import decoder as dec


def main(extended: bool = False):
  assert len(jax.devices()) == 8, jax.devices()
  # 4 heads / 2 KV heads, ffn 64, V 64: every split dimension is divisible by model = 2.
  config = dec.DecoderConfig.tiny(vocab_size=64, qkv_bias=True)
  small = dec.DecoderConfig.tiny(vocab_size=64, num_layers=1)
  target, drafter = dec.init_params(config, 0), dec.init_params(small, 1)
  prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11], [12, 13, 14, 15], [16, 17], [18], [19, 20, 21]]
  tokens, lens = spec.prepare_prompts(prompts)
  keys = jax.random.split(jax.random.key(0), 8)
  ok = True
  # Every mesh shape once (data only, data × model, model-heavy), T = 0 and T = 1 both covered; then a tree drafter
  # (RSD-C, traversal: tree mask, node slots and path commit under sharding).
  cases = ((sampling.Sampler(0.0), ModelDrafter(small), "block", ((8, 1), (2, 4))),
           (sampling.Sampler(1.0), ModelDrafter(small), "block", ((4, 2),)),
           (sampling.Sampler(1.0), make("rsd_c", config=small, branching=(2, 1, 1)), "traversal", ((4, 2),)))
  for sampler, drafter_obj, rule, meshes in cases:
    static = dict(target=config, drafter=drafter_obj, gamma=3, max_new_tokens=12, verifier=rule, sampler=sampler)
    reference = spec.generate_speculative(target, drafter, keys, tokens, lens, **static)
    ar_ref = spec.generate_autoregressive(target, keys, tokens, lens, target=config, max_new_tokens=12,
                                          sampler=sampler)
    for data, model in meshes:
      mesh = parallel.make_mesh(data, model)
      t_sh, d_sh = parallel.shard_params(target, mesh), parallel.shard_params(drafter, mesh)
      k_sh, tok_sh, len_sh = parallel.shard_batch(mesh, keys, tokens, lens)
      out = parallel.sharded_speculative(mesh, t_sh, d_sh, k_sh, tok_sh, len_sh, **static)
      ar = parallel.sharded_autoregressive(mesh, t_sh, k_sh, tok_sh, len_sh, target=config, max_new_tokens=12,
                                           sampler=sampler)
      same = (np.array_equal(np.asarray(out.tokens_BxN), np.asarray(reference.tokens_BxN))
              and np.array_equal(np.asarray(ar.tokens_BxN), np.asarray(ar_ref.tokens_BxN)))
      spec_layout = out.tokens_BxN.sharding.spec
      print(f"{rule} T={sampler.temperature} mesh data={data} model={model}: equal={same} output sharding "
            f"{spec_layout}, "
            f"q weight {t_sh['layers_0']['attn']['q']['weight'].sharding.spec}")
      ok &= same
  # Any number of rows (5 on a data axis of 4: padded to 8, the padding cut): parallel.autoregressive_rows gives
  # one device's 5 rows, read back as numpy.
  rows_ref = spec.generate_autoregressive(target, keys[:5], tokens[:5], lens[:5], target=config, max_new_tokens=12,
                                          sampler=sampling.Sampler(1.0))
  rows = parallel.autoregressive_rows(parallel.make_mesh(4, 2), target, keys[:5], tokens[:5], lens[:5],
                                      target=config, max_new_tokens=12, sampler=sampling.Sampler(1.0))
  same = (isinstance(rows.tokens_BxN, np.ndarray) and rows.tokens_BxN.shape[0] == 5
          and np.array_equal(rows.tokens_BxN, np.asarray(rows_ref.tokens_BxN))
          and np.array_equal(rows.metrics.num_drafts, np.asarray(rows_ref.metrics.num_drafts)))
  print(f"autoregressive_rows, 5 rows on data=4 model=2: equal={same}")
  ok &= same
  if extended:
    # eval.paired's table on a mesh: 5 contexts in 2 length buckets (3 and 2 contexts, each padded to the data axis of
    # 4, the padding cut) give one device's table up to float rounding (the models' sums split over model = 2).
    from blockspec_jax.eval import paired
    table_args = dict(target=config, drafter=ModelDrafter(small), gamma=3, temperature=1.0, draws=2, buckets=2)
    table_ref = paired.paired_acceptance(target, drafter, prompts[:5], **table_args)
    table = paired.paired_acceptance(target, drafter, prompts[:5], mesh=parallel.make_mesh(4, 2), **table_args)
    same = table.shape == table_ref.shape == (2, 5, 2, 3) and np.allclose(table, table_ref, rtol=1e-5, atol=1e-6)
    print(f"paired_acceptance, 5 contexts in 2 buckets on data=4 model=2: equal={same} "
          f"(max diff {float(np.max(np.abs(table - table_ref))):.2g})")
    ok &= same
    # eval.paired --trees: one arm (RSD-C under rrs_wor and traversal) on 5 contexts padded to the data axis of 4.
    from blockspec_jax.eval import paired_trees
    arm = paired_trees.Arm("rsd_c", "rsd_c", (("branching", (2, 1, 1)),), 3, ("rrs_wor", "traversal"))
    arm_args = dict(target=config, drafter=make("rsd_c", config=small, branching=(2, 1, 1)), draws=2,
                    temperature=1.0, seed=0, verify_draws=2)
    table_ref = paired_trees.run_arm(target, drafter, prompts[:5], arm, **arm_args)
    table = paired_trees.run_arm(target, drafter, prompts[:5], arm, mesh=parallel.make_mesh(4, 2), **arm_args)
    same = table.shape == table_ref.shape == (2, 5, 2) and np.allclose(table, table_ref, rtol=1e-5, atol=1e-6)
    print(f"paired_trees.run_arm, 5 contexts on data=4 model=2: equal={same} "
          f"(max diff {float(np.max(np.abs(table - table_ref))):.2g})")
    ok &= same
    # The training jobs' label collection on a mesh (SPRINTER's labels, the BPD heads' hidden states): 5 prompts in
    # batches of 3 (the last wraps around), each padded to the data axis of 4: the same continuations, labels and
    # tokens as one device, features up to float rounding.
    from blockspec_jax.train import heads as heads_train, sprinter as sprinter_train
    collect_args = dict(max_new_tokens=4, temperature=1.0, key=jax.random.key(3), batch_size=3, progress=False)
    labels_ref = sprinter_train.collect_labels(config, target, small, drafter, tokens[:5], lens[:5], **collect_args)
    labels = sprinter_train.collect_labels(config, target, small, drafter, tokens[:5], lens[:5],
                                           mesh=parallel.make_mesh(4, 2), **collect_args)
    hidden_ref = heads_train.collect_hidden(config, target, tokens[:5], lens[:5], **collect_args)
    hidden = heads_train.collect_hidden(config, target, tokens[:5], lens[:5], mesh=parallel.make_mesh(4, 2),
                                        **collect_args)
    same = all(np.array_equal(labels[k], labels_ref[k]) for k in ("labels_N", "token_N", "row_N", "position_N")) \
        and all(np.allclose(labels[k], labels_ref[k], rtol=1e-5, atol=1e-6)
                for k in ("features_NxD", "q_tok_N", "p_tok_N")) \
        and all(np.array_equal(hidden[k], hidden_ref[k]) for k in hidden if k != "features_MxD") \
        and np.allclose(hidden["features_MxD"], hidden_ref["features_MxD"], rtol=1e-5, atol=1e-5)
    print(f"collect_labels and collect_hidden, 5 prompts in batches of 3 on data=4 model=2: equal={same} "
          f"({len(labels['labels_N'])} labels, {len(hidden['seq_M'])} hidden states)")
    ok &= same
  # A training job's steps on a data x model mesh (trainer.fit with Loop.mesh, as a job with <job>.mesh = (4, 2)
  # runs them): the frozen target split over model, the batch over data, the drafter's update equal to one device's
  # within float32 reduction order, and different from where it started.
  from blockspec_jax.train import distill, trainer
  import tempfile
  loss_fn = distill.DistillLoss(config, small, "fkl", 1.0)
  opt = trainer.make_optimizer("adamw", 1e-3, "cosine", 1, 3, 0.01, 1.0)
  rng = np.random.default_rng(0)
  batches = [{"tokens_BxT": jax.numpy.asarray(rng.integers(0, 64, (8, 12)), jax.numpy.int32),
              "mask_BxT": jax.numpy.asarray(rng.random((8, 12)) < 0.7, jax.numpy.float32)} for _ in range(3)]
  fitted = []
  for mesh in (None, parallel.make_mesh(4, 2)):
    with tempfile.TemporaryDirectory() as workdir:
      fitted.append(trainer.fit(loss_fn=loss_fn, optimizer=opt, trainable=drafter,
                                frozen={"target": target, "drafter": {}},
                                batch_fn=lambda s, t: batches[s], key=jax.random.key(0), workdir=workdir,
                                loop=trainer.Loop(num_steps=3, mesh=mesh, checkpoint_every=2, progress=False,
                                                  plot=False)).state)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
             for a, b in zip(jax.tree.leaves(jax.device_get(fitted[0])), jax.tree.leaves(jax.device_get(fitted[1]))))
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(jax.device_get(fitted[0].trainable)), jax.tree.leaves(drafter)))
  placed = parallel.shard_params({"target": target}, parallel.make_mesh(4, 2))["target"]
  split = (placed["layers_0"]["attn"]["q"]["weight"].sharding.spec, placed["embed"]["embedding"].sharding.spec)
  same = diff <= 1e-6 and moved > 1e-4 and split == (jax.sharding.PartitionSpec("model", None),) * 2
  print(f"trainer.fit, 3 distillation steps on data=4 model=2: equal={same} (max diff {diff:.1e}, moved "
        f"{moved:.1e}; frozen target q weight {split[0]}, embedding {split[1]})")
  ok &= same
  # The stacked layout (layers compiled once, what the decoding jobs load) under a data x model mesh: the same
  # tokens as the unrolled model on one device (stacked leaves split as their one-layer counterparts, never over L).
  import dataclasses
  s_config, s_small = (dataclasses.replace(c, scan_layers=True) for c in (config, small))
  s_target, s_drafter = dec.stack_layers(target, config.num_layers), dec.stack_layers(drafter, small.num_layers)
  static = dict(target=config, drafter=ModelDrafter(small), gamma=3, max_new_tokens=12, verifier="block",
                sampler=sampling.Sampler(1.0))
  reference = spec.generate_speculative(target, drafter, keys, tokens, lens, **static)
  # From here on the sharded loop's program may be traced twice, when the stacked layout first compiles below
  # (jax.eval_shape for its output shardings, then jit); the "compiled once" check then runs a second batch, and a
  # recompilation, which traces it again, raises (chex).
  spec.speculative_program = chex.assert_max_traces(spec.speculative_program, n=2)
  static = dict(static, target=s_config, drafter=ModelDrafter(s_small))
  mesh = parallel.make_mesh(4, 2)
  t_sh, d_sh = parallel.shard_params(s_target, mesh), parallel.shard_params(s_drafter, mesh)
  k_sh, tok_sh, len_sh = parallel.shard_batch(mesh, keys, tokens, lens)
  out = parallel.sharded_speculative(mesh, t_sh, d_sh, k_sh, tok_sh, len_sh, **static)
  same = np.array_equal(np.asarray(out.tokens_BxN), np.asarray(reference.tokens_BxN))
  print(f"stacked layers, block T=1.0 mesh data=4 model=2: equal={same} q weight "
        f"{t_sh['layers']['attn']['q']['weight'].sharding.spec}")
  ok &= same
  # Compiled once: another batch of the same shapes (new keys, new prompts, a new mesh object) reuses the cached
  # program: no new program, and no second trace of the loop (chex.assert_max_traces raises on one).
  programs = len(parallel._COMPILED)
  mesh = parallel.make_mesh(4, 2)
  tokens2, lens2 = spec.prepare_prompts([[p % 60 + 2 for p in row] for row in prompts[::-1]])
  k_sh, tok_sh, len_sh = parallel.shard_batch(mesh, jax.random.split(jax.random.key(5), 8), tokens2, lens2)
  try:
    parallel.sharded_speculative(mesh, t_sh, d_sh, k_sh, tok_sh, len_sh, **static)
    traced_again = ""
  except AssertionError as e:
    traced_again = f": {e}".splitlines()[0]
  once = len(parallel._COMPILED) == programs and not traced_again
  print(f"compiled once: {once} ({len(parallel._COMPILED)} programs{traced_again})")
  ok &= once
  print("ALL EQUAL" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(extended="--extended" in sys.argv[1:]))
