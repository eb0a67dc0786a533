"""Target and drafter language models (Flax linen) with an explicit, caller-written KV cache."""

from blockspec_jax.models.decoder import (KVCache, Decoder, DecoderConfig, apply_rotary, causal_mask, init_cache)

__all__ = ["KVCache", "Decoder", "DecoderConfig", "apply_rotary", "causal_mask", "init_cache"]
