"""SD²: a pretrained drafter steered by the target's hidden states (Berdoz, Rheinboldt, Wattenhofer, AAAI 2026,
arXiv 2511.09844).

After every verification the target's residual stream at the last accepted position (the query whose law produced
the last committed token, :meth:`blockspec_jax.contracts.Commit.last_states`) is read at ``K`` depths
(default :func:`default_target_layers`: the inputs of layers 3, L/2 and L − 3 of the target's ``L``, as the authors) and
mapped to one bias per steered drafter layer, added inside that layer's MLP::

    x_BxKD  = concat(taps_BxKxD)                                  [l, m, h]: K · Dt
    u_BxD   = LayerNorm(W_hml x + b_hml)                          W_hml [Dt, K·Dt] starts as K concatenated
                                                                  identities (the sum of the taps); LN scale / bias
    v_BxnF  = W_guide u                                           W_guide [n·F, Dt], no bias, ZERO at initialisation
                                                                  (or low rank: up [n·F, r] (zero) · down [r, Dt])
    MLP_i(x) = down(act(gate(x)) * (up(x) + v[i]))                for the n steered layers i; 0 for the others

``steering_deltas`` returns the biases of every drafter layer, f32 ``[L, B, 1, F]`` (zeros in unsteered layers),
which :class:`~blockspec_jax.models.decoder.Decoder` takes as ``mlp_delta_LxBxTxF``. Parameters of the map
(:func:`init_steer`; all float32, linear weights ``(out, in)`` as in the decoder)::

    hml/weight [Dt, K·Dt]   hml/bias [Dt]   norm/scale [Dt]   norm/bias [Dt]
    guide/weight [n·F, Dt]                                   (full rank, the paper's map)
    guide/down [r, Dt] (Gaussian, std 1/√Dt), guide/up [n·F, r] (zeros)   (rank r)

:class:`SteeredDrafter` is :class:`~blockspec_jax.drafters.base.ModelDrafter` with these biases: its state holds the
drafter's cache and the current biases ``delta_LxBx1xF``; :meth:`SteeredDrafter.commit` recomputes them from the
commit's taps, and every forward of the next draft (the re-fed last two committed tokens and each drafted token)
uses them. Keys and values written under an earlier vector stay in the cache. The prompt is fed plain
(``init_state``); the prefill's :func:`~blockspec_jax.contracts.prompt_commit` sets the first biases.

Lossless: the biases depend only on the target's states at committed positions, fixed before the draft is drawn, and
each drafted token is sampled from exactly the row ``q = sampler.probs(steered logits)`` the draft reports, so the
draft is an ordinary chain draft and every lossless chain rule keeps the target's law. With ``W_guide = 0`` every
bias is an exact zero (``u · 0``), ``up(x) + 0 = up(x)`` bit for bit, and the steered drafter IS the plain drafter.

Parameters of the drafter: ``{"model": decoder params, "steer": the map}``; ``steer`` (a field) names the training
run's work directory (:func:`blockspec_jax.train.steer.load_steer`), whose record also gives ``target_layers`` and
``steered_layers`` when they are not set.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from blockspec_jax import artifacts
from blockspec_jax.checks import check_int
from blockspec_jax.contracts import Commit
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import check_directory
from blockspec_jax.models import decoder as decoder_lib

__all__ = ["SteerState", "SteeredDrafter", "default_target_layers", "init_steer", "steer_dims", "steering_vectors",
           "to_layers", "steering_deltas", "check_layers", "model_identity", "check_trained_on", "LAYER_NORM_EPS"]

#: LayerNorm epsilon of the map (torch's ``nn.LayerNorm`` default, as in the authors' code).
LAYER_NORM_EPS = 1e-5


def default_target_layers(num_target_layers: int) -> tuple[int, ...]:
  """The target layers SD² reads, as the authors' code taps them: the INPUTS of decoder layers 3, ``L // 2`` and
  ``L − 3`` (the residual stream after 3, ``L // 2`` and ``L − 3`` blocks), i.e. after our layers
  ``(2, L // 2 − 1, L − 4)``, each clamped to ``[0, L − 1]`` and sorted (``(2, 13, 24)`` for a 28-layer target,
  ``(2, 15, 28)`` for the authors' 32; a 4-layer one gives ``(0, 1, 2)``). Until 2026-11-28 the default was
  ``(2, L // 2, L − 3)``, the middle and high taps one block deeper; the steering runs reported until then set it
  in their gin files."""
  num_target_layers = check_int(num_target_layers, "num_target_layers")
  top = num_target_layers - 1
  return tuple(sorted(min(max(i, 0), top) for i in (2, num_target_layers // 2 - 1, num_target_layers - 4)))


def check_layers(layers, num_layers: Optional[int], what: str, allow_repeats: bool = False) -> tuple[int, ...]:
  """``layers`` as a non-empty tuple of layer indices in ``[0, num_layers)`` (lists from JSON / gin accepted;
  ``num_layers`` None: the model is not known yet, indices ``>= 0``); ValueError naming ``what`` otherwise. Without
  ``allow_repeats`` they must be strictly increasing."""
  if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
    raise ValueError(f"{what} must be a non-empty tuple of layer indices, got {layers!r}")
  layers = tuple(layers)
  top = float("inf") if num_layers is None else num_layers
  if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < top for i in layers):
    bound = ">= 0" if num_layers is None else f"in [0, {num_layers})"
    raise ValueError(f"{what} must be layer indices {bound}, got {layers}")
  if not allow_repeats and any(a >= b for a, b in zip(layers, layers[1:])):
    raise ValueError(f"{what} must be strictly increasing, got {layers}")
  return layers


def init_steer(target_d_model: int, num_taps: int, drafter_config: decoder_lib.DecoderConfig,
               steered_layers: Optional[Sequence[int]] = None, dtype=jnp.float32, rank: Optional[int] = None,
               seed: int = 0) -> dict:
  """The untrained map: ``W_hml`` = ``num_taps`` concatenated identities (bias 0), LayerNorm scale 1 / bias 0, and a
  zero ``W_guide`` (so the steered drafter equals the plain one bit for bit).

  ``steered_layers``: drafter layers that get a bias (None: all); ``rank``: None for the paper's full
  ``[n·F, Dt]`` guide, else ``up [n·F, r]`` (zeros) after ``down [r, Dt]`` (Gaussian, std ``1/√Dt``, from
  ``key(seed)``; LoRA's split: zero output, live gradients). ``dtype``: the parameters' dtype (float32 for training).
  """
  for name, value in (("target_d_model", target_d_model), ("num_taps", num_taps)):
    check_int(value, name)
  layers = tuple(range(drafter_config.num_layers)) if steered_layers is None else check_layers(
      steered_layers, drafter_config.num_layers, "steered_layers")
  width = len(layers) * drafter_config.ffn_dim
  eye_DxD = jnp.eye(target_d_model, dtype=dtype)
  steer = {"hml": {"weight": jnp.concatenate([eye_DxD] * num_taps, axis=1),
                   "bias": jnp.zeros((target_d_model,), dtype)},
           "norm": {"scale": jnp.ones((target_d_model,), dtype), "bias": jnp.zeros((target_d_model,), dtype)}}
  if rank is None:
    steer["guide"] = {"weight": jnp.zeros((width, target_d_model), dtype)}
  else:
    rank = check_int(rank, "rank", hint=" (or None for the full map)")
    down_RxD = jax.random.normal(jax.random.key(seed), (rank, target_d_model), jnp.float32) / math.sqrt(target_d_model)
    steer["guide"] = {"down": down_RxD.astype(dtype), "up": jnp.zeros((width, rank), dtype)}
  return steer


def steer_dims(steer) -> dict:
  """``{"target_d_model", "num_taps", "width", "rank"}`` of a map (``width`` = n·F, ``rank`` None when full); a
  ValueError when its tree or shapes are not a steering map's."""
  try:
    weight, bias = steer["hml"]["weight"], steer["hml"]["bias"]
    scale, norm_bias = steer["norm"]["scale"], steer["norm"]["bias"]
    guide = steer["guide"]
  except (KeyError, TypeError) as e:
    raise ValueError(f"not a steering map (hml / norm / guide): missing {e}") from None
  d_model = bias.shape[0] if bias.ndim == 1 else -1
  if bias.ndim != 1 or weight.ndim != 2 or weight.shape[0] != d_model or weight.shape[1] % max(d_model, 1) \
      or weight.shape[1] == 0 or scale.shape != (d_model,) or norm_bias.shape != (d_model,):
    raise ValueError(f"steering map: hml/weight {weight.shape}, hml/bias {bias.shape}, norm/scale {scale.shape} and "
                     f"norm/bias {norm_bias.shape} are not [Dt, K·Dt], [Dt], [Dt], [Dt]")
  if set(guide) == {"weight"}:
    if guide["weight"].ndim != 2 or guide["weight"].shape[1] != d_model:
      raise ValueError(f"steering map: guide/weight {guide['weight'].shape} is not [n·F, Dt = {d_model}]")
    width, rank = guide["weight"].shape[0], None
  elif set(guide) == {"down", "up"}:
    down, up = guide["down"], guide["up"]
    if down.ndim != 2 or up.ndim != 2 or down.shape[1] != d_model or up.shape[1] != down.shape[0]:
      raise ValueError(f"steering map: guide/down {down.shape} and guide/up {up.shape} are not [r, Dt = {d_model}] "
                       "and [n·F, r]")
    width, rank = up.shape[0], down.shape[0]
  else:
    raise ValueError(f"steering map: guide holds {sorted(guide)}, expected ['weight'] or ['down', 'up']")
  return {"target_d_model": int(d_model), "num_taps": int(weight.shape[1] // d_model), "width": int(width),
          "rank": None if rank is None else int(rank)}


def steering_vectors(steer, taps_XxKxD: jax.Array, ffn_dim: int) -> jax.Array:
  """f32 ``[..., n, F]``: the map on the target's taps ``[..., K, Dt]`` (any leading shape; computed in float32)."""
  x_XxKD = taps_XxKxD.astype(jnp.float32).reshape(taps_XxKxD.shape[:-2] + (-1,))
  lead = (1,) * (x_XxKD.ndim - 1)
  vector = lambda v_D: v_D.astype(jnp.float32).reshape(lead + v_D.shape)  # [D] at the rank of [..., D]
  h_XxD = jnp.einsum("...i,oi->...o", x_XxKD, steer["hml"]["weight"].astype(jnp.float32)) \
      + vector(steer["hml"]["bias"])
  mean_Xx1 = jnp.mean(h_XxD, axis=-1, keepdims=True)
  var_Xx1 = jnp.mean(jnp.square(h_XxD - mean_Xx1), axis=-1, keepdims=True)
  u_XxD = (h_XxD - mean_Xx1) * jax.lax.rsqrt(var_Xx1 + LAYER_NORM_EPS) * vector(steer["norm"]["scale"]) \
      + vector(steer["norm"]["bias"])
  guide = steer["guide"]
  if "weight" in guide:
    v_XxW = jnp.einsum("...d,wd->...w", u_XxD, guide["weight"].astype(jnp.float32))
  else:
    z_XxR = jnp.einsum("...d,rd->...r", u_XxD, guide["down"].astype(jnp.float32))
    v_XxW = jnp.einsum("...r,wr->...w", z_XxR, guide["up"].astype(jnp.float32))
  width = v_XxW.shape[-1]
  if width % ffn_dim:
    raise ValueError(f"the steering map's output width {width} is not a multiple of the drafter's F = {ffn_dim}")
  return v_XxW.reshape(v_XxW.shape[:-1] + (width // ffn_dim, ffn_dim))


def to_layers(vectors_BxTxNxF: jax.Array, num_layers: int,
              steered_layers: Optional[Sequence[int]] = None) -> jax.Array:
  """f32 ``[L, B, T, F]``: the ``n`` steered layers' biases in their layers, zeros in the others (``steered_layers``
  None: all ``L`` layers, in order)."""
  n_steered = vectors_BxTxNxF.shape[2]
  layers = tuple(range(num_layers)) if steered_layers is None else tuple(steered_layers)
  if len(layers) != n_steered:
    raise ValueError(f"the steering map has {n_steered} layer biases, but {len(layers)} drafter layers are steered "
                     f"({layers})")
  moved_NxBxTxF = jnp.moveaxis(vectors_BxTxNxF, 2, 0)
  if layers == tuple(range(num_layers)):
    return moved_NxBxTxF
  zeros_LxBxTxF = jnp.zeros((num_layers,) + moved_NxBxTxF.shape[1:], moved_NxBxTxF.dtype)
  return zeros_LxBxTxF.at[jnp.asarray(layers, jnp.int32)].set(moved_NxBxTxF)


def steering_deltas(steer, taps_BxKxD: jax.Array, drafter_config: decoder_lib.DecoderConfig,
                    steered_layers: Optional[Sequence[int]] = None) -> jax.Array:
  """f32 ``[L_drafter, B, 1, F]``: every drafter layer's MLP bias for the target's taps ``[B, K, Dt]`` at one
  position per row (zeros in the layers not in ``steered_layers``; None = all)."""
  vectors_BxNxF = steering_vectors(steer, taps_BxKxD, drafter_config.ffn_dim)
  return to_layers(vectors_BxNxF[:, None], drafter_config.num_layers, steered_layers)


@struct.dataclass
class SteerState:
  """The steered drafter's loop state: its KV cache and the biases of the current draft, f32 ``[L, B, 1, F]``."""
  cache: decoder_lib.KVCache
  delta_LxBx1xF: jax.Array

  @property
  def max_len(self) -> int:
    return self.cache.max_len


@register("steered")
@dataclasses.dataclass(frozen=True)
class SteeredDrafter(ModelDrafter):
  """:class:`~blockspec_jax.drafters.base.ModelDrafter` steered by the target (SD²; see the module docstring).

  ``target_layers``   the target layers read (the loop taps them; order = the map's ``[l, m, h]``)
  ``steered_layers``  drafter layers with a bias (None: all)
  ``steer``           work directory of the trained map (``load_params`` reads it; not used under jit). When given,
                      unset ``target_layers`` / ``steered_layers`` are taken from its record.
  """

  target_layers: tuple[int, ...] = ()
  steered_layers: Optional[tuple[int, ...]] = None
  steer: Optional[str] = None
  reads_target = True
  run_setting = "steer"  # the field naming the training run (methods.trained_drafter_spec)
  run_what = "a trained steering map"
  run_train = "train one with `python -m blockspec_jax.train --gin_file gin/train/steer_qwen.gin`"

  def __post_init__(self):
    target_layers, steered_layers = self.target_layers, self.steered_layers
    if self.steer is not None and (not target_layers or steered_layers is None):
      recorded = _recorded_layers(self.steer)
      if recorded is not None:
        target_layers = target_layers or recorded[0]
        steered_layers = recorded[1] if steered_layers is None else steered_layers
    object.__setattr__(self, "target_layers", target_layers)
    object.__setattr__(self, "steered_layers", steered_layers)
    super().__post_init__()

  @classmethod
  def checked(cls, values, config=None):
    """Target layers: indices >= 0 (their bound, the target's depth, is checked when the map loads); steered
    layers: strictly increasing indices below the drafter's depth (with ``config``)."""
    values = super().checked(values, config)
    target_layers, steered_layers = values["target_layers"], values["steered_layers"]
    target_layers = check_layers(target_layers, None, "target_layers", allow_repeats=True) if target_layers else ()
    if steered_layers is not None:
      steered_layers = check_layers(steered_layers, None if config is None else config.num_layers, "steered_layers")
    return {**values, "target_layers": target_layers, "steered_layers": steered_layers,
            "steer": check_directory(values["steer"], "steer")}

  @classmethod
  def _run_record(cls, directory) -> dict:
    return read_steer_info(directory)

  @classmethod
  def untrained(cls, target_config, target_params, drafter_config, drafter_params, gamma):
    """The drafter reading :func:`default_target_layers` of the target through the untrained map
    (:func:`init_steer`: a zero guide, so it drafts exactly as the plain model drafter)."""
    del target_params, gamma
    target_layers = default_target_layers(target_config.num_layers)
    drafter = cls.build(target_config, drafter_config, target_layers=target_layers)
    steer = init_steer(target_config.d_model, len(target_layers), drafter_config)
    return drafter, {"model": drafter_params, "steer": steer}

  @property
  def layers(self) -> tuple[int, ...]:
    """The steered drafter layers (all of them when ``steered_layers`` is None)."""
    return tuple(range(self.config.num_layers)) if self.steered_layers is None else self.steered_layers

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    cache = super().init_state(params["model"], tokens_BxP, prompt_len_B, max_len)  # the prompt, unsteered
    delta_LxBx1xF = jnp.zeros((self.config.num_layers, tokens_BxP.shape[0], 1, self.config.ffn_dim), jnp.float32)
    return SteerState(cache, delta_LxBx1xF)

  def forward(self, params, state: SteerState, tokens_BxT, positions_BxT):
    """One steered forward (the only place the biases enter the drafter; ``begin``, ``step`` and ``propose`` are
    :class:`ModelDrafter`'s): the current draft's biases added to every MLP up-projection."""
    logits_BxTxV, cache, hidden_BxTxD = feed(self.module, params["model"], tokens_BxT, positions_BxT, state.cache,
                                             state.max_len, return_hidden=True, mlp_delta_LxBxTxF=state.delta_LxBx1xF)
    return state.replace(cache=cache), logits_BxTxV, hidden_BxTxD

  def replay(self, params, state: SteerState, tokens_BxS, taps_BxPxKxD, start_B, end_B, stride: int):
    """The cache decoding leaves after committing positions ``start_B .. end_B − 1`` of ``tokens_BxS`` in rounds of
    ``stride`` tokens, from a state prefilled plainly over ``tokens_BxS[b, :end_B[b]]``.

    A round that starts at length ``L`` re-feeds positions ``L − 2``, ``L − 1`` and drafts from ``L`` on under the
    vector of the target's taps at ``L − 2``; when it commits ``stride`` tokens, the next round overwrites from
    ``L + stride − 2`` on. So positions ``[s, s + stride)`` with ``s = start − 2 + k·stride`` hold keys and values
    written under the map of the taps at ``s`` (zeros where ``s < 0``), up to ``end − 2``; positions
    ``end − 2, end − 1`` are re-fed by the next draft (:meth:`begin`) and the prompt before ``start − 2`` stays plain.
    Re-fed in order, block by block, so each block attends to the rewritten blocks before it. ``taps_BxPxKxD``: the
    target's taps at the prefilled positions; the biases are left for the caller's commit to set."""
    batch, width = taps_BxPxKxD.shape[:2]
    rows_B = jnp.arange(batch)
    first_B = start_B - 2
    offset_T = jnp.arange(stride, dtype=jnp.int32)
    num_blocks = jnp.max(-((first_B - (end_B - 2)) // stride))  # ⌈(end − start) / stride⌉ over the rows

    def block(k, state):
      source_B = first_B + k * stride
      taps_BxKxD = taps_BxPxKxD[rows_B, jnp.clip(source_B, 0, width - 1)]
      taps_BxKxD = jnp.where((source_B >= 0)[:, None, None], taps_BxKxD, 0)  # one-token prompts: no state
      # Rows past their end re-feed their last positions (next draft rewrites them); positions never leave the row.
      positions_BxT = jnp.clip(source_B[:, None] + offset_T[None, :], 0, (end_B - 1)[:, None])
      tokens_BxT = tokens_BxS[rows_B[:, None], positions_BxT]
      state = state.replace(delta_LxBx1xF=steering_deltas(params["steer"], taps_BxKxD, self.config,
                                                          self.steered_layers))
      return self.forward(params, state, tokens_BxT, positions_BxT)[0]

    return jax.lax.fori_loop(0, num_blocks, block, state)

  def commit(self, params, state: SteerState, commit: Commit):
    """The next draft's biases from the target's taps at the last accepted position (``commit.last_states()``)."""
    _, taps_BxKxD = commit.last_states()
    if taps_BxKxD is None or not self.target_layers:
      raise ValueError("SteeredDrafter reads the target's layers but got no taps: give target_layers (e.g. "
                       "default_target_layers(target.num_layers)) or a trained map `steer` whose record names them")
    delta_LxBx1xF = steering_deltas(params["steer"], taps_BxKxD, self.config, self.steered_layers)
    return state.replace(delta_LxBx1xF=delta_LxBx1xF)

  def load_params(self, drafter_model, target_model):
    """``{"model": the drafter's parameters, "steer": the trained map}`` (host side): the map from the ``steer``
    work directory, checked against both models' shapes and this drafter's layers. ``drafter_model`` /
    ``target_model``: ``hub.LoadedModel``s."""
    if self.steer is None:
      raise ValueError(self.run_needed())
    steer, info = load_steer(self.steer, target_config=target_model.config,
                                         drafter_config=drafter_model.config, target_layers=self.target_layers or None,
                                         steered_layers=self.layers)
    check_trained_on(info, drafter_model, self.steer)
    return {"model": drafter_model.params["params"], "steer": steer}


def model_identity(source) -> Optional[str]:
  """What a drafter IS, comparable between a map's record and a loaded model: the resolved work directory of a
  drafter training run (``<dir>``, ``<dir>@<step>``; a ``hub.LocalSource`` of kind ``"trained"``), the resolved path
  of a local checkpoint, or a registry name; None when unknown (no spec, a random tiny model's label).

  ``source``: a ``hub.LoadedModel``'s ``spec`` (``ModelSpec`` / ``LocalSource``) or the drafter string a training
  job recorded."""
  import pathlib
  if isinstance(source, str):
    base, sep, _ = source.rpartition("@")
    for text in ((base, source) if sep else (source,)):
      path = pathlib.Path(text).expanduser()
      if path.exists():
        return str(path.resolve())
    return None if source.startswith("random tiny") or "/" in source else source
  if source is None or not isinstance(getattr(source, "name", None), str):
    return None
  path = getattr(source, "path", None)
  if path is not None:  # a local checkpoint or a training run (its name carries the step: ignored)
    return str(pathlib.Path(path).expanduser().resolve())
  return source.name


def check_trained_on(info: dict, drafter_model, workdir) -> None:
  """ValueError when the map in ``workdir`` (its record ``info``) was trained on another drafter than
  ``drafter_model``: its biases were fit to that drafter's MLPs, and the same shapes (a LoRA-distilled drafter has
  its base's) would decode silently with a map it was not trained with. Skipped where either side is unknown. A map
  trained jointly with its drafter (its record names ``drafter_step``) also refuses another step of that run."""
  recorded = model_identity(info.get("drafter")) if isinstance(info.get("drafter"), str) else None
  here = model_identity(getattr(drafter_model, "spec", None))
  if recorded is not None and here is not None and recorded != here:
    raise ValueError(f"the SD² map in {workdir} was trained on the drafter {info['drafter']!r}; this drafter is "
                     f"{here!r} (give the map its own drafter: --drafter / the method's drafter model)")
  step = info.get("drafter_step")  # a map tuned jointly with its drafter belongs to that checkpoint only
  name = getattr(getattr(drafter_model, "spec", None), "name", None)
  if recorded is not None and recorded == here and step is not None and isinstance(name, str):
    loaded_step = name.rpartition("@")[2]
    if loaded_step != str(step):
      raise ValueError(f"the SD² map in {workdir} was trained jointly with its drafter's step {step}; this drafter "
                       f"is {name!r} (load the run's newest checkpoint: --drafter {recorded})")


def _recorded_layers(workdir):
  """``(target_layers, steered_layers)`` from a training run's record, or None when it cannot be read (then
  :meth:`SteeredDrafter.load_params` reports the problem)."""
  try:
    info = read_steer_info(workdir)
    return tuple(info["target_layers"]), tuple(info["steered_layers"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


# --- trained artifact: the map's files (written by blockspec_jax.train.steer, read here) ---------------------

STEER_JSON, STEER_NPZ = "steer.json", "steer.npz"
STEER = artifacts.Artifact(
    STEER_NPZ, STEER_JSON, what="SD² steering map",
    absent="is not the work directory of a finished SD² training run (python -m blockspec_jax.train --gin_file "
    "gin/train/steer_*.gin)", remedy="rerun the SD² training job")

def _flatten(tree, prefix: str = "") -> dict:
  flat = {}
  for key in sorted(tree):
    value = tree[key]
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(_flatten(value, path + "/"))
    else:
      flat[path] = value
  return flat


def _unflatten(flat: Mapping) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = value
  return tree


def save_steer(workdir, steer, info: Optional[dict] = None) -> pathlib.Path:
  """Write the map to ``<workdir>/steer.npz`` (float32 leaves by path, e.g. ``guide/weight``) and
  ``<workdir>/steer.json``: ``info`` (JSON-able; must name ``target_layers``, ``steered_layers`` and the drafter's
  ``drafter_layers`` / ``ffn_dim``) plus the map's dimensions, the npz's name and SHA-256 (checked on load). Both
  written atomically, the npz first. Returns the json's path."""
  info = dict(info or {})
  missing = [k for k in ("target_layers", "steered_layers", "drafter_layers", "ffn_dim") if k not in info]
  if missing:
    raise ValueError(f"save_steer: info must name {missing} (the layers and drafter shape the map belongs to)")
  dims = steer_dims(steer)
  flat = {path: np.asarray(value, np.float32) for path, value in _flatten(steer).items()}
  if not all(np.all(np.isfinite(v)) for v in flat.values()):
    raise ValueError("save_steer: the map holds NaN or infinite values")
  _check_record({**info, **dims}, "save_steer")
  return STEER.save(workdir, flat, {**info, **dims},
                     {"target_layers": [int(i) for i in info["target_layers"]],
                      "steered_layers": [int(i) for i in info["steered_layers"]]})


def _check_record(record: Mapping, where: str) -> None:
  """The record's layers agree with the map's dimensions: K taps, n·F outputs."""
  if len(record["target_layers"]) != record["num_taps"]:
    raise ValueError(f"{where}: {len(record['target_layers'])} target layers {list(record['target_layers'])} but "
                     f"the map reads K = {record['num_taps']} taps")
  if len(record["steered_layers"]) * int(record["ffn_dim"]) != record["width"]:
    raise ValueError(f"{where}: {len(record['steered_layers'])} steered layers of F = {record['ffn_dim']} need "
                     f"{len(record['steered_layers']) * int(record['ffn_dim'])} outputs, the map has "
                     f"{record['width']}")
  if any(not 0 <= int(i) < int(record["drafter_layers"]) for i in record["steered_layers"]):
    raise ValueError(f"{where}: steered layers {list(record['steered_layers'])} outside the drafter's "
                     f"{record['drafter_layers']} layers")


def read_steer_info(workdir) -> dict:
  """The record (``steer.json``) of a finished SD² training run; FileNotFoundError when absent, ValueError when it is
  not a readable record."""
  return STEER.read_record(workdir, required=("drafter_layers", "ffn_dim", "target_d_model", "num_taps", "width"),
                            convert={"target_layers": _int_tuple, "steered_layers": _int_tuple})


def _int_tuple(values) -> tuple:
  return tuple(int(i) for i in values)


def load_steer(workdir, *, target_config: Optional[decoder_lib.DecoderConfig] = None,
               drafter_config: Optional[decoder_lib.DecoderConfig] = None, target_layers=None, steered_layers=None):
  """``(steer, info)`` saved by :func:`save_steer`: the map as a nested dict of f32 jax arrays, and its record.

  FileNotFoundError for a missing directory or file; ValueError for a corrupted or tampered file (the npz's SHA-256
  must match the record's), a map whose shapes disagree with its record, or one that does not fit the given models
  (``target_config``: its width ``Dt`` and layer count; ``drafter_config``: its layers and MLP width) or layers
  (``target_layers`` / ``steered_layers``: must equal those it was trained with).
  """
  info = read_steer_info(workdir)
  workdir = pathlib.Path(workdir).expanduser()
  json_path, npz_path = STEER.paths(workdir, info)
  flat = STEER.read_arrays(workdir, info, dtype=np.float32)
  steer = _unflatten(flat)
  try:
    dims = steer_dims(steer)
  except ValueError as e:
    raise ValueError(f"{npz_path}: {e}") from None
  if not all(np.all(np.isfinite(v)) for v in flat.values()):
    raise ValueError(f"{npz_path}: the map holds NaN or infinite values")
  for key, value in dims.items():
    if info.get(key) != value:
      raise ValueError(f"{npz_path} holds a map with {key} = {value}, {json_path} says {info.get(key)}")
  _check_record(info, str(json_path))
  trained_on = f"(trained for target {info.get('target', '?')}, drafter {info.get('drafter', '?')})"
  if target_config is not None:
    if target_config.d_model != dims["target_d_model"]:
      raise ValueError(f"the SD² map in {workdir} reads target states of Dt = {dims['target_d_model']} "
                       f"{trained_on}; this target has d_model = {target_config.d_model}")
    if max(info["target_layers"]) >= target_config.num_layers:
      raise ValueError(f"the SD² map in {workdir} reads target layers {list(info['target_layers'])} {trained_on}; "
                       f"this target has {target_config.num_layers} layers")
  if drafter_config is not None:
    if drafter_config.num_layers != int(info["drafter_layers"]) or drafter_config.ffn_dim != int(info["ffn_dim"]):
      raise ValueError(f"the SD² map in {workdir} steers a drafter of {info['drafter_layers']} layers and MLP width "
                       f"F = {info['ffn_dim']} {trained_on}; this drafter has {drafter_config.num_layers} layers "
                       f"and F = {drafter_config.ffn_dim}")
  if target_layers is not None and tuple(target_layers) != info["target_layers"]:
    raise ValueError(f"the SD² map in {workdir} was trained on target layers {list(info['target_layers'])}, the "
                     f"drafter asks for {list(target_layers)}")
  if steered_layers is not None and tuple(steered_layers) != info["steered_layers"]:
    raise ValueError(f"the SD² map in {workdir} steers drafter layers {list(info['steered_layers'])}, the drafter "
                     f"asks for {list(steered_layers)}")
  return jax.tree.map(jnp.asarray, steer), info
