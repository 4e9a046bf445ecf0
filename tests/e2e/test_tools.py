"""Tool calls through the real server and the openai client, with SmolLM2 (135M) and the repo's tool template:
forced calls always carry valid arguments, streamed and not, and a whole round trip (call, result, answer) works."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess

WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ORDER_ARGS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "count": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["name", "count"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Today's weather in a city.", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {"name": "order_food", "description": "Orders food for delivery.", "parameters": ORDER_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "order_food": ORDER_ARGS}
QUESTIONS = ["What is the weather like in Paris?", "Order two pizzas and a salad, quickly.", "Hello there!"]


def assert_valid_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_choices_return_valid_calls(smollm2_server: ServerProcess, stream: bool) -> None:
    """Each question with `required` and with a named function, all six at once (they share the batch)."""
    client = sync_client(smollm2_server)
    named = {"type": "function", "function": {"name": "order_food"}}
    cases = [
        (q, choice, allowed)
        for q in QUESTIONS
        for choice, allowed in (("required", set(SCHEMAS)), (named, {"order_food"}))
    ]

    def ask(question: str, choice: Any) -> Any:
        request: dict[str, Any] = {
            "model": "test-model",
            "messages": [{"role": "user", "content": question}],
            "tools": TOOLS,
            "tool_choice": choice,
            "max_tokens": 300,
            "temperature": 0,
        }
        if stream:
            with client.chat.completions.stream(**request) as events:
                for _ in events:
                    pass
                return events.get_final_completion()
        return client.chat.completions.create(**request)

    with ThreadPoolExecutor(len(cases)) as pool:
        completions = list(pool.map(ask, [q for q, _, _ in cases], [choice for _, choice, _ in cases]))
    for (question, choice, allowed), completion in zip(cases, completions, strict=True):
        result = completion.choices[0]
        assert result.finish_reason == "tool_calls", (question, result)
        assert_valid_calls(result.message.tool_calls or [], allowed)
        if choice is named:
            assert len(result.message.tool_calls or []) == 1
    assert smollm2_server.engine_state()["rows_in_use"] == 0


@pytest.mark.slow
def test_a_whole_tool_round_trip(smollm2_server: ServerProcess) -> None:
    """The call the model made goes back as the client returned it, with the tool's result; the model answers."""
    client = sync_client(smollm2_server)
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = client.chat.completions.create(
        model="test-model", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    call_message = first.choices[0].message
    assert_valid_calls(call_message.tool_calls or [], set(SCHEMAS))
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
        for call in call_message.tool_calls or []
    ]
    messages += [call_message.model_dump(), *results]
    second = client.chat.completions.create(
        model="test-model", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0
    )
    answer = second.choices[0]
    assert answer.message.content and answer.finish_reason in ("stop", "length")
    assert not answer.message.tool_calls


@pytest.mark.slow
def test_langchain_bind_tools_round_trip(smollm2_server: ServerProcess) -> None:
    """Optional: LangChain's ChatOpenAI.bind_tools against the server (skipped without langchain-openai)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    messages_module = pytest.importorskip("langchain_core.messages")
    llm = langchain_openai.ChatOpenAI(
        model="test-model", base_url=smollm2_server.base_url, api_key="unused", temperature=0, max_tokens=200
    )
    question = messages_module.HumanMessage("What is the weather like in Paris?")
    calling = llm.bind_tools(TOOLS, tool_choice="get_weather")
    reply = calling.invoke([question])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_ARGS)
    result = messages_module.ToolMessage(json.dumps({"temperature": 21, "sky": "sunny"}), tool_call_id=call["id"])
    answer = llm.bind_tools(TOOLS, tool_choice="none").invoke([question, reply, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
