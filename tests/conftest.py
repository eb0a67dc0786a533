import os
import pathlib
import re

# The test run compiles thousands of small programs and runs most of them for milliseconds, so XLA's compile time is
# most of its time: LLVM at optimisation level 0 compiles them about 1.5x faster (tests/test_speculative.py 142 s ->
# 87 s on 2 cores), though unoptimised code runs the real-model end-to-end tests slower (the smoke suite 72 -> 90 s);
# the whole default run went from 19.2 to 17.6 min. Every exactness test compares programs compiled in one process
# under one setting (the layouts, the rules, sharded vs one device); the level moves float32 results by ulps
# (SmolLM2's logits by up to 2e-4) but not such comparisons (SmolLM2's stacked and unrolled logits are bit-identical
# at level 0 and at the default level alike). Figures the README reports come from the jobs at XLA's default level,
# never from here; the 8-device sharding subprocesses inherit the tests' level (helpers.fake_devices_env; the sharded
# loop script 107 -> 72 s), and the SmolLM2 main job's recorded ids run at the default level. A level of your own in
# XLA_FLAGS wins (e.g. XLA_FLAGS=--xla_backend_optimization_level=2 python -m pytest ... for the product's level).
#
# For the same reason the tests compile fusions with XLA's older elemental emitters
# (--xla_cpu_use_fusion_emitters=false): the newer MLIR fusion emitters take longer to compile the many small fusions
# of a test program (one rule x drafter loop: 7.8 -> 5.6 s; test_speculative.py, a SmolLM2 main job and SD²'s
# replayed history together 119 -> 84 s on one worker). The same exactness argument holds: each comparison is between
# programs of one process compiled under one setting. Subprocesses that must compile as the jobs do drop both
# (helpers.fake_devices_env(product_level=True) reads them from BLOCKSPEC_JAX_TEST_XLA_FLAGS).
#
# XLA aborts at start on a flag it does not know ("Unknown flag in XLA_FLAGS", exit status 1), and inside pytest that
# message goes to the captured stderr: every worker dies with no output. jaxlib 0.11 no longer has the emitter flag
# (seen with 0.11.2 on a GPU machine), so it is set only for the jaxlib releases that have it (0.10.x, the lock's).
import importlib.metadata  # noqa: E402


def _jaxlib_has_fusion_emitter_flag() -> bool:
  try:
    major, minor = (int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return False
  return (major, minor) < (0, 11)


TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_has_fusion_emitter_flag() else ())
os.environ["BLOCKSPEC_JAX_TEST_XLA_FLAGS"] = " ".join(TEST_XLA_FLAGS)
for _flag in TEST_XLA_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# On an NVIDIA GPU, float32 comparisons hold only with full-precision dots and deterministic reductions: XLA runs
# float32 matmuls in TF32 by default there (10-bit mantissas) and may sum in any order (atomics). So where a GPU
# plugin of jaxlib is installed, the tests (and every subprocess they start, through the environment) run with
# float32 dots in float32 and XLA's deterministic GPU ops. Set before JAX starts; the CPU backend never sees them.
import importlib.util  # noqa: E402

if any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
  os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
  if "xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"

import jax  # noqa: E402  (after XLA_FLAGS: the CPU backend reads them when it starts)
import pytest

from blockspec_jax import runtime  # noqa: E402

# No persistent compilation cache inside the test workers: jobs run in-process (run.main, bench_lossy) would turn it
# on for the rest of the worker. The cache's own test uses an explicit directory in subprocesses.
os.environ.setdefault("BLOCKSPEC_JAX_COMPILE_CACHE", "off")

# Shapes must match exactly in this codebase: let silent rank promotion fail loudly in tests.
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and unused) under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
  """Under ``-n`` (pytest-xdist's default ``load`` scheduling), a test file with a module- or class-scoped fixture
  runs on one worker, so the fixture is built once per run and not once per worker (the SmolLM2 distillation and SD²
  runs, the converted models: 1-2 minutes each); every other test is handed out one by one, as ``load`` does. (The
  ``xdist_group`` mark cannot do this under pytest 9: xdist puts the group into a test id pytest no longer reads.)"""
  if config.getvalue("dist") != "load":
    return None  # a --dist of the user's own
  from xdist.scheduler import LoadScopeScheduling
  root = pathlib.Path(str(config.rootpath))
  shared = re.compile(r"@pytest\.fixture\(\s*scope\s*=\s*[\"'](module|class)[\"']")
  grouped = {path.relative_to(root).as_posix() for path in (root / "tests").glob("test_*.py")
             if shared.search(path.read_text(encoding="utf-8"))}

  class FixtureGroups(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      path = nodeid.split("::", 1)[0]
      return path if path in grouped else nodeid

  return FixtureGroups(config, log)


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """A test worker compiles thousands of programs, and XLA's CPU backend holds each one's code in anonymous memory
  mappings for as long as the jit caches keep it: a full run used to grow a worker past ``vm.max_map_count``
  (65,530), and XLA then aborted or segfaulted inside whichever compilation or executable load came next (crashes
  in three different tests, each passing alone). After each test, drop the compiled programs once half of the limit
  is in use (no single test adds more than about ten thousand); later tests compile what they need again."""
  yield
  runtime.release_programs_if_near_map_limit()
