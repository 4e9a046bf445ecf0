"""Anthropic's Messages API through the real server with SmolLM2 (135M) and the repo's tool template, driven by the
official anthropic SDK: a message whose greedy text equals chat completions' for the same conversation, the same
message streamed and read with the SDK's stream helpers, count_tokens equal to the chat prompt's length, and a tool
use round trip with tool_result."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from anthropic import Anthropic

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess

SYSTEM = "Answer in one sentence."
QUESTION = "What is the capital of France?"
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {"name": "get_weather", "description": "Today's weather in a city.", "input_schema": WEATHER_ARGS}


def anthropic_client(server: ServerProcess) -> Anthropic:
    return Anthropic(base_url=server.root_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_a_message_streamed_or_not_says_what_chat_says(smollm2_server: ServerProcess) -> None:
    client = anthropic_client(smollm2_server)
    user: Any = [{"role": "user", "content": QUESTION}]
    # Current SDKs no longer name the sampling fields: they go as extra body fields.
    greedy: Any = {"temperature": 0}
    request: Any = {"model": "test-model", "max_tokens": 30, "system": SYSTEM, "messages": user, "extra_body": greedy}
    message = client.messages.create(**request)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 30
    text = "".join(block.text for block in message.content if block.type == "text")
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and streamed == text
    assert final.content[0].type == "text" and final.content[0].text == text
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)
    chat = sync_client(smollm2_server).chat.completions.create(
        model="test-model",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=30,
        temperature=0,
    )
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and message.usage.input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model="test-model", system=SYSTEM, messages=user)
    assert counted.input_tokens == chat.usage.prompt_tokens
    # a stop sequence from the middle of that text ends the same answer there, and is named
    stop = text[len(text) // 2 :][:3]
    cut = client.messages.create(**request, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in cut.content if block.type == "text") == text[: text.index(stop)]
    assert smollm2_server.engine_state()["rows_in_use"] == 0


@pytest.mark.slow
def test_a_tool_use_round_trip(smollm2_server: ServerProcess) -> None:
    client = anthropic_client(smollm2_server)
    conversation: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.messages.create(
        model="test-model",
        max_tokens=100,
        messages=conversation,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    calls = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_ARGS)
    conversation += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 degrees."}]},
    ]
    second = client.messages.create(
        model="test-model",
        max_tokens=40,
        messages=conversation,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in second.content] == ["text"] and second.content[0].text.strip()  # type: ignore[union-attr]
    # the call and its result reached the prompt (the tools did not: tool_choice none hides them)
    counted = client.messages.count_tokens(model="test-model", messages=conversation, tool_choice={"type": "none"})
    alone = client.messages.count_tokens(model="test-model", messages=conversation[:1])
    assert second.usage.input_tokens == counted.input_tokens > alone.input_tokens
