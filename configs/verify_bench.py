"""Sizes of the verification benchmark, read by ``python -m blockspec_jax.eval.bench_verify --config
configs/verify_bench.py``. Edit, or copy to a new file, to benchmark other sizes."""

from blockspec_jax.eval.bench_verify import VerifyBenchConfig

CONFIG = VerifyBenchConfig(
    batches=(1, 8, 64),
    gammas=(4, 8),
    vocabs=(49152, 151936),  # SmolLM2, Qwen2.5
    reps=20,
)
