"""Where blockspec_jax keeps files on disk: one place for the cache directory (models, converted weights, the
compiled CPU kernel, JAX's persistent compilation cache).

``$BLOCKSPEC_JAX_CACHE`` when set, else ``~/.cache/blockspec_jax``. Nothing here imports JAX or the models, so any
module (the kernel builder included) can use it without import cycles.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["CACHE_ENV_VAR", "default_cache_dir"]

CACHE_ENV_VAR = "BLOCKSPEC_JAX_CACHE"


def default_cache_dir() -> pathlib.Path:
  """``$BLOCKSPEC_JAX_CACHE`` if set, else ``~/.cache/blockspec_jax`` (not created here)."""
  env = os.environ.get(CACHE_ENV_VAR)
  return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "blockspec_jax"
