"""Target and drafter language models (Flax linen) with an explicit, caller-written KV cache."""

from blockspec_jax.models.decoder import (KVCache, Decoder, DecoderConfig, apply_rotary, causal_mask, init_cache)
from blockspec_jax.models.gguf_convert import config_from_gguf, convert, read_gguf
from blockspec_jax.models.hub import LoadedModel, LocalSource, check_model_name, load_model
from blockspec_jax.models.registry import (MODELS, CacheDirError, FetchError, ModelSpec, default_cache_dir,
                                          fetch_gguf)
from blockspec_jax.models.tokenizer import TokenizerWrapper, tokenizer_from_gguf

__all__ = ["KVCache", "Decoder", "DecoderConfig", "apply_rotary", "causal_mask", "init_cache",
           "config_from_gguf", "convert", "read_gguf", "LoadedModel", "LocalSource", "check_model_name", "load_model",
           "MODELS", "CacheDirError", "FetchError",
           "ModelSpec", "default_cache_dir", "fetch_gguf", "TokenizerWrapper", "tokenizer_from_gguf"]
