"""Tokenizers rebuilt from GGUF metadata, on synthetic vocabularies with exact expected ids (the real files are
compared with transformers in test_models_real.py)."""

import pytest

from blockspec_jax.models.tokenizer import tokenizer_from_gguf

# A Gemma-style SentencePiece-BPE vocabulary: control tokens, a user-defined newline, a run of two spaces stored as
# real spaces, byte-fallback tokens for "A" and "é" (0xC3 0xA9), and pieces whose file order fixes the merge ranks.
GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "  ", "▁", "a", "b", "c", "ab", "▁a",
                "abc", "bc", "<0x41>", "<0xC3>", "<0xA9>"]
GEMMA_TYPES = [3, 3, 3, 3, 3, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1, 6, 6, 6]  # "  " is user-defined, as in Gemma 3's file
ID = {t: i for i, t in enumerate(GEMMA_TOKENS)}


def gemma_metadata(**overrides):
  metadata = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
              "tokenizer.ggml.tokens": list(GEMMA_TOKENS), "tokenizer.ggml.token_type": list(GEMMA_TYPES),
              "tokenizer.ggml.scores": [0.0] * len(GEMMA_TOKENS), "tokenizer.ggml.bos_token_id": 2,
              "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
              "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
              "tokenizer.ggml.add_space_prefix": False}
  metadata.update(overrides)
  return metadata


@pytest.mark.parametrize("text,pieces", [
    ("abc", ["abc"]),             # (a, b) ranks before (b, c); then (ab, c) makes abc
    ("bc", ["bc"]),
    ("ab c", ["ab", "▁", "c"]),   # no "▁c" piece: the space stays alone
    ("a  b", ["a", "  ", "b"]),   # two spaces -> "▁▁", the respelled "  " token
    (" a", ["▁a"]),               # no prefix space is added (add_space_prefix is false)
    ("A", ["<0x41>"]),            # byte fallback
    ("é", ["<0xC3>", "<0xA9>"]),
    ("<start_of_turn>\nab", ["<start_of_turn>", "\n", "ab"]),  # control and user-defined tokens stay whole
    ("z", ["<unk>"]),             # no piece and no byte token
])
def test_gemma_sentencepiece_ids(text, pieces):
  tok = tokenizer_from_gguf(gemma_metadata())
  assert tok.encode(text) == [ID[p] for p in pieces]


def test_gemma_decode_bos_and_specials():
  tok = tokenizer_from_gguf(gemma_metadata())
  for text in ("abc", "ab c", "a  b", " a", "A", "é", "<start_of_turn>\nab"):
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("ab", add_special_tokens=True) == [ID["<bos>"], ID["ab"]]
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
  assert tok.decode([ID["<bos>"], ID["ab"]], skip_special_tokens=True) == "ab"
  assert tok.vocab_size == len(GEMMA_TOKENS)  # no token added past the vocabulary (e.g. "  " under its own spelling)
  assert tok.encode("    ") == [ID["  "], ID["  "]]


def test_tokenizer_errors():
  with pytest.raises(NotImplementedError, match="add_space_prefix"):
    tokenizer_from_gguf(gemma_metadata(**{"tokenizer.ggml.add_space_prefix": True}))
  with pytest.raises(NotImplementedError, match="tokenizer model 'llama' of a 'llama' file"):
    tokenizer_from_gguf(gemma_metadata(**{"general.architecture": "llama"}))
  with pytest.raises(ValueError, match="duplicate tokens"):
    tokenizer_from_gguf(gemma_metadata(**{"tokenizer.ggml.tokens": GEMMA_TOKENS[:-1] + ["  "]}))
  with pytest.raises(ValueError, match="token types"):
    tokenizer_from_gguf(gemma_metadata(**{"tokenizer.ggml.token_type": GEMMA_TYPES[:-1]}))
  with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.tokens'"):
    tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"})
