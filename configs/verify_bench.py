"""Sizes of the verification benchmark (blockspec_jax.eval.bench_verify), as a frozen dataclass config.

    python -m blockspec_jax.eval.bench_verify --batch 1 8 64 --gamma 4 8 --vocab 49152 151936
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class VerifyBenchConfig:
  batches: tuple[int, ...] = (1, 8, 64)
  gammas: tuple[int, ...] = (4, 8)
  vocabs: tuple[int, ...] = (49152, 151936)  # SmolLM2, Qwen2.5
  reps: int = 20

  def argv(self) -> list[str]:
    return (["--batch", *map(str, self.batches), "--gamma", *map(str, self.gammas), "--vocab", *map(str, self.vocabs),
             "--reps", str(self.reps)])
