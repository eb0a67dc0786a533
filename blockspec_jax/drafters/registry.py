"""The drafter registry: :data:`DRAFTERS`, filled by one ``@register("<name>")`` on each drafter class.

A drafter is its module plus that one decorator; nothing else in the library names it::

    @register("k_chains")
    @dataclasses.dataclass(frozen=True)          # optional: register makes the class a frozen dataclass if needed
    class KChainDrafter(_TreeModelDrafter):
      k: int = 2                                 # settings are fields (checked in ``checked``: drafters.settings)
      sibling_sampling = WITH_REPLACEMENT        # which rules may verify it (verify.Verifier.check_drafter)

What a drafter declares beside its contract (:class:`blockspec_jax.contracts.Drafter`) and its settings
(:class:`~blockspec_jax.drafters.settings.Settings`): ``default_settings(gamma)`` (what a job's drafter gets when it
does not set them), ``budget_shape(budget, branches)`` (its shape at a node budget), ``build(target_config,
drafter_config, **settings)`` (on a job's loaded models) and ``untrained(...)`` (with its trained parts at their
initial values: what the registry-wide law tests run).
"""

from __future__ import annotations

import dataclasses

from blockspec_jax.contracts import POINT_MASS, SAMPLING_BEAM, SAMPLING_CHAIN, WITH_REPLACEMENT, WITHOUT_REPLACEMENT
from blockspec_jax.drafters.settings import Settings

__all__ = ["DRAFTERS", "register", "SAMPLINGS"]

#: name -> registered drafter class, in registration order (filled by :func:`register`).
DRAFTERS: dict[str, type] = {}

#: The sibling samplings a drafter may declare; chains draw one child per node (``"chain"``, or ``"beam"``: the best
#: of several beams).
SAMPLINGS = (SAMPLING_CHAIN, SAMPLING_BEAM, WITH_REPLACEMENT, WITHOUT_REPLACEMENT, POINT_MASS)

_CONTRACT = ("num_nodes", "init_state", "propose", "commit")


def register(name: str):
  """Class decorator registering a drafter class under ``name`` (sets its ``name``; makes it a frozen dataclass when
  its body is not one already). A ValueError naming the problem for a taken or malformed name (no ``/``, ``:``,
  ``@`` or spaces: jobs write ``"<rule>@<drafter>/<variant>"`` and ``"<drafter>:<run dir>"``), a class that does not
  mix in :class:`~blockspec_jax.drafters.settings.Settings` or lacks a method of the contract, or inconsistent
  ``is_chain`` / ``sibling_sampling``."""
  if not isinstance(name, str) or not name or any(c in name for c in "/:@ "):
    raise ValueError(f"a drafter's name is a non-empty string without '/', ':', '@' or spaces, got {name!r}")

  def decorate(cls):
    if name in DRAFTERS:
      raise ValueError(f"drafter {name!r} is already registered ({DRAFTERS[name].__qualname__})")
    if not (isinstance(cls, type) and issubclass(cls, Settings)):
      raise ValueError(f"drafter {name!r}: the class must mix in drafters.settings.Settings (its settings and their "
                       f"checks), got {cls!r}")
    missing = [m for m in _CONTRACT if not callable(getattr(cls, m, None))]
    if missing:
      raise ValueError(f"drafter {name!r} lacks {', '.join(missing)} of the Drafter contract (contracts.Drafter)")
    sibling_sampling, is_chain = getattr(cls, "sibling_sampling", None), getattr(cls, "is_chain", None)
    if sibling_sampling not in SAMPLINGS or not isinstance(is_chain, bool) or \
        is_chain != (sibling_sampling in (SAMPLING_CHAIN, SAMPLING_BEAM)):
      raise ValueError(f"drafter {name!r} must declare sibling_sampling (one of {', '.join(SAMPLINGS)}) and is_chain "
                       f"(True exactly for 'chain' and 'beam'), got {sibling_sampling!r} and {is_chain!r}")
    if "__dataclass_params__" not in cls.__dict__:
      cls = dataclasses.dataclass(frozen=True)(cls)
    cls.name = name
    DRAFTERS[name] = cls
    return cls

  return decorate
