import os

import jax

# No persistent compilation cache inside the test workers: jobs run in-process (run.main, bench_lossy) would turn it
# on for the rest of the worker, and loading cached executables there has crashed a worker inside XLA
# (compilation_cache.get_executable_and_time: a SIGABRT and a SIGSEGV in two full runs, in the sprinter and traversal
# tests), even with the directory locked. The cache's own test uses an explicit directory in subprocesses.
os.environ.setdefault("BLOCKSPEC_JAX_COMPILE_CACHE", "off")

# Shapes must match exactly in this codebase: let silent rank promotion fail loudly in tests.
jax.config.update("jax_numpy_rank_promotion", "raise")
