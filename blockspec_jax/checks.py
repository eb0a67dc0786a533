"""Argument checks shared by the library, the jobs and the command lines: one wording for one mistake.

Nothing here imports JAX or any other blockspec_jax module, so every module can use it without import cycles.
"""

from __future__ import annotations

import numbers

__all__ = ["UsageError", "check_int"]


class UsageError(ValueError):
  """The caller's input cannot work: a setting, a name, a path or a user's file (a prompt file that is not UTF-8, a
  damaged checkpoint). The command lines print it as one line (``cli.cli_errors``); any other exception is a fault
  of the program and keeps its traceback. A ValueError, so library callers may catch either."""


def check_int(value, name: str, low: int = 1, *, hint: str = "", error: type[Exception] = ValueError,
              numpy: bool = True) -> int:
  """``value`` as a Python ``int`` when it is an integer ``>= low``; otherwise ``error`` (ValueError by default; the
  jobs pass their UsageError) saying ``"<name> must be an integer >= <low><hint>, got <value!r>"``.

  Integers are Python and NumPy integers (``numpy=False``: Python ints only, e.g. a setting recorded as JSON);
  ``True`` / ``False``, floats (``2.0`` too) and strings are refused. ``hint`` adds what the number means
  (``" (tokens committed per round)"``)."""
  kinds = numbers.Integral if numpy else int
  if isinstance(value, bool) or not isinstance(value, kinds) or value < low:
    raise error(f"{name} must be an integer >= {low}{hint}, got {value!r}")
  return int(value)
