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

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import artifacts

from blockspec_jax.drafters.base import ModelDrafter
from blockspec_jax.drafters.registry import register
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


@register("sprinter")
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

  def prefill_key(self):
    """The prefill feeds the drafter model alone (:meth:`init_state` reads ``params["model"]``), so drafters
    that differ only in their head share prefill states."""
    return dataclasses.replace(self, head=None)  # dataclass equality compares the class too

  run_setting = "head"  # the field naming the training run (methods.trained_drafter_spec)
  run_what = "a trained verifier head"
  run_train = "train one with `python -m blockspec_jax.train --gin_file gin/train/sprinter_qwen.gin`"

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    return {**values, "head": check_directory(values["head"], "head")}

  @classmethod
  def _run_record(cls, directory) -> dict:
    return HEAD.read_record(directory, convert={"d_model": int})

  @classmethod
  def untrained(cls, target_config, target_params, drafter_config, drafter_params, gamma):
    """The drafter with a zero head (:func:`init_head`: every context accepted with probability 1/2); as a chain
    drafter it drafts exactly as the model drafter does."""
    drafter, _ = super().untrained(target_config, target_params, drafter_config, drafter_params, gamma)
    return drafter, {"model": drafter_params, "head": init_head(drafter_config.d_model)}

  def load_params(self, drafter_model, target_model):
    """``{"model": the drafter's parameters, "head": the trained head}`` (host side): the head from the ``head``
    work directory, checked against the drafter's hidden size. ``drafter_model`` / ``target_model``:
    ``hub.LoadedModel``s."""
    del target_model
    if self.head is None:
      raise ValueError(self.run_needed())
    head, _ = load_head(self.head, d_model=drafter_model.config.d_model)
    return {"model": drafter_model.params["params"], "head": head}

  def acceptable_probs(self, params, hidden_BxD: jax.Array) -> jax.Array:
    """f32 ``[B]``: the head's probability that the token drawn at each row's context is acceptable."""
    return head_probs(params["head"], hidden_BxD)


# --- trained artifact: the head's files (written by blockspec_jax.train.sprinter, read here) ------------------

HEAD_JSON, HEAD_NPZ = "head.json", "head.npz"
HEAD = artifacts.Artifact(
    HEAD_NPZ, HEAD_JSON, what="SPRINTER head",
    absent="is not the work directory of a finished SPRINTER head training run (python -m blockspec_jax.train "
    "--gin_file gin/train/sprinter_*.gin)", remedy="rerun the head's training job")

def _check_head(w_D: np.ndarray, b: np.ndarray, where: str) -> None:
  if w_D.ndim != 1 or w_D.shape[0] < 1 or np.shape(b) != ():
    raise ValueError(f"{where}: a head is w_D [D] and b [], got shapes {w_D.shape} and {np.shape(b)}")
  if not (np.all(np.isfinite(w_D)) and np.isfinite(b)):
    raise ValueError(f"{where}: the head holds NaN or infinite values")


def save_head(workdir, head, info: dict | None = None) -> pathlib.Path:
  """Write the head to ``<workdir>/head.npz`` (``w_D`` f32 [D], ``b`` f32 []) and ``<workdir>/head.json``: ``info``
  (JSON-able: drafter, target, temperature, the held-out report, …) plus ``d_model``, ``b``, ``w_norm``, the npz's
  name and SHA-256 (checked on load). Both written atomically, the npz first. Returns the json's path."""
  w_D, b = np.asarray(head["w_D"], np.float32), np.asarray(head["b"], np.float32)
  _check_head(w_D, b, "save_head")
  return HEAD.save(workdir, {"w_D": w_D, "b": b}, info,
                    {"d_model": int(w_D.shape[0]), "b": float(b),
                     "w_norm": float(np.linalg.norm(w_D.astype(np.float64)))})


def load_head(workdir, d_model: int | None = None):
  """``(head, info)`` saved by :func:`save_head`: ``head = {"w_D": f32 [D], "b": f32 []}`` (jax arrays) and the
  json's dict. FileNotFoundError for a missing directory or file, ValueError for a corrupted or tampered file (the
  SHA-256 recorded in the json must match the npz) or, with ``d_model``, a head of another width."""
  workdir = pathlib.Path(workdir).expanduser()
  arrays, info = HEAD.load(workdir, convert={"d_model": int}, names=("w_D", "b"), dtype=np.float32)
  w_D, b, width = arrays["w_D"], arrays["b"], info["d_model"]
  path, npz_path = HEAD.paths(workdir, info)
  _check_head(w_D, b, str(npz_path))
  if w_D.shape[0] != width:
    raise ValueError(f"{npz_path} holds a head of D = {w_D.shape[0]}, {path} says d_model = {width}")
  if d_model is not None and int(d_model) != width:
    raise ValueError(f"the SPRINTER head in {workdir} was trained on hidden states of D = {width} (drafter "
                     f"{info.get('drafter', '?')}); this drafter has D = {d_model}")
  return {"w_D": jnp.asarray(w_D), "b": jnp.asarray(b)}, info
