"""The value codec of the sandbox's channel (:mod:`blockspec_jax.eval.sandbox`): tagged JSON, never pickle, never
eval; exactly the types listed in :func:`encode`, with depth and size limits. These definitions also run inside the
container (:mod:`blockspec_jax.eval.sandbox_inside` sends their source along with the driver), so they use nothing
but the standard library and each other."""

from __future__ import annotations

import json

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "CodecError", "encode", "decode"]

MAX_DEPTH = 100  # nesting of one value
MAX_ITEMS = 1_000_000  # values (containers and scalars) in one message

# ----------------------------------------------------------------------------------------------------------------
# The value codec. These definitions also run inside the container: their source is sent along with the driver
# (_program_source), so they use nothing but the standard library and each other.


class CodecError(ValueError):
  """A value that cannot cross the sandbox channel: a type outside the codec, too deep, too large, or malformed."""


def _to_json(value, max_depth, max_items):
  """``value`` as a JSON-ready tree: None, bools, ints of 64 bits, finite floats and strs as themselves, everything
  else as ``[tag, payload]`` (tags: int, float, bytes, list, tuple, set, frozenset, dict). CodecError otherwise."""
  import base64
  import math
  count = [0]

  def enc(v, depth):
    if depth > max_depth:
      raise CodecError(f"value nested deeper than {max_depth} levels")
    count[0] += 1
    if count[0] > max_items:
      raise CodecError(f"value has more than {max_items} items")
    kind = type(v)
    if v is None or kind is bool or kind is str:
      return v
    if kind is int:
      return v if -2 ** 63 <= v < 2 ** 63 else ["int", format(v, "x")]
    if kind is float:
      return v if math.isfinite(v) else ["float", repr(v)]
    if kind is bytes:
      return ["bytes", base64.b64encode(v).decode("ascii")]
    if kind in (list, tuple, set, frozenset):
      return [kind.__name__, [enc(x, depth + 1) for x in v]]
    if kind is dict:
      return ["dict", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]]
    raise CodecError(f"cannot encode a value of type {kind.__module__}.{kind.__qualname__}"
                     if kind.__module__ != "builtins" else f"cannot encode a value of type {kind.__qualname__}")

  return enc(value, 0)


def _from_json(tree, max_depth, max_items):
  """The value of a tree made by :func:`_to_json` (only plain built-in types come out). CodecError when malformed."""
  import base64
  import binascii
  count = [0]

  def dec(o, depth):
    if depth > max_depth:
      raise CodecError(f"value nested deeper than {max_depth} levels")
    count[0] += 1
    if count[0] > max_items:
      raise CodecError(f"value has more than {max_items} items")
    kind = type(o)
    if o is None or kind in (bool, int, float, str):
      return o
    if kind is not list or len(o) != 2 or type(o[0]) is not str:
      raise CodecError(f"malformed value: expected a scalar or [tag, payload], got {kind.__name__}")
    tag, payload = o
    if tag == "int" and type(payload) is str and payload.lstrip("-").isalnum():
      try:
        return int(payload, 16)
      except ValueError:
        pass
    elif tag == "float" and payload in ("nan", "inf", "-inf"):
      return float(payload)
    elif tag == "bytes" and type(payload) is str:
      try:
        return base64.b64decode(payload.encode("ascii"), validate=True)
      except (binascii.Error, UnicodeEncodeError):
        pass
    elif tag in ("list", "tuple", "set", "frozenset") and type(payload) is list:
      items = [dec(x, depth + 1) for x in payload]
      if tag == "list":
        return items
      if tag == "tuple":
        return tuple(items)
      try:
        return set(items) if tag == "set" else frozenset(items)
      except TypeError as e:
        raise CodecError(f"malformed {tag}: {e}") from None
    elif tag == "dict" and type(payload) is list:
      out = {}
      for pair in payload:
        if type(pair) is not list or len(pair) != 2:
          raise CodecError("malformed dict: expected [key, value] pairs")
        key = dec(pair[0], depth + 1)
        try:
          out[key] = dec(pair[1], depth + 1)
        except TypeError as e:
          raise CodecError(f"malformed dict: {e}") from None
      return out
    raise CodecError(f"malformed value with tag {tag[:40]!r}")

  return dec(tree, 0)


def _json_loads(data):
  """Strict JSON of a protocol message (no NaN / Infinity literals; numbers past 4300 digits refused). CodecError."""
  import json

  def constant(name):
    raise CodecError(f"malformed JSON: {name} is not allowed")

  try:
    return json.loads(data, parse_constant=constant)
  except (ValueError, RecursionError, UnicodeDecodeError) as e:
    if isinstance(e, CodecError):
      raise
    raise CodecError(f"malformed JSON: {str(e)[:100]}") from None


def encode(value, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> bytes:
  """``value`` as the channel's UTF-8 JSON bytes (tagged JSON; module docstring). CodecError naming the type of a
  value outside the codec (a subclass of a supported type included), or the limit a value exceeds."""
  return json.dumps(_to_json(value, max_depth, max_items), separators=(",", ":")).encode()


def decode(data: bytes | str, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS):
  """The value :func:`encode` made ``data`` from. CodecError for anything malformed (including JSON objects, NaN
  literals, unknown tags, unhashable set members or dict keys) or over the limits."""
  return _from_json(_json_loads(data), max_depth, max_items)
