"""The OpenAI request mapping of the gateway (mtq.gateway.mapping), without a server:
what each dialect's payload becomes, what is refused, the answers' shapes. The
gateway under uvicorn with the openai SDK: tests/integration/test_gateway.py."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest

from mtq.cli.serve import is_loopback
from mtq.gateway.mapping import (
    GatewayError,
    Generation,
    answer,
    chat_payload,
    chunk,
    completion_payload,
    embedding_inputs,
    embeddings_answer,
)

CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}]}


def test_chat_hf_keeps_messages_and_sampling() -> None:
    gen = chat_payload({**CHAT, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                        "stop": "x", "seed": 3, "user": "ann"}, "hf")
    assert gen.payload == {"messages": CHAT["messages"], "max_tokens": 5, "temperature": 0.5,
                           "top_p": 0.9, "stop": ["x"], "seed": 3}
    assert gen.user == "ann" and not gen.stream and gen.budget >= 5


def test_chat_reference_renders_a_prompt() -> None:
    gen = chat_payload({**CHAT, "max_completion_tokens": 4, "top_p": 1}, "reference")
    assert gen.payload == {"prompt": "system: be brief\nuser: hi\nassistant:", "max_tokens": 4}


def test_text_parts_are_joined() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    assert chat_payload({"model": "m", "messages": msgs}, "hf").payload["messages"] == \
        [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 3}, "n"), ({"tools": [{"type": "function"}]}, "tools"), ({"bogus": 1}, "bogus"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"stop": ["a"] * 5}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True, "stream": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"frequency_penalty": 1}, "frequency_penalty"), ({"seed": 1.5}, "seed"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_chat_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        chat_payload({**CHAT, **extra}, "hf")
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("extra", [{"stop": "x"}, {"top_p": 0.5}, {"logprobs": True}])
def test_reference_refuses_what_it_cannot_do(extra: dict[str, Any]) -> None:
    with pytest.raises(GatewayError, match="not supported"):
        chat_payload({**CHAT, **extra}, "reference")


@pytest.mark.parametrize("body", [[1], {"messages": []}, {"model": 3, "messages": []},
                                  {"model": "m", "messages": [{"role": "user"}]},
                                  {"model": "m", "messages": [{"role": "user", "content": "x",
                                                               "tool_calls": []}]}])
def test_malformed_chat_bodies(body: Any) -> None:
    with pytest.raises(GatewayError) as info:
        chat_payload(body, "hf")
    assert info.value.status == 400
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompt_forms() -> None:
    assert completion_payload({"model": "m", "prompt": ["one"]}, "hf").payload == \
        {"prompt": "one"}
    for prompt in (["a", "b"], [1, 2], None):
        with pytest.raises(GatewayError):
            completion_payload({"model": "m", "prompt": prompt}, "hf")
    with pytest.raises(GatewayError, match="echo"):
        completion_payload({"model": "m", "prompt": "x", "echo": True}, "hf")


def test_embedding_inputs_and_base64() -> None:
    assert embedding_inputs({"model": "e", "input": "x"}) == ("e", ["x"], None, False)
    assert embedding_inputs({"model": "e", "input": ["x"], "encoding_format": "base64"})[3]
    for bad in ({"input": [[1, 2]]}, {"input": []}, {"input": "x", "dimensions": 8}):
        with pytest.raises(GatewayError):
            embedding_inputs({"model": "e", **bad})
    out = embeddings_answer("e", [[0.5, -1.0], {"embedding": [1.0, 0.0], "tokens": 7}],
                            ["ab", "c"], base64=True)
    assert struct.unpack("<2f", base64.b64decode(out["data"][0]["embedding"])) == (0.5, -1.0)
    assert out["usage"] == {"prompt_tokens": 3 + 7, "total_tokens": 10}


def test_answers_and_chunks_in_openai_shape() -> None:
    gen = chat_payload({**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                       "hf")
    res = {"text": "yo", "finish_reason": "length",
           "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    full = answer(gen, "t1", res)
    assert full["id"] == "chatcmpl-t1" and full["choices"][0]["message"]["content"] == "yo"
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    first = chunk(gen, "t1", text="", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # include_usage: null on every chunk but the last
    last = chunk(gen, "t1", usage_of={"prompt_tokens": 1, "completion_tokens": 1,
                                      "total_tokens": 2})
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 2
    ref = answer(completion_payload({"model": "m", "prompt": "p"}, "reference"), "t2",
                 {"text": "q", "tokens": [1, 2, 3], "prompt_tokens": 2,
                  "finish_reason": "stop"})
    assert ref["object"] == "text_completion" and ref["choices"][0]["text"] == "q"
    assert ref["usage"]["completion_tokens"] == 3


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_chunk_template_gives_the_bytes_of_its_chunk(kind: str,
                                                               include_usage: bool) -> None:
    from json.encoder import encode_basestring

    from mtq.gateway.streaming import data, template

    gen = Generation(kind, 'm"odel\u00e9', {}, True, include_usage, None, 10)
    head, tail = template(gen, "0123abc")
    for piece in ["hi", 'q"uote\\', "new\nline\t", "\u00e9\u4e2d\U0001f600", "\x00\x01\x7f",
                  "</script>", "\u2028"]:
        got = head + encode_basestring(piece).encode() + tail
        assert got == data(chunk(gen, "0123abc", text=piece)), piece
        assert json.loads(got[len(b"data: "):]) == chunk(gen, "0123abc", text=piece)
