"""Prompt formats: what the system turn of a chat-templated prompt is (``system``: the template's default, none, a
message of one's own, or several cycled over the prompts). :func:`chat_text` renders one prompt;
``data.prompts.encode_prompts`` encodes a prompt file with them."""

from __future__ import annotations

from blockspec_jax.checks import UsageError

__all__ = ["SYSTEM_DEFAULT", "SYSTEM_NONE", "SYSTEM_OPTION_HELP", "check_system", "check_system_option",
           "system_setting", "chat_text"]

#: ``system`` values (``prompts.encode_prompts``) that are not a message: the template's own rendering of a user turn
#: (Qwen2.5's and SmolLM2's insert their default system message) and no system turn at all.
SYSTEM_DEFAULT, SYSTEM_NONE = "default", "none"
_SENTINEL = "\u2063system\u2063"  # a system message no template rewrites (invisible separators)
#: The help of a command's ``--system`` option (:func:`check_system_option`).
SYSTEM_OPTION_HELP = "each prompt's system turn: 'default' (the chat template's own), 'none', or a system message"


def check_system(system, chat: bool = True) -> tuple[str, ...]:
  """``system`` (a string, or a non-empty sequence of strings cycled over the prompts) as a tuple, checked: each is
  :data:`SYSTEM_DEFAULT`, :data:`SYSTEM_NONE` or a non-empty system message; anything but the default needs
  ``chat``."""
  formats = (system,) if isinstance(system, str) else tuple(system) if isinstance(system, (list, tuple)) else None
  if not formats or not all(isinstance(f, str) and f.strip() for f in formats):
    raise UsageError(f"system must be {SYSTEM_DEFAULT!r}, {SYSTEM_NONE!r}, a system message, or a non-empty list of "
                     f"them (cycled over the prompts), got {system!r}")
  if not chat and formats != (SYSTEM_DEFAULT,):
    raise UsageError(f"system={system!r} needs chat-templated prompts (chat=True): a plain prompt has no system turn")
  return formats


def check_system_option(system, option: str = "--system") -> tuple[str, ...]:
  """:func:`check_system` for a command's option: its UsageError names ``option`` first."""
  try:
    return check_system(system)
  except UsageError as e:
    raise UsageError(f"{option}: {e}") from None


def system_setting(system, chat: bool = True):
  """``system`` checked (:func:`check_system`) as a job's settings hold it: one format as its string, several as a
  tuple."""
  formats = check_system(system, chat)
  return formats[0] if len(formats) == 1 else formats


def chat_text(tokenizer, user: str, system: str = SYSTEM_DEFAULT) -> str:
  """The chat template's text of one user turn and the generation prompt, with ``system``:

  * :data:`SYSTEM_DEFAULT`: the template as it renders ``[user]`` (with the default system message it inserts, if any);
  * :data:`SYSTEM_NONE`: no system turn. Templates that insert a default one render ``[system, user]`` with its own
    turn first; that turn (rendered alone) is cut out, and the BOS it began with kept if the template writes one. A
    template that folds the system message into the user turn (Gemma) or has no system role renders ``[user]``, which
    then holds no system text;
  * any other string: that system message (``[system, user]``); a template without a system role refuses it.
  """
  user_turn = {"role": "user", "content": user}
  if system == SYSTEM_DEFAULT:
    return tokenizer.apply_chat_template([user_turn])
  if system != SYSTEM_NONE:
    try:
      return tokenizer.apply_chat_template([{"role": "system", "content": system}, user_turn])
    except Exception as e:  # jinja2's TemplateError from the template's raise_exception
      raise UsageError(f"this model's chat template takes no system message ({e})") from e
  try:
    alone = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}], add_generation_prompt=False)
    both = tokenizer.apply_chat_template([{"role": "system", "content": _SENTINEL}, user_turn])
  except Exception:  # no system role: the user turn alone has none
    return tokenizer.apply_chat_template([user_turn])
  if _SENTINEL not in alone or not both.startswith(alone) or _SENTINEL in both[len(alone):]:
    return tokenizer.apply_chat_template([user_turn])  # no turn of its own (folded into the user's)
  bos = tokenizer.bos_token  # kept when the template writes it (Llama 3's does, ChatML's begin with <|im_start|>)
  writes_bos = bool(bos) and "bos_token" in (tokenizer.chat_template or "") and alone.startswith(bos)
  return (bos if writes_bos else "") + both[len(alone):]
