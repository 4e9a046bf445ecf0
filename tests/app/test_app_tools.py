"""Tool calling through the app (scripted engine, SmolLM2's tokenizer with the repo's tool template): tools reach
the template, calls come back whole and streamed as OpenAI sends them, a forced choice carries a grammar, and
every misuse is a 400 that names its field."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionChunk,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
)

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import CHAT, MODEL, assert_error, chat_body, make_app, make_context, running, sse_chunks
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import TokenizerService

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city today.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now."},
}
CALL_PIECES = [
    "Let me check.\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
]
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def tool_client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's tokenizer keeps its own template
    context = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, TEMPLATE.read_text()),
        structured=StructuredOutputs(tokenizer),
        max_model_len=2048,  # room for the tool descriptions
    )
    async with running(make_app(fake, tokenizer, loader=lambda: context)) as ready:
        yield ready


def prompt_text(fake: FakeEngine, hf_tokenizer: Any) -> str:
    return str(hf_tokenizer.decode(fake.submitted[-1].prompt_token_ids))


async def test_tools_are_shown_to_the_model_and_its_calls_come_back(
    tool_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    response = await tool_client.post(CHAT, json=chat_body(messages=USER, tools=[WEATHER, TIME]))
    assert response.status_code == 200, response.text
    assert '"name": "get_weather"' in prompt_text(fake, hf_tokenizer)  # the template listed the tools
    assert fake.submitted[-1].constraint is None  # "auto": the model may answer in words
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]


async def test_a_streamed_call_comes_as_openai_streams_it(tool_client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    body = chat_body(messages=USER, tools=[WEATHER, TIME], stream=True)
    chunks = sse_chunks((await tool_client.post(CHAT, json=body)).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    first = pieces[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    later = [p for p in pieces[1:] if p["index"] == 0]
    assert later and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in later)
    assert json.loads("".join(p["function"]["arguments"] for p in later)) == {"city": "Paris"}
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the openai package's own accumulator reads the stream as the whole answer
    whole = (await tool_client.post(CHAT, json={**body, "stream": False})).json()
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    assert message.content == whole["choices"][0]["message"]["content"]
    streamed_calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    calls = whole["choices"][0]["message"]["tool_calls"]
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert streamed_calls == expected


async def test_required_and_named_choices_carry_a_grammar(tool_client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=CALL_PIECES[1:])
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        body = chat_body(messages=USER, tools=[WEATHER, TIME], tool_choice=choice)
        response = await tool_client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        assert fake.submitted[-1].constraint is not None


async def test_tool_choice_none_shows_no_tools_and_reads_no_calls(
    tool_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    response = await tool_client.post(CHAT, json=chat_body(messages=USER, tools=[WEATHER], tool_choice="none"))
    assert "get_weather" not in prompt_text(fake, hf_tokenizer)
    message = response.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == "".join(CALL_PIECES)


async def test_a_tool_round_trip_reaches_the_model(
    tool_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    """The assistant message as the openai client returned it, then the tool's result: the second turn works."""
    fake.script = Script(pieces=CALL_PIECES)
    http_client = httpx.AsyncClient(transport=tool_client._transport, base_url="http://localhost")
    # The SDK takes httpx's own client as well as httpx2's, though its annotation names httpx2's only.
    oai = AsyncOpenAI(base_url="http://localhost/v1", api_key="x", http_client=http_client, max_retries=0)  # type: ignore[arg-type]
    async with oai:
        first = await oai.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME])
        message = first.choices[0].message
        assert message.tool_calls
        results: list[ChatCompletionToolMessageParam] = [
            {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in message.tool_calls
        ]
        # The assistant message sent back as the client returned it (its dump has the param's shape).
        returned = cast(ChatCompletionAssistantMessageParam, message.model_dump())
        fake.script = Script(pieces=["It is sunny."])
        second = await oai.chat.completions.create(
            model=MODEL,
            messages=[*USER, returned, *results],
            tools=[WEATHER, TIME],
        )
    assert second.choices[0].message.content == "It is sunny." and second.choices[0].finish_reason == "stop"
    prompt = prompt_text(fake, hf_tokenizer)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt


async def test_a_template_without_tools_is_a_400_naming_tools(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    response = await client.post(CHAT, json=chat_body(tools=[WEATHER]))
    error = assert_error(response, 400, param="tools")
    assert "--chat-template" in error["message"]
    assert not fake.submitted


BAD = [
    (chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat_body(tool_choice="required"), "tool_choice"),
    (chat_body(tools=[WEATHER, WEATHER]), "tools"),
    (chat_body(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name"),
    (chat_body(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (chat_body(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (chat_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (chat_body(messages=[{"role": "tool", "content": "sunny"}]), "messages.0"),
    (
        chat_body(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        ),
        "messages.0",
    ),
    (chat_body(functions=[{"name": "f"}]), "functions"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[param for _, param in BAD])
async def test_misuse_is_a_400_naming_the_field(
    tool_client: httpx.AsyncClient, fake: FakeEngine, body: dict[str, Any], param: str
) -> None:
    error = assert_error(await tool_client.post(CHAT, json=body), 400)
    assert error["param"] is not None and error["param"].startswith(param), error
    assert not fake.submitted
