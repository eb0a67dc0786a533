"""The training stack: token-level divergences, trainable/frozen splits and LoRA, a generic trainer (one device or a
data-parallel mesh, exact resume), and its first client, DistillSpec (:mod:`blockspec_jax.train.distill`).

Library modules never import gin; the job entry point is ``python -m blockspec_jax.train --gin_file
gin/train/<job>.gin`` (:mod:`blockspec_jax.train.__main__`).
"""

from blockspec_jax.train.divergences import DIVERGENCES, mean_total_variation, token_divergence
from blockspec_jax.train.params import apply_lora, init_lora, layers_trainable, merge, partition
from blockspec_jax.train.trainer import TrainState, fit, init_state, make_optimizer, make_train_step

__all__ = ["DIVERGENCES", "token_divergence", "mean_total_variation", "partition", "merge", "layers_trainable",
           "init_lora", "apply_lora", "TrainState", "make_optimizer", "init_state", "make_train_step", "fit"]
