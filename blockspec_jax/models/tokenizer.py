"""Tokenizers rebuilt from GGUF metadata (no hub needed), with Jinja chat templates.

    tok = tokenizer_from_gguf(read_gguf(path).metadata)
    ids = tok.encode("def f(x):", add_special_tokens=False)   # list[int]
    text = tok.decode(ids)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])   # str, then tok.encode(prompt)

Two families (recipes that match llama.cpp and transformers id-for-id, docs/MODELS_AND_DATA.md):

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) from ``tokenizer.ggml.{tokens,merges,token_type}`` with the
pre-tokenizer named by ``tokenizer.ggml.pre``:

    smollm: pre-tokenizer Sequence[Digits(individual), ByteLevel (GPT-2 regex)]
    qwen2:  NFC normaliser; pre-tokenizer Sequence[Split(Qwen regex, isolated), ByteLevel(use_regex=False)]
    both:   ByteLevel decoder; control tokens (type 3) are special added tokens, user-defined (type 4) added tokens.

SentencePiece BPE of Gemma (``tokenizer.ggml.model == "llama"`` in a gemma / gemma2 / gemma3 file): the file has no
merges, so they are rebuilt from the vocabulary: every token that splits into two vocabulary tokens gives those
pairs, ranked by the token's position in the file (Gemma's scores do not follow its merge order; the file order
does), longer left piece first. Tokens made only of spaces are stored as real spaces and respelled with "▁" (the
normaliser turns spaces into "▁" before BPE sees them). BPE with byte fallback (``<0x..>`` tokens) and ``<unk>``; no
prefix space (``add_space_prefix`` is false); decoder "▁" → " ", byte fallback, fuse. Control tokens (type 3) are
special added tokens, user-defined ones (type 4, e.g. runs of newlines) plain added tokens.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

__all__ = ["TokenizerWrapper", "tokenizer_from_gguf", "PRE_TOKENIZERS", "GEMMA_ARCHS", "QWEN2_SPLIT_REGEX"]

# The pre-tokenisation regex of Qwen2 (HF Qwen2Tokenizer, llama.cpp "qwen2").
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "qwen2")
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")  # SentencePiece-BPE vocabularies without merges
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> set[str]:
  """The 256 characters byte-level BPE spells bytes with (GPT-2's bytes_to_unicode)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  chars, extra = set(chr(b) for b in printable), 0
  for b in range(256):
    if b not in printable:
      chars.add(chr(256 + extra))
      extra += 1
  return chars


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizerWrapper:
  """A ``tokenizers.Tokenizer`` plus the special ids and chat template from the GGUF file."""
  tokenizer: Tokenizer
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None
  add_bos: bool = False
  add_eos: bool = False
  chat_template: str | None = None

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``; with ``add_special_tokens`` BOS/EOS are added when the file asks for them."""
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if add_special_tokens:
      if self.add_bos and self.bos_id is not None:
        ids = [self.bos_id] + ids
      if self.add_eos and self.eos_id is not None:
        ids = ids + [self.eos_id]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.tokenizer.id_to_token(int(token_id))

  @property
  def bos_token(self) -> str:
    return self.id_to_token(self.bos_id) if self.bos_id is not None else ""

  @property
  def eos_token(self) -> str:
    return self.id_to_token(self.eos_id) if self.eos_id is not None else ""

  def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """Render the file's Jinja chat template (sandboxed, HF conventions: trim_blocks, lstrip_blocks,
    ``raise_exception``, ``tojson``, ``strftime_now``, ``bos_token``/``eos_token``). Extra kwargs (e.g. ``tools``)
    are passed to the template."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template (GGUF key tokenizer.chat_template is absent)")
    return _compile_template(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
        eos_token=self.eos_token, **kwargs)

  def to_json(self) -> str:
    """Serialised form (the tokenizers JSON plus the GGUF extras); ``from_json`` inverts it."""
    extras = dict(bos_id=self.bos_id, eos_id=self.eos_id, pad_id=self.pad_id, add_bos=self.add_bos,
                  add_eos=self.add_eos, chat_template=self.chat_template)
    return json.dumps({"tokenizer": self.tokenizer.to_str(), "extras": extras})

  @classmethod
  def from_json(cls, text: str) -> "TokenizerWrapper":
    data = json.loads(text)
    return cls(tokenizer=Tokenizer.from_str(data["tokenizer"]), **data["extras"])


def _compile_template(source: str):
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


def _gemma_merges(tokens: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
  """Merges implied by a SentencePiece-BPE vocabulary: for each token in file order, every split into two
  vocabulary tokens, longer left piece first."""
  merges = []
  for token in tokens:
    for cut in range(len(token) - 1, 0, -1):
      left, right = token[:cut], token[cut:]
      if left in vocab and right in vocab:
        merges.append((left, right))
  return merges


def _gemma_tokenizer(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
  if metadata.get("tokenizer.ggml.add_space_prefix", False):
    raise NotImplementedError("SentencePiece tokenizers with add_space_prefix are not supported (Gemma has none)")
  tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError("GGUF vocabulary has duplicate tokens (after spelling space runs with U+2581)")
  unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
  unk = tokens[int(unk_id)] if unk_id is not None else "<unk>"
  if unk not in vocab:
    raise ValueError(f"GGUF vocabulary lacks the unknown token {unk!r}")
  tok = Tokenizer(models.BPE(vocab=vocab, merges=_gemma_merges(tokens, vocab), unk_token=unk, fuse_unk=True,
                             byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
  return tok


def tokenizer_from_gguf(metadata: dict[str, Any]) -> TokenizerWrapper:
  """Build the tokenizer a GGUF's ``tokenizer.*`` metadata describes: byte-level BPE (smollm, qwen2
  pre-tokenizers) or Gemma's SentencePiece BPE (see the module docstring).

  Raises NotImplementedError for other tokenizer models / pre-tokenizers, ValueError for missing keys.
  """
  model = metadata.get("tokenizer.ggml.model")
  pre = metadata.get("tokenizer.ggml.pre")
  arch = metadata.get("general.architecture")
  if "tokenizer.ggml.tokens" not in metadata:
    raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens'")
  tokens = list(metadata["tokenizer.ggml.tokens"])
  token_types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
  if len(token_types) != len(tokens):
    raise ValueError(f"GGUF metadata has {len(token_types)} token types for {len(tokens)} tokens")
  if model == "llama" and arch in GEMMA_ARCHS:
    tok = _gemma_tokenizer(tokens, metadata)
    special = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_types)
               if kind == _CONTROL]
    # User-defined runs of spaces are in the vocabulary only under their "▁" spelling, which BPE already produces;
    # adding the space spelling would invent new ids past the model's vocabulary.
    added = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, token_types)
             if kind == _USER_DEFINED and tok.token_to_id(t) is not None]
    return _wrap(tok, special, added, metadata)
  if model != "gpt2":
    raise NotImplementedError(f"tokenizer model {model!r} of a {arch!r} file is not supported (byte-level BPE "
                              f"'gpt2', or SentencePiece 'llama' for {GEMMA_ARCHS})")
  if pre not in PRE_TOKENIZERS:
    raise NotImplementedError(f"pre-tokenizer {pre!r} is not supported; supported: {PRE_TOKENIZERS}")
  if "tokenizer.ggml.merges" not in metadata:
    raise ValueError("GGUF metadata lacks 'tokenizer.ggml.merges'")
  merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError("GGUF vocabulary has duplicate tokens")

  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                             fuse_unk=False, byte_fallback=False))
  if pre == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:  # qwen2
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()

  # A "control" token spelled outside the byte alphabet is a mislabel (it could never come out of BPE); skip it.
  alphabet = _byte_alphabet()
  special = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, token_types)
             if kind == _CONTROL and set(t) <= alphabet]
  added = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, token_types)
           if kind == _USER_DEFINED]
  return _wrap(tok, special, added, metadata)


def _wrap(tok: Tokenizer, special: list[AddedToken], added: list[AddedToken], metadata: dict[str, Any]
          ) -> TokenizerWrapper:
  """Add the control / user-defined tokens and wrap with the file's special ids and chat template."""
  if special:
    tok.add_special_tokens(special)
  if added:
    tok.add_tokens(added)

  def token_id(key):
    value = metadata.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None else None

  return TokenizerWrapper(
      tokenizer=tok, bos_id=token_id("bos_token_id"), eos_id=token_id("eos_token_id"),
      pad_id=token_id("padding_token_id"), add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
      add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
      chat_template=metadata.get("tokenizer.chat_template"))
