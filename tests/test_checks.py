"""checks.check_int: the one integer check of the library, the jobs and the command lines."""

import numpy as np
import pytest

from blockspec_jax import checks
from blockspec_jax import checks as checks_lib
from blockspec_jax.drafters import lattice
from blockspec_jax.drafters.steer import default_target_layers
from blockspec_jax.eval import paired, paired_drafters
from blockspec_jax.train import pools


@pytest.mark.parametrize("value,low", [(1, 1), (7, 1), (0, 0), (np.int64(3), 1), (np.int32(2), 2)])
def test_accepts_integers_at_or_above_low_and_returns_a_python_int(value, low):
  out = checks.check_int(value, "n", low)
  assert out == value and type(out) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, 2.5, "3", None, np.float64(2.0), np.bool_(True)])
def test_refuses_everything_else_by_name(value):
  with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got "):
    checks.check_int(value, "n")


def test_python_ints_only_when_numpy_is_off():
  assert checks.check_int(3, "n", numpy=False) == 3
  with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got "):
    checks.check_int(np.int64(3), "n", numpy=False)


def test_hint_low_and_error_class():
  with pytest.raises(checks_lib.UsageError, match=r"^stride must be an integer >= 0 \(0: none\), got -1$"):
    checks.check_int(-1, "stride", 0, hint=" (0: none)", error=checks_lib.UsageError)


@pytest.mark.parametrize("call,message", [
    (lambda: default_target_layers(0), "num_target_layers must be an integer >= 1, got 0"),
    (lambda: lattice.build_ngram([[1, 2, 3]], 8, order=0), "n-gram order must be an integer >= 1, got 0"),
    (lambda: paired.length_buckets([3, 4], 0), "buckets must be an integer >= 1, got 0"),
    (lambda: paired_drafters.offset_bins([0, 16], 2.0), "width must be an integer >= 1, got 2.0"),
    (lambda: pools.check_int(0, "rank"), "rank must be an integer >= 1, got 0"),
])
def test_library_functions_share_the_wording(call, message):
  with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
    call()


def test_job_settings_name_the_job_and_refuse_numpy_integers():
  assert pools.check_int(4, "rank", job="steer_job") == 4
  for value in (0, np.int64(4), True):
    with pytest.raises(checks_lib.UsageError, match=r"^steer_job\.rank must be an integer >= 1, got "):
      pools.check_int(value, "rank", job="steer_job")
