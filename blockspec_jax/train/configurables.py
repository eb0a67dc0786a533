"""The gin configurables the training jobs' gin files use besides the jobs themselves: ``tiny_decoder`` (random
tiny models: ``distill_job.target_config = @target/tiny_decoder()``), ``drafter_recipe`` (``distill_job.drafter =
@drafter_recipe()``) and ``make_optimizer`` (``make_optimizer.learning_rate = 3e-4``; ``distill_job`` and
``sprinter_job`` call it with ``total_steps`` = their ``num_steps``). An entry-point module: it imports gin, the
library modules it wraps do not.
"""

from __future__ import annotations

import gin

from blockspec_jax import checks
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import params as params_lib, recipe as recipe_lib, trainer

__all__ = ["tiny_decoder", "drafter_recipe", "make_optimizer"]

make_optimizer = gin.external_configurable(trainer.make_optimizer, "make_optimizer")


@gin.configurable
def tiny_decoder(vocab_size: int = 64, d_model: int = 32, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 8, ffn_dim: int = 64, max_len: int = 512,
                 matmul: str = "auto") -> decoder_lib.DecoderConfig:
  """A small random decoder's config (``DecoderConfig.tiny`` with these fields)."""
  return decoder_lib.DecoderConfig.tiny(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        ffn_dim=ffn_dim, max_len=max_len, matmul=matmul)


@gin.configurable("drafter_recipe")
def drafter_recipe(base: str = gin.REQUIRED, layers=None, lora_rank: int = 0,
                   lora_targets=params_lib.LORA_TARGETS, lora_alpha: float | None = None, train_layers=None,
                   train_modules=(), seed: int = 0) -> recipe_lib.DrafterRecipe:
  """A :class:`blockspec_jax.train.recipe.DrafterRecipe` from gin (``distill_job.drafter = @drafter_recipe()``)."""
  try:
    return recipe_lib.DrafterRecipe(base=base, layers=layers, lora_rank=lora_rank, lora_targets=lora_targets,
                                    lora_alpha=lora_alpha, train_layers=train_layers, train_modules=train_modules,
                                    seed=seed)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None
