import os

import jax
import pytest

from blockspec_jax import jobs

# No persistent compilation cache inside the test workers: jobs run in-process (run.main, bench_lossy) would turn it
# on for the rest of the worker. The cache's own test uses an explicit directory in subprocesses.
os.environ.setdefault("BLOCKSPEC_JAX_COMPILE_CACHE", "off")

# Shapes must match exactly in this codebase: let silent rank promotion fail loudly in tests.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """A test worker compiles thousands of programs, and XLA's CPU backend holds each one's code in anonymous memory
  mappings for as long as the jit caches keep it: a full run used to grow a worker past ``vm.max_map_count``
  (65,530), and XLA then aborted or segfaulted inside whichever compilation or executable load came next (crashes
  in three different tests, each passing alone). After each test, drop the compiled programs once half of the limit
  is in use (no single test adds more than about ten thousand); later tests compile what they need again."""
  yield
  jobs.release_programs_if_near_map_limit()
