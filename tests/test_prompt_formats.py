"""Prompt formats (``data.formats.chat_text`` / ``data.prompts.encode_prompts(system=...)``): the template's default
system message, no system turn, or a system message of one's own, on four kinds of chat template (ChatML with a
default system turn as Qwen2.5's and SmolLM2's, a Llama-3-like one that writes BOS, a Gemma-like one that folds the
system message into the user turn, one with no system role) and on SmolLM2's own; formats cycled over prompts; bad
values refused by name."""

import types

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from blockspec_jax.checks import UsageError
from blockspec_jax.data import formats
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import tokenizer as tokenizer_lib

CHATML_WITH_DEFAULT = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ m['role'] }}\n{{ (first if loop.first else '') + m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NO_SYSTEM_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def _tokenizer(template):
  vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
  return tokenizer_lib.TokenizerWrapper(Tokenizer(WordLevel(vocab, unk_token="[UNK]")), bos_id=0, eos_id=1,
                                        pad_id=None, chat_template=template)


@pytest.mark.parametrize("template, default, none, own", [
    (CHATML_WITH_DEFAULT,
     "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n",
     "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"),
    (LLAMA3_LIKE,
     "<s><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "<s><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
     "\n\nHi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    (GEMMA_LIKE,
     "<s><start_of_turn>user\nHi?<end_of_turn>\n<start_of_turn>model\n",
     "<s><start_of_turn>user\nHi?<end_of_turn>\n<start_of_turn>model\n",
     "<s><start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n<start_of_turn>model\n"),
], ids=["chatml_default_system", "llama3_bos", "gemma_folded"])
def test_the_three_formats_on_each_kind_of_template(template, default, none, own):
  tok = _tokenizer(template)
  assert formats.chat_text(tok, "Hi?") == default
  assert formats.chat_text(tok, "Hi?", formats.SYSTEM_NONE) == none
  assert formats.chat_text(tok, "Hi?", "Be brief.") == own


def test_a_template_without_a_system_role():
  tok = _tokenizer(NO_SYSTEM_ROLE)
  assert formats.chat_text(tok, "Hi?", "none") == formats.chat_text(tok, "Hi?") == "[user] Hi?\n[assistant] "
  with pytest.raises(UsageError, match="takes no system message .*no system role here"):
    formats.chat_text(tok, "Hi?", "Be brief.")


def test_smollm2_without_its_default_system_message(smol_tokenizer):
  default, none, own = (formats.chat_text(smol_tokenizer, "Hi?", s) for s in ("default", "none", "Be brief."))
  assert "You are a helpful AI assistant named SmolLM" in default
  assert none == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n" and default.endswith(none)
  assert own == "<|im_start|>system\nBe brief.<|im_end|>\n" + none


@pytest.fixture(scope="module")
def smol_tokenizer():
  from blockspec_jax.models import hub
  return hub.load_model("smollm2-135m", progress=False).tokenizer


class _CharTokenizer(tokenizer_lib.TokenizerWrapper):
  """A wrapper whose ids are the text's code points (the word-level model above maps every text to UNK)."""

  def encode(self, text, add_special_tokens=False):
    return [ord(c) for c in text]


def test_formats_cycle_over_the_prompts_and_bad_values_are_refused():
  base = _tokenizer(CHATML_WITH_DEFAULT)
  model = types.SimpleNamespace(tokenizer=_CharTokenizer(base.tokenizer, 0, 1, None, chat_template=base.chat_template))
  rows = [{"id": f"r{i}", "text": "Hi?"} for i in range(5)]
  cycled = prompts_lib.encode_prompts(model, rows, system=("default", "none"))
  default, none = (prompts_lib.encode_prompts(model, rows[:1], system=s)[0] for s in ("default", "none"))
  assert cycled == [default, none, default, none, default]
  assert "".join(map(chr, none)) == formats.chat_text(model.tokenizer, "Hi?", "none") and default != none
  assert prompts_lib.encode_prompts(model, rows[:2]) == [default, default]  # the default format, as before
  for bad in ("", " ", (), ("none", ""), 3, None):
    with pytest.raises(UsageError, match="system must be 'default', 'none', a system message"):
      prompts_lib.encode_prompts(model, rows, system=bad)
  with pytest.raises(UsageError, match="needs chat-templated prompts"):
    prompts_lib.encode_prompts(model, rows, chat=False, system="none")
  plain = types.SimpleNamespace(tokenizer=_CharTokenizer(base.tokenizer, 0, 1, None))
  with pytest.raises(UsageError, match="no chat template"):
    prompts_lib.encode_prompts(plain, rows, system="none")


def test_the_jobs_take_the_format_and_check_it_before_a_model_loads(monkeypatch):
  """Every evaluation job's data settings and every training job's settings carry ``system`` (one format becomes a
  string, several a tuple), a bad one is a UsageError naming the setting, and the main job encodes with it."""
  from blockspec_jax import run
  from blockspec_jax.eval import bench_lossy, suite
  from blockspec_jax.train.distill_job import DistillSettings
  from blockspec_jax.train.steer_job import SteerSettings
  for cls in (run.RunSettings, suite.SuiteSettings, bench_lossy.LossySettings):
    data = next(g for g in cls(system=["none", "Be brief."]).groups() if hasattr(g, "system"))
    assert data.system == ("none", "Be brief.")
    with pytest.raises(UsageError, match="system must be"):
      cls(system="")
  from blockspec_jax.train.recipe import DrafterRecipe
  assert DistillSettings(target="smollm2-135m", drafter=DrafterRecipe("smollm2-135m"), system=["none"]).system == "none"
  with pytest.raises(UsageError, match=r"steer_job.system: system=.* needs chat-templated prompts"):
    SteerSettings(target="smollm2-135m", drafter="smollm2-135m", system="none", chat=False)
  seen = []

  class Encoded(Exception):
    pass

  def encode(model, rows, chat, system):  # stops the job once it has encoded
    seen.append(system)
    raise Encoded

  monkeypatch.setattr(prompts_lib, "encode_prompts", encode)
  with pytest.raises(Encoded):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", methods=("autoregressive",), num_prompts=1,
                system="none", output_json=None, show_text=False)
  assert seen == ["none"]
