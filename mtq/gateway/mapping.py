"""OpenAI request bodies to mtq payloads, and task results to OpenAI answers.

A request is checked here, before anything is submitted: a field the model's
payload cannot honour is a :class:`GatewayError` (400, OpenAI's error shape) naming
the field, never silently dropped. Two payload dialects (:data:`DIALECTS`):

* ``hf``: the payload of ``hf:CausalLM`` (:mod:`mtq.backends.hf.payload`): ``prompt``
  or ``messages`` as given, ``max_tokens``, ``temperature``, ``top_p``, ``stop``,
  ``seed``, ``logprobs``; the result carries ``usage``.
* ``reference``: the payload of the reference generator ``mtq.reference`` TinyGPT:
  ``prompt`` only (chat messages are rendered as ``role: content`` lines ending with
  ``assistant:``), ``max_tokens``, ``temperature``, ``seed``; ``top_p`` below 1,
  ``stop`` and ``logprobs`` are refused.

This module imports neither Starlette nor Redis.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from mtq.errors import MtqError

__all__ = ["DIALECTS", "GatewayError", "Generation", "chat_payload", "completion_payload",
           "embedding_inputs"]

DIALECTS = ("hf", "reference")
#: the most inputs one embeddings request may give
MAX_EMBED_INPUTS = 256


@dataclass
class GatewayError(MtqError):
    """A request the gateway answers with an error, in OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}`` with ``status`` and, for 429 and 503, a ``Retry-After`` header."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value"
        ) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Generation:
    """A checked chat or text completion request."""

    kind: str  # "chat" | "text"
    model: str
    payload: dict[str, Any]
    stream: bool
    include_usage: bool
    user: str | None
    #: the tokens it may cost (admission against a key's tokens per minute)
    budget: int
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


# the fields each endpoint takes; a field not here is refused
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n",
           "stop", "seed", "user", "frequency_penalty", "presence_penalty", "logit_bias"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                         "tools", "tool_choice", "functions", "function_call",
                         "response_format", "parallel_tool_calls"}
TEXT_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logprobs"}
#: fields refused unless absent or null (what mtq's models cannot do)
_UNSUPPORTED = {"tools": "tool calls", "tool_choice": "tool calls", "functions": "function calls",
                "function_call": "function calls", "response_format": "structured output",
                "logit_bias": "logit bias", "suffix": "suffixes",
                "parallel_tool_calls": "tool calls"}
#: the default max_tokens budget counted for admission when a request gives none
DEFAULT_BUDGET = 256


def _check_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}",
                  code="invalid_type")
    return body


def _common(body: dict[str, Any], allowed: set[str], dialect: str) -> dict[str, Any]:
    """The sampling fields shared by both endpoints, as payload fields."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0],
                  "unknown_parameter")
    for name, what in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad(f"'{name}' is not supported: mtq's models do not do {what}", name,
                      "unsupported_parameter")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise bad("'n' must be 1: one completion per request (send more requests)", "n",
                  "unsupported_value")
    best_of = body.get("best_of", 1)
    if best_of is not None and best_of != 1:
        raise bad("'best_of' must be 1", "best_of", "unsupported_value")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo", "unsupported_value")
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name)
        if v is not None and not (_number(v) and v == 0):
            raise bad(f"'{name}' must be 0 or absent: mtq's models have no {name}", name,
                      "unsupported_value")
    out: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not (_int(max_tokens) and max_tokens >= 1):
            raise bad(f"'max_tokens' must be an integer >= 1, got {max_tokens!r:.100}",
                      "max_tokens", "invalid_type")
        out["max_tokens"] = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not (_number(temperature) and 0 <= temperature <= 2):
            raise bad(f"'temperature' must be a number in [0, 2], got {temperature!r:.100}",
                      "temperature")
        out["temperature"] = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not (_number(top_p) and 0 < top_p <= 1):
            raise bad(f"'top_p' must be a number in (0, 1], got {top_p!r:.100}", "top_p")
        if top_p != 1:
            if dialect == "reference":
                raise bad("'top_p' below 1 is not supported by this model (the reference "
                          "generator samples with temperature only)", "top_p",
                          "unsupported_value")
            out["top_p"] = float(top_p)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and 0 < len(stops) <= 4
                and all(isinstance(s, str) and s for s in stops)):
            raise bad("'stop' must be a non-empty string or a list of 1 to 4 of them",
                      "stop", "invalid_type")
        if dialect == "reference":
            raise bad("'stop' is not supported by this model (the reference generator "
                      "stops at its end-of-text token or max_tokens)", "stop",
                      "unsupported_value")
        out["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if not _int(seed):
            raise bad(f"'seed' must be an integer, got {seed!r:.100}", "seed", "invalid_type")
        out["seed"] = seed
    return out


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream", "invalid_type")
    opts = body.get("stream_options")
    include = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with 'stream': true",
                      "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or \
                not isinstance(opts.get("include_usage", False), bool):
            raise bad("'stream_options' must be {\"include_usage\": true|false}",
                      "stream_options", "invalid_type")
        include = bool(opts.get("include_usage", False))
    return bool(stream), include


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and 0 < len(user) <= 256):
        raise bad("'user' must be a string of 1 to 256 characters", "user", "invalid_type")
    return user


def model_name(body: Any) -> str:
    """The request's ``model`` (400 if missing or not a string)."""
    body = _check_object(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: a model name from GET /v1/models", "model",
                  "missing_required_parameter" if model is None else "invalid_type")
    return model


def render_chat(messages: list[dict[str, str]]) -> str:
    """A chat as one prompt for a model without a chat template (the reference
    generator): one ``role: content`` line per message, then ``assistant:``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {\"role\", \"content\"}",
                  "messages", "invalid_type")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'",
                      f"messages[{i}]", "invalid_type")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text ones only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad(f"messages[{i}].content: only text parts are supported",
                              f"messages[{i}].content", "unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content",
                      "invalid_type")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}] has fields {extra} that are not supported "
                      "(tool calls, audio, refusals)", f"messages[{i}]",
                      "unsupported_parameter")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _budget(payload: dict[str, Any], text: str) -> int:
    """The tokens a request may cost: its prompt (about 4 characters a token) and its
    max_tokens."""
    return len(text) // 4 + 1 + int(payload.get("max_tokens") or DEFAULT_BUDGET)


def chat_payload(body: Any, dialect: str) -> Generation:
    """``POST /v1/chat/completions``'s body as the payload of ``dialect``."""
    body = _check_object(body)
    model = model_name(body)
    payload = _common(body, CHAT_FIELDS, dialect)
    messages = _messages(body.get("messages"))
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("'logprobs' must be true or false", "logprobs", "invalid_type")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("'top_logprobs' is not supported (only each chosen token's logprob)",
                  "top_logprobs", "unsupported_value")
    stream, include = _stream_flags(body)
    if logprobs:
        if dialect == "reference":
            raise bad("'logprobs' is not supported by this model", "logprobs",
                      "unsupported_value")
        if stream:
            raise bad("'logprobs' is not supported with 'stream': true", "logprobs",
                      "unsupported_value")
        payload["logprobs"] = True
    text = "".join(m["content"] for m in messages)
    if dialect == "reference":
        payload["prompt"] = render_chat(messages)
    else:
        payload["messages"] = messages
    return Generation("chat", model, payload, stream, include, _user(body),
                      _budget(payload, text), bool(logprobs))


def completion_payload(body: Any, dialect: str) -> Generation:
    """``POST /v1/completions``'s body as the payload of ``dialect``."""
    body = _check_object(body)
    model = model_name(body)
    payload = _common(body, TEXT_FIELDS, dialect)
    if body.get("logprobs") is not None:
        raise bad("'logprobs' is not supported on /v1/completions", "logprobs",
                  "unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string (one prompt per request; token arrays are "
                  "not supported)", "prompt", "invalid_type")
    payload["prompt"] = prompt
    stream, include = _stream_flags(body)
    return Generation("text", model, payload, stream, include, _user(body),
                      _budget(payload, prompt))


def embedding_inputs(body: Any) -> tuple[str, list[str], str | None, bool]:
    """``POST /v1/embeddings``'s body: (model, the texts, user, base64: the vectors
    as base64 of little-endian float32, ``encoding_format`` ``base64``, which the
    SDKs ask for). ``dimensions`` refused."""
    body = _check_object(body)
    model = model_name(body)
    unknown = sorted(set(body) - {"model", "input", "encoding_format", "user", "dimensions"})
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0],
                  "unknown_parameter")
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise bad("'encoding_format' must be \"float\" or \"base64\"", "encoding_format",
                  "unsupported_value")
    if body.get("dimensions") is not None:
        raise bad("'dimensions' is not supported: the model's own size is returned",
                  "dimensions", "unsupported_value")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not (isinstance(texts, list) and 0 < len(texts) <= MAX_EMBED_INPUTS
            and all(isinstance(t, str) for t in texts)):
        raise bad(f"'input' must be a string or a list of 1 to {MAX_EMBED_INPUTS} strings "
                  "(token arrays are not supported)", "input", "invalid_type")
    return model, texts, _user(body), body.get("encoding_format") == "base64"


def _b64(vec: list[float]) -> str:
    import array
    import base64
    import sys

    packed = array.array("f", vec)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


# -- answers -----------------------------------------------------------------------------
def usage(result: Any, completion_tokens: int | None = None) -> dict[str, int]:
    """OpenAI's usage of a generation's result (``hf``: its ``usage``; ``reference``:
    ``prompt_tokens`` and its ``tokens``)."""
    prompt = completion = 0
    if isinstance(result, dict):
        u = result.get("usage")
        if isinstance(u, dict):
            prompt = int(u.get("prompt_tokens") or 0)
            completion = int(u.get("completion_tokens") or 0)
        else:
            prompt = int(result.get("prompt_tokens") or 0)
            tokens = result.get("tokens")
            completion = len(tokens) if isinstance(tokens, list) else 0
    if completion_tokens is not None and not completion:
        completion = completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def finish_reason(result: Any) -> str:
    reason = result.get("finish_reason") if isinstance(result, dict) else None
    return reason if reason in ("stop", "length") else "stop"


def answer(gen: Generation, task_id: str, result: Any) -> dict[str, Any]:
    """The non-streamed answer of a finished generation."""
    text = str(result.get("text", "")) if isinstance(result, dict) else str(result)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result)}
    if gen.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        if gen.logprobs and isinstance(result, dict) and isinstance(result.get("logprobs"), list):
            choice["logprobs"] = {"content": [
                {"token": "", "logprob": float(v), "bytes": None, "top_logprobs": []}
                for v in result["logprobs"]]}
        obj = "chat.completion"
    else:
        choice["text"] = text
        choice["logprobs"] = None
        obj = "text_completion"
    return {"id": completion_id(gen, task_id), "object": obj, "created": gen.created,
            "model": gen.model, "choices": [choice], "usage": usage(result),
            "system_fingerprint": None}


def completion_id(gen: Generation, task_id: str) -> str:
    return ("chatcmpl-" if gen.kind == "chat" else "cmpl-") + task_id


def chunk(gen: Generation, task_id: str, *, text: str | None = None, role: bool = False,
          finish: str | None = None, usage_of: dict[str, int] | None = None
          ) -> dict[str, Any]:
    """One streamed chunk: a piece of text (``role``: the chat's first, with the
    assistant's role), the last one (``finish``), or the usage one (no choices)."""
    body: dict[str, Any] = {
        "id": completion_id(gen, task_id),
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": gen.created, "model": gen.model, "system_fingerprint": None}
    if usage_of is not None:
        body["choices"] = []
        body["usage"] = usage_of
        return body
    if gen.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body["choices"] = [choice]
    if gen.include_usage:
        body["usage"] = None
    return body


def embeddings_answer(model: str, results: list[Any], texts: list[str],
                      base64: bool = False) -> dict[str, Any]:
    """The answer of ``/v1/embeddings``: a vector per input, usage from the results'
    ``tokens`` (``hf:Embedder``), else one token per UTF-8 byte plus one (the
    reference embedder's byte tokens)."""
    data = []
    tokens = 0
    for i, (res, text) in enumerate(zip(results, texts)):
        if isinstance(res, dict):
            vec, n = res.get("embedding"), res.get("tokens")
        else:
            vec, n = res, None
        if not isinstance(vec, list):
            raise GatewayError(500, f"the model's result for input {i} is not a vector: "
                               "is this queue an embedder?", "server_error", None,
                               "bad_result")
        tokens += n if isinstance(n, int) else len(text.encode()) + 1
        data.append({"object": "embedding", "index": i,
                     "embedding": _b64(vec) if base64 else vec})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
