"""CausalLM's payload: its fields, their checks, and what a checked one becomes.

:func:`parse` takes a request's payload and returns :class:`Params`, or raises
:class:`mtq.BadRequest` saying what to send instead (the request fails at once,
alone). Token counts against the context are checked by the backend, which knows
the prompt's tokens. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mtq.errors import BadRequest

__all__ = ["FIELDS", "Params", "parse"]

#: every field a payload may have
FIELDS = ("prompt", "messages", "max_tokens", "temperature", "top_p", "top_k",
          "repetition_penalty", "stop", "stop_token_ids", "seed", "logprobs", "ignore_eos")
EXAMPLE = ('{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64, '
           '"temperature": 0.7}')
#: most stop strings, and stop token ids, one request may give
MAX_STOPS = 16


@dataclasses.dataclass
class Params:
    """A checked payload. ``max_tokens`` is None when the payload gave none (the
    backend fills it in from its default and the room the prompt leaves)."""

    prompt: str | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: bool = False
    ignore_eos: bool = False


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad(key: str, want: str, got: Any) -> BadRequest:
    return BadRequest(f"'{key}' must be {want}, got {got!r:.200}")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "a non-empty list of {\"role\": str, \"content\": str}", value)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadRequest(f"messages[{i}] must be {{\"role\": str, \"content\": str}}, "
                             f"got {m!r:.200}")
        if not isinstance(m["content"], str):
            raise BadRequest(f"messages[{i}]['content'] must be text (a str): this model "
                             f"takes text only, got {type(m['content']).__name__} "
                             f"{m['content']!r:.200}")
        if "name" in m and not isinstance(m["name"], str):
            raise BadRequest(f"messages[{i}]['name'] must be a str, got {m['name']!r:.200}")
        extra = sorted(map(str, set(m) - {"role", "content", "name"}))
        if extra:
            raise BadRequest(f"messages[{i}] has fields {extra} this model does not take: "
                             "send role, content and optionally name")
        out.append({k: v for k, v in m.items()})
    return out


def _stops(p: dict[str, Any]) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = p.get("stop", ())
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", f"a non-empty str or a list of at most {MAX_STOPS} of them", stop)
    ids = p.get("stop_token_ids", ())
    if not isinstance(ids, (list, tuple)) or len(ids) > MAX_STOPS or \
            not all(_int(i) and i >= 0 for i in ids):
        raise _bad("stop_token_ids", f"a list of at most {MAX_STOPS} token ids (ints >= 0)", ids)
    return tuple(stop), frozenset(ids)


def parse(p: Any) -> Params:
    """The checked payload ``p``; :class:`mtq.BadRequest` naming the field otherwise."""
    if not isinstance(p, dict):
        raise BadRequest(f"send a dict with a 'prompt' or 'messages', like {EXAMPLE}; got "
                         f"{type(p).__name__}")
    unknown = sorted(map(str, set(p) - set(FIELDS)))
    if unknown:
        raise BadRequest(f"unknown payload fields {unknown}: send only {list(FIELDS)}")
    if ("prompt" in p) == ("messages" in p):
        raise BadRequest(f"send exactly one of 'prompt' (a str) and 'messages' (a chat), like "
                         f"{EXAMPLE}")
    prompt = p.get("prompt")
    if "prompt" in p and not isinstance(prompt, str):
        raise _bad("prompt", "a str", prompt)
    messages = _messages(p["messages"]) if "messages" in p else None
    max_tokens = p.get("max_tokens")
    if max_tokens is not None and not (_int(max_tokens) and max_tokens >= 1):
        raise _bad("max_tokens", "an int >= 1 (or absent: as many as the context leaves, up "
                                 "to the worker's default)", max_tokens)
    temperature = p.get("temperature", 1.0)
    if not (_number(temperature) and temperature >= 0):
        raise _bad("temperature", "a number >= 0 (0: greedy)", temperature)
    top_p = p.get("top_p", 1.0)
    if not (_number(top_p) and 0 < top_p <= 1):
        raise _bad("top_p", "a number in (0, 1] (1: off)", top_p)
    top_k = p.get("top_k")
    if top_k is not None and not (_int(top_k) and top_k >= 0):
        raise _bad("top_k", "an int >= 1 (0 or null: off)", top_k)
    penalty = p.get("repetition_penalty", 1.0)
    if not (_number(penalty) and 0.01 <= penalty <= 100):
        raise _bad("repetition_penalty", "a number in [0.01, 100] (1: off; above 1 discourages "
                                         "repeating the prompt's and the reply's tokens)", penalty)
    seed = p.get("seed")
    if seed is not None and not _int(seed):
        raise _bad("seed", "an int (or absent: one derived from the task id)", seed)
    for key in ("logprobs", "ignore_eos"):
        if not isinstance(p.get(key, False), bool):
            raise _bad(key, "true or false", p[key])
    stop, stop_ids = _stops(p)
    return Params(prompt, messages, max_tokens, float(temperature), float(top_p),
                  top_k or None, float(penalty), stop, stop_ids, p.get("logprobs", False),
                  p.get("ignore_eos", False))
