"""The model chain drafter (the protocol itself is :class:`blockspec_jax.contracts.Drafter`).

A chain drafter proposes γ tokens per iteration together with the full rows ``q`` they were drawn from. Cache
convention shared with the target (see :mod:`blockspec_jax.contracts`): at the start of an iteration a row
has ``length`` committed tokens and its model caches hold valid keys/values for positions ``< length − 1`` at least;
the last committed token has not been fed yet. Rollback is therefore nothing but the row's ``length``: entries at or
beyond it are stale and are overwritten before anything attends to them.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from blockspec_jax import sampling
from blockspec_jax.contracts import SAMPLING_CHAIN, Commit, Drafter, chain_draft
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import Settings
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.models.scorer import ConfigBacked

__all__ = ["Drafter", "ModelDrafter", "feed"]


def feed(module, params, tokens_BxT, positions_BxT, cache, max_len: int, return_hidden: bool = False,
         mlp_delta_LxBxTxF=None):
  """One forward of ``tokens_BxT`` at ``positions_BxT`` against ``cache``: ``(logits_BxTxV f32, cache)``, and with
  ``return_hidden`` also the last hidden states ``hidden_BxTxD`` (the final-norm output, the LM head's input).
  ``mlp_delta_LxBxTxF``: biases added to every layer's MLP up-projection (SD²'s steering; see ``models.decoder``)."""
  out = module.apply({"params": params}, tokens_BxT, positions_BxT, cache,
                     decoder_lib.causal_mask(positions_BxT, max_len), return_hidden=return_hidden,
                     mlp_delta_LxBxTxF=mlp_delta_LxBxTxF)
  if return_hidden:
    logits, cache, hidden = out
    return logits.astype(jnp.float32), cache, hidden
  logits, cache = out
  return logits.astype(jnp.float32), cache


@register("model")
@dataclasses.dataclass(frozen=True)
class ModelDrafter(Settings, ConfigBacked):
  """A small decoder-only model drafting one chain of γ tokens (the standard pairing: same tokenizer, fewer layers).

  Lossless with every registered lossless rule: ``q`` rows are exactly the laws the tokens were drawn from. No
  settings; subclasses add theirs as fields and check them in ``checked`` (:class:`~.settings.Settings`), which
  ``__post_init__`` runs with ``config``.
  """

  config: decoder_lib.DecoderConfig
  job_fields = ("config",)  # the drafter's DecoderConfig: the job builds the drafter on its loaded model
  sibling_sampling = SAMPLING_CHAIN
  is_chain = True

  def __post_init__(self):
    self.check_fields(self.config)

  def prefill_key(self):
    """What the prefill (:meth:`init_state`) depends on, for sharing prefill states between rows
    (``eval.harness.PrefillCache``): the whole drafter here; subclasses whose settings the prefill never reads
    (SPRINTER's head) leave them out."""
    return self

  def num_nodes(self, gamma: int) -> int:
    return gamma

  @property
  def module(self):
    return decoder_lib.Decoder(self.config)

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    # Only the prompt width is fed (the cache is max_len long): positions past a row's length are masked until the
    # loop writes them, so feeding the cache's empty tail would only cost a longer prefill.
    batch, prompt_width = tokens_BxP.shape
    cache = decoder_lib.init_cache(self.config, batch, max_len, self.config.dtype)
    positions_BxP = jnp.broadcast_to(jnp.arange(prompt_width), (batch, prompt_width))
    _, cache = feed(self.module, params, tokens_BxP, positions_BxP, cache, max_len)
    return cache

  def forward(self, params, state, tokens_BxT, positions_BxT):
    """The one place the drafting loop runs the model: feed ``tokens_BxT`` at ``positions_BxT`` into the cache in
    ``state``; returns ``(state, logits_BxTxV f32, hidden_BxTxD)``. Subclasses whose parameters or state wrap the
    model's (SPRINTER's head, SD²'s steering biases) override this alone; ``begin``, ``step`` and ``propose``
    follow."""
    logits_BxTxV, cache, hidden_BxTxD = feed(self.module, params, tokens_BxT, positions_BxT, state, state.max_len,
                                             return_hidden=True)
    return cache, logits_BxTxV, hidden_BxTxD

  def begin(self, params, state, tokens_BxS, length_B, sampler):
    """Feed the last two committed tokens (positions ``length − 2``, ``length − 1``): when the previous block was
    fully accepted the drafter has not seen its last token; otherwise re-feeding position ``length − 2`` rewrites
    the same key/value (static shapes either way). Returns ``(state, q_BxV, hidden_BxD)``: the law of the token at
    position ``length`` (after ``sampler``) and the hidden state that produced it."""
    rows_B = jnp.arange(tokens_BxS.shape[0])
    positions_Bx2 = jnp.maximum(length_B[:, None] + jnp.array([[-2, -1]]), 0)
    tokens_Bx2 = tokens_BxS[rows_B[:, None], positions_Bx2]
    state, logits_Bx2xV, hidden_Bx2xD = self.forward(params, state, tokens_Bx2, positions_Bx2)
    return state, sampler.probs(logits_Bx2xV[:, -1]), hidden_Bx2xD[:, -1]

  def step(self, params, state, x_B, position_B, sampler):
    """Feed token ``x_B`` at ``position_B``: ``(state, q_BxV, hidden_BxD)`` of the next position."""
    state, logits_Bx1xV, hidden_Bx1xD = self.forward(params, state, x_B[:, None], position_B[:, None])
    return state, sampler.probs(logits_Bx1xV[:, 0]), hidden_Bx1xD[:, 0]

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler):
    keys_BxG = jax.vmap(lambda k: jax.random.split(k, gamma))(key_B)
    cache, q_BxV, _ = self.begin(params, state, tokens_BxS, length_B, sampler)

    def step(carry, key_B):
      cache, q_BxV, position_B = carry
      x_B = jax.vmap(sampling.sample)(key_B, q_BxV)
      cache, q_next_BxV, _ = self.step(params, cache, x_B, position_B, sampler)
      return (cache, q_next_BxV, position_B + 1), (x_B, q_BxV)

    keys_GxB = jnp.swapaxes(keys_BxG, 0, 1)
    # γ − 1 steps that also feed their token, then the last draft token is sampled without a forward.
    (cache, q_last_BxV, _), (draft_GmxB, q_GmxBxV) = jax.lax.scan(step, (cache, q_BxV, length_B), keys_GxB[:-1])
    x_last_B = jax.vmap(sampling.sample)(keys_GxB[-1], q_last_BxV)
    draft_BxG = jnp.concatenate([jnp.swapaxes(draft_GmxB, 0, 1), x_last_B[:, None]], axis=1)
    q_BxGxV = jnp.concatenate([jnp.swapaxes(q_GmxBxV, 0, 1), q_last_BxV[:, None]], axis=1)
    return cache, chain_draft(draft_BxG.astype(jnp.int32), q_BxGxV)

  def commit(self, params, state, commit: Commit):
    del params, commit  # the cache is indexed by position: moving the row's length is the rollback
    return state
