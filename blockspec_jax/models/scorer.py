"""The target scorer for our Flax decoders: :class:`blockspec_jax.contracts.TargetScorer` over a
:class:`~blockspec_jax.models.decoder.DecoderConfig`.

The speculative loop talks to the target only through this protocol, so another Flax causal LM plugs in by
implementing ``init_cache`` / ``score`` / ``move_slots`` (see the contract's docstring for the shapes).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from blockspec_jax.contracts import Scored
from blockspec_jax.models import decoder as decoder_lib

__all__ = ["ConfigBacked", "DecoderScorer", "as_scorer"]


class ConfigBacked:
  """``vocab_size`` and ``max_len`` declared by a ``config: DecoderConfig`` field (scorers and model drafters)."""

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_len(self) -> int:
    return self.config.max_len


@dataclasses.dataclass(frozen=True)
class DecoderScorer(ConfigBacked):
  """:class:`~blockspec_jax.models.decoder.Decoder` as the loop's target. ``tap_layers``: layers whose residual
  stream every pass also returns (``Scored.taps_BxTxLxD``), for drafters that read the target at several depths."""

  config: decoder_lib.DecoderConfig
  tap_layers: tuple[int, ...] = ()

  @property
  def module(self) -> decoder_lib.Decoder:
    return decoder_lib.Decoder(self.config)

  def init_cache(self, batch: int, cache_len: int) -> decoder_lib.KVCache:
    return decoder_lib.init_cache(self.config, batch, cache_len, self.config.dtype)

  def score(self, params, tokens_BxT, positions_BxT, slots_BxT, mask_BxTxS, cache) -> Scored:
    out = self.module.apply({"params": params}, tokens_BxT, positions_BxT, cache, mask_BxTxS, return_hidden=True,
                            slots_BxT=slots_BxT, tap_layers=self.tap_layers)
    taps_BxTxLxD = out[3] if self.tap_layers else None
    return Scored(out[0].astype(jnp.float32), out[2], out[1], taps_BxTxLxD)

  def with_taps(self, tap_layers: tuple[int, ...]) -> "DecoderScorer":
    """This scorer also returning the residual stream after ``tap_layers`` (the union with its own taps is not
    taken: a drafter asks for its layers in its order)."""
    return dataclasses.replace(self, tap_layers=tuple(tap_layers))

  def move_slots(self, cache: decoder_lib.KVCache, src_BxM, dst_BxM, valid_BxM) -> decoder_lib.KVCache:
    return cache.move_slots(src_BxM, dst_BxM, valid_BxM)


def as_scorer(target, tap_layers: tuple[int, ...] = ()) -> "DecoderScorer":
  """``target`` if it is already a scorer; a :class:`DecoderScorer` for a ``DecoderConfig``; else a TypeError.

  ``tap_layers`` (what a drafter that reads the target at several depths declares as ``target_layers``): the scorer
  returns those layers' residual streams; a scorer that cannot is a TypeError naming the layers.
  """
  if isinstance(target, decoder_lib.DecoderConfig):
    return DecoderScorer(target, tuple(tap_layers))
  tap_layers = tuple(tap_layers)
  if tap_layers and tuple(getattr(target, "tap_layers", ())) != tap_layers:
    if not hasattr(target, "with_taps"):
      raise TypeError(f"the drafter reads the target's layers {tap_layers}, but {type(target).__name__} has no "
                      "with_taps(layers) to return them")
    target = target.with_taps(tap_layers)
  missing = [name for name in ("vocab_size", "max_len", "init_cache", "score", "move_slots")
             if not hasattr(target, name)]
  if missing:
    raise TypeError(f"target must be a DecoderConfig or a TargetScorer (blockspec_jax.contracts); "
                    f"{type(target).__name__} lacks {', '.join(missing)}")
  return target
