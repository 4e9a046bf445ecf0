"""Anthropic's Messages API through the app (scripted engine, the repo's tool template): the request reaches the chat
path (template, sampling, tools, grammar), answers and every streamed event parse with the anthropic SDK's own
types, stop reasons map, the SDK's stream helpers read the stream, and errors come in Anthropic's shape."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import httpx2
import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import BASE_URL, CHAT, MODEL, make_app, make_context, running
from tests.app.test_app_reasoning import THOUGHT_PIECES, _context
from tests.app.test_app_tools import CALL_PIECES, TEMPLATE
from transformers_openai.engine.request import FinishReason
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import TokenizerService

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city today.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"name": "get_time", "description": "The time now.", "input_schema": {"type": "object", "properties": {}}}
QUESTION = "What is the weather in Paris?"


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": QUESTION}], **fields}


def serve(fake: FakeEngine, hf_tokenizer: Any, **settings: Any) -> Any:
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's tokenizer keeps its own template
    ready = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, TEMPLATE.read_text()),
        structured=StructuredOutputs(tokenizer),
        max_model_len=2048,
    )
    return running(make_app(fake, tokenizer, loader=lambda: ready, **settings))


@pytest.fixture
async def tool_client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app with the repo's tool template (and structured outputs, for forced calls)."""
    async with serve(fake, hf_tokenizer) as ready:
        yield ready


def prompt_text(fake: FakeEngine, hf_tokenizer: Any) -> str:
    return str(hf_tokenizer.decode(fake.submitted[-1].prompt_token_ids))


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The stream's events, each checked against the SDK's types and named (`event:`) as its type."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    found: list[dict[str, Any]] = []
    name = None
    for line in response.text.splitlines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            event = json.loads(line.removeprefix("data:"))
            assert event["type"] == name, (name, event)
            if name != "error":
                EVENTS.validate_python(event)
            found.append(event)
            name = None
    return found


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == kind, error
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    return str(error["error"]["message"])


async def test_a_message_runs_through_the_chat_path_streamed_or_not(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    request = body(
        system=[{"type": "text", "text": "You are terse."}],
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_sequences=["END"],
        metadata={"user_id": "u-1"},
    )
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04", "x-request-id": "abc"}
    response = await client.post(MESSAGES, json=request, headers=headers)
    assert response.status_code == 200, response.text
    message = Message.model_validate(response.json())
    assert message.id == "msg_abc" and message.model == MODEL and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"] and message.content[0].text == "Hello, world"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    submitted = fake.submitted[-1]
    assert message.usage.input_tokens == len(submitted.prompt_token_ids) and message.usage.output_tokens == 3
    params = submitted.params
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (0.5, 0.9, 20, ("END",))
    assert params.max_tokens == 50
    text = prompt_text(fake, hf_tokenizer)
    assert "You are terse." in text and QUESTION in text
    # Anthropic's prefill: the answer continues the last (assistant) turn
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The answer is"}]
    assert (await client.post(MESSAGES, json=body(messages=history))).status_code == 200
    assert prompt_text(fake, hf_tokenizer).rstrip().endswith("The answer is")
    # without a reasoning format, thinking changes nothing
    thinking = await client.post(MESSAGES, json=body(thinking={"type": "enabled", "budget_tokens": 20}))
    assert [block["type"] for block in thinking.json()["content"]] == ["text"]
    # streamed: Anthropic's events, each named by its type
    sent = events(await client.post(MESSAGES, json=body(stream=True)))
    kinds = [event["type"] for event in sent]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = sent[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(fake.submitted[-1].prompt_token_ids)
    assert sent[1]["content_block"] == {"type": "text", "text": "", "citations": None} and sent[1]["index"] == 0
    assert "".join(event["delta"]["text"] for event in sent[2:5]) == "Hello, world"
    assert sent[-2]["usage"]["output_tokens"] == 3


STOP_CASES = [
    (Script(pieces=["a", "b"], stop_string="END"), 50, "stop_sequence", "END"),
    (Script(pieces=["a", "b", "c"]), 2, "max_tokens", None),
    (Script(pieces=CALL_PIECES), 200, "tool_use", None),
    (Script(pieces=["a"], finish_reason=FinishReason.STOP), 50, "end_turn", None),
]


async def test_stop_reasons_map_and_tool_uses_stream_as_blocks(
    tool_client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    for script, max_tokens, stop_reason, stop_sequence in STOP_CASES:
        fake.script = script
        request = body(max_tokens=max_tokens, stop_sequences=["END"], tools=[WEATHER, TIME])
        message = Message.model_validate((await tool_client.post(MESSAGES, json=request)).json())
        assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
        sent = events(await tool_client.post(MESSAGES, json={**request, "stream": True}))
        delta = [event for event in sent if event["type"] == "message_delta"][0]["delta"]
        assert (delta["stop_reason"], delta["stop_sequence"]) == (stop_reason, stop_sequence)
    # streamed tool uses: a block each, after the text's, their input as JSON pieces
    fake.script = Script(pieces=CALL_PIECES)
    sent = events(await tool_client.post(MESSAGES, json=body(stream=True, tools=[WEATHER, TIME])))
    starts = [event for event in sent if event["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    calls = [s["content_block"] for s in starts[1:]]
    assert [call["name"] for call in calls] == ["get_weather", "get_time"]
    assert all(call["id"].startswith("toolu_") and call["input"] == {} for call in calls)
    pieces: dict[int, str] = {}
    for event in sent:
        if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            pieces[event["index"]] = pieces.get(event["index"], "") + event["delta"]["partial_json"]
    assert {index: json.loads(text) for index, text in pieces.items()} == {1: {"city": "Paris"}, 2: {}}
    stops = [event["index"] for event in sent if event["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    # chat names the stop string as vLLM's stop_reason, and has no such key when none ended the answer
    chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "stop": ["END"]}
    fake.script = Script(pieces=["a"], stop_string="END")
    assert (await tool_client.post(CHAT, json=chat)).json()["choices"][0]["stop_reason"] == "END"
    fake.script = Script()
    assert "stop_reason" not in (await tool_client.post(CHAT, json=chat)).json()["choices"][0]


CHOICES = [
    ({"type": "auto"}, False, True),
    ({"type": "any"}, True, True),
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, True, True),
    ({"type": "none"}, False, False),
]


async def test_tool_round_trip_choices_and_count_tokens(
    tool_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    """A call, its result given back (is_error shown to the model), each tool_choice, and count_tokens."""
    client = tool_client
    fake.script = Script(pieces=CALL_PIECES)
    first = Message.model_validate((await client.post(MESSAGES, json=body(tools=[WEATHER, TIME]))).json())
    assert [block.type for block in first.content] == ["text", "tool_use", "tool_use"]
    call = first.content[1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_")
    fake.script = Script()
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "21 and sunny"}]},
                {"type": "tool_result", "tool_use_id": first.content[2].id, "content": "noon", "is_error": True},  # type: ignore[union-attr]
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    second = await client.post(MESSAGES, json=body(messages=history, tools=[WEATHER, TIME]))
    assert second.status_code == 200, second.text
    text = prompt_text(fake, hf_tokenizer)
    assert "21 and sunny" in text and "Error: noon" in text and text.index("21 and sunny") < text.index("And tomorrow?")
    assert '"city": "Paris"' in text  # the call, as the template shows the assistant's tool calls
    for choice, forced, shown in CHOICES:
        response = await client.post(MESSAGES, json=body(tools=[WEATHER, TIME], tool_choice=choice))
        assert response.status_code == 200, response.text
        assert (fake.submitted[-1].constraint is not None) is forced, choice  # a forced call follows a grammar
        assert ('"name": "get_weather"' in prompt_text(fake, hf_tokenizer)) is shown, choice
    request = body(system="Be brief.", tools=[WEATHER])
    counted = await client.post(COUNT, json={key: request[key] for key in ("model", "messages", "system", "tools")})
    assert counted.status_code == 200, counted.text
    function = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    chat_tools = [{"type": "function", "function": function}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    chat = await client.post(CHAT, json={"model": MODEL, "messages": messages, "tools": chat_tools})
    assert counted.json() == {"input_tokens": chat.json()["usage"]["prompt_tokens"]}
    assert (await client.post("/messages/count_tokens", json={"model": MODEL, "messages": messages[1:]})).is_success


async def test_the_anthropic_sdk_reads_messages_and_streams_with_its_key(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(make_app(fake, hf_tokenizer, api_keys=["sk-test"])) as ready:
        transport = httpx2.ASGITransport(app=ready._transport.app)  # type: ignore[attr-defined]
        http_client = httpx2.AsyncClient(transport=transport)
        sdk = AsyncAnthropic(base_url=BASE_URL, api_key="sk-test", http_client=http_client, max_retries=0)
        user: Any = [{"role": "user", "content": QUESTION}]
        message = await sdk.messages.create(model=MODEL, max_tokens=20, messages=user)
        assert message.content[0].type == "text" and message.content[0].text == "Hello, world"
        async with sdk.messages.stream(model=MODEL, max_tokens=20, messages=user) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello, world" and final.content[0].type == "text" and final.content[0].text == text
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
        counted = await sdk.messages.count_tokens(model=MODEL, messages=user)
        assert counted.input_tokens == message.usage.input_tokens
        # the key as Anthropic's x-api-key header or as a Bearer token; a wrong or missing one in Anthropic's shape
        assert_anthropic_error(await ready.post(MESSAGES, json=body()), 401, "authentication_error")
        wrong = await ready.post(MESSAGES, json=body(), headers={"x-api-key": "sk-wrong"})
        assert_anthropic_error(wrong, 401, "authentication_error")
        assert (await ready.post(MESSAGES, json=body(), headers={"x-api-key": "sk-test"})).status_code == 200
        assert (await ready.post(MESSAGES, json=body(), headers={"authorization": "Bearer sk-test"})).is_success
        chat = {"model": MODEL, "messages": body()["messages"]}
        assert (await ready.post(CHAT, json=chat, headers={"x-api-key": "sk-test"})).status_code == 200
        assert set((await ready.post(CHAT, json=chat)).json()) == {"error"}  # OpenAI's shape on OpenAI's routes


async def test_thinking_comes_back_as_thinking_blocks(fake: FakeEngine, hf_tokenizer: Any) -> None:
    fake.script = Script(pieces=THOUGHT_PIECES)
    context = _context(fake, copy.deepcopy(hf_tokenizer))
    async with running(make_app(fake, hf_tokenizer, loader=lambda: context)) as ready:
        thinking = {"type": "enabled", "budget_tokens": 16}
        whole = Message.model_validate((await ready.post(MESSAGES, json=body(thinking=thinking))).json())
        sent = events(await ready.post(MESSAGES, json=body(thinking=thinking, stream=True)))
        hidden = Message.model_validate((await ready.post(MESSAGES, json=body(thinking={"type": "disabled"}))).json())
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "Let me think"  # type: ignore[union-attr]
    starts = [event["content_block"]["type"] for event in sent if event["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thought = "".join(e["delta"]["thinking"] for e in sent if e.get("delta", {}).get("type") == "thinking_delta")
    assert thought == "Let me think"
    assert [block.type for block in hidden.content] == ["text"]


# ---------------------------------------------------------------- errors, in Anthropic's shape

TOOL_USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("no max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("max_tokens 0", body(max_tokens=0), "max_tokens"),
    ("no messages", body(messages=[]), "messages"),
    ("temperature over 1", body(temperature=1.5), "temperature"),
    ("unknown field", body(unknown_field=1), "unknown_field"),
    ("server tool", body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
    ("unknown tool chosen", body(tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER]), "tool_choice"),
    ("tool_use in a user turn", body(messages=[{"role": "user", "content": [TOOL_USE]}]), "tool_use"),
    ("document block", body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages"),
    ("empty content", body(messages=[{"role": "user", "content": []}]), "messages"),
    ("thinking without budget", body(thinking={"type": "enabled"}), "budget_tokens"),
    ("empty stop sequence", body(stop_sequences=[""]), "stop_sequences"),
    ("system role", body(messages=[{"role": "system", "content": "hi"}]), "messages"),
    (
        "ends in a tool use",
        body(messages=[*body()["messages"], {"role": "assistant", "content": [TOOL_USE]}]),
        "tool_result",
    ),
]


async def test_errors_on_the_messages_routes_have_anthropics_shape(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    for name, request, needle in BAD_REQUESTS:
        response = await client.post(MESSAGES, json=request)
        try:
            assert needle in assert_anthropic_error(response, 400, "invalid_request_error")
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert fake.submitted == []
    # the other failures, in the same shape
    assert_anthropic_error(await client.post(MESSAGES, json=body(model="claude-x")), 404, "not_found_error")
    count = await client.post("/messages/count_tokens", json={"model": "claude-x", "messages": []})
    assert_anthropic_error(count, 400, "invalid_request_error")
    assert_anthropic_error(await client.post(MESSAGES, content=b"{not json"), 400, "invalid_request_error")
    assert_anthropic_error(await client.get(MESSAGES), 405, "invalid_request_error")
    assert set((await client.post(CHAT, json={"model": MODEL})).json()) == {"error"}  # OpenAI's on OpenAI's routes
    # a failure mid-stream: an error event after message_start
    fake.script = Script(error_after=1)
    sent = events(await client.post(MESSAGES, json=body(stream=True)))
    assert sent[0]["type"] == "message_start" and sent[-1]["type"] == "error"
    assert sent[-1]["error"]["type"] == "api_error" and sent[-1]["error"]["message"]
    # an engine at capacity: Anthropic's rate_limit_error with Retry-After
    fake.capacity = 0
    response = await client.post(MESSAGES, json=body())
    assert_anthropic_error(response, 429, "rate_limit_error")
    assert response.headers["retry-after"] == "3"
