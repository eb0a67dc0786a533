"""SPRINTER's drafter: a model drafter with a learned verifier head on its last hidden state (Zhong et al., arXiv
2502.04557).

The head is linear + sigmoid on the drafter's final-norm hidden state ``h`` at the position that PRODUCED a token
(the state whose logits gave the law ``q`` the token was drawn from)::

    acceptable(h) = sigmoid(h · w_D + b)          params {"w_D": f32 [D], "b": f32 []}

trained with BCE on labels ``1[q(x) ≤ p(x)]`` (:mod:`blockspec_jax.train.sprinter`). Because ``h`` is computed
before the token is drawn, the head's decision does not depend on the token: that is what makes SPRINTER's per-step
law exactly ``(1 − η)·p + η·q`` (:class:`blockspec_jax.verify.SprinterVerifier`).

Parameters of this drafter are ``{"model": <decoder params>, "head": {"w_D", "b"}}``; ``head`` (a field) names the
training run's work directory the jobs load the head from (:func:`blockspec_jax.train.sprinter.load_head`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from blockspec_jax.drafters.base import ModelDrafter
from blockspec_jax.drafters.settings import check_directory

__all__ = ["SprinterDrafter", "head_logits", "head_probs", "init_head"]


def head_logits(head, hidden_BxD: jax.Array) -> jax.Array:
  """f32 ``[...]``: the head's logit ``h · w + b`` for hidden states ``[..., D]`` (computed in f32)."""
  return jnp.einsum("...d,d->...", hidden_BxD.astype(jnp.float32), head["w_D"].astype(jnp.float32)) + head["b"]


def head_probs(head, hidden_BxD: jax.Array) -> jax.Array:
  """f32 ``[...]``: the head's probability that a token drawn at this context is acceptable (``q(x) ≤ p(x)``)."""
  return jax.nn.sigmoid(head_logits(head, hidden_BxD))


def init_head(d_model: int, bias: float = 0.0):
  """A zero head (every context gets ``sigmoid(bias)``): the starting point of training."""
  return {"w_D": jnp.zeros((d_model,), jnp.float32), "b": jnp.asarray(bias, jnp.float32)}


@dataclasses.dataclass(frozen=True)
class SprinterDrafter(ModelDrafter):
  """A :class:`~blockspec_jax.drafters.base.ModelDrafter` whose parameters also hold the verifier head.

  As a chain drafter (``propose``) it drafts exactly as the model drafter does, so any chain rule can verify it; the
  ``sprinter`` rule drives it one token at a time (``begin`` / ``step``) and asks :meth:`acceptable_probs`.
  """

  head: str | None = None  # work directory of the trained head (jobs load {"head": ...} from it); not used in jit

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    return super().init_state(params["model"], tokens_BxP, prompt_len_B, max_len)

  def forward(self, params, state, tokens_BxT, positions_BxT):
    return super().forward(params["model"], state, tokens_BxT, positions_BxT)

  name = "sprinter"
  run_setting = "head"  # the field naming the training run (jobs.trained_drafter_spec)
  run_what = "a trained verifier head"
  run_train = "train one with `python -m blockspec_jax.train --gin_file gin/train/sprinter_qwen.gin`"

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    return {**values, "head": check_directory(values["head"], "head")}

  @classmethod
  def _run_record(cls, directory) -> dict:
    from blockspec_jax.train import sprinter as sprinter_train  # host-side loading only
    return sprinter_train._HEAD.read_record(directory, convert={"d_model": int})

  def load_params(self, drafter_model, target_model):
    """``{"model": the drafter's parameters, "head": the trained head}`` (host side): the head from the ``head``
    work directory, checked against the drafter's hidden size. ``drafter_model`` / ``target_model``:
    ``hub.LoadedModel``s."""
    del target_model
    if self.head is None:
      raise ValueError(self.run_needed())
    from blockspec_jax.train import sprinter as sprinter_train  # host-side loading only
    head, _ = sprinter_train.load_head(self.head, d_model=drafter_model.config.d_model)
    return {"model": drafter_model.params["params"], "head": head}

  def acceptable_probs(self, params, hidden_BxD: jax.Array) -> jax.Array:
    """f32 ``[B]``: the head's probability that the token drawn at each row's context is acceptable."""
    return head_probs(params["head"], hidden_BxD)
