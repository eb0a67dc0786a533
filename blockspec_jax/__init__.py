"""blockspec_jax: speculative decoding with block verification in JAX/Flax."""

__version__ = "0.1.0"
