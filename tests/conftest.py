import jax

# Shapes must match exactly in this codebase: let silent rank promotion fail loudly in tests.
jax.config.update("jax_numpy_rank_promotion", "raise")
