"""Drafters: the protocol the speculative loop relies on, and the drafters that implement it."""

from blockspec_jax.drafters.base import Drafter, ModelDrafter, feed

__all__ = ["Drafter", "ModelDrafter", "feed"]
