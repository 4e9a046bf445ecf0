"""/v1/responses through the real server with SmolLM2 (135M) and the repo's tool template: the openai client's
`responses.create` plain, streamed (every event valid by the client's own types), a function tool round trip through
`previous_response_id`, a JSON-schema answer that validates, and an OpenAI Agents SDK agent with one tool."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.e2e.conftest import async_client, sync_client
from tests.e2e.server import ServerProcess

WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Today's weather in a city.",
    "parameters": WEATHER_ARGS,
    "strict": True,
}
QUESTION = "What is the weather like in Paris?"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.mark.slow
def test_a_plain_response(smollm2_server: ServerProcess) -> None:
    client = sync_client(smollm2_server)
    answer = client.responses.create(
        model="test-model",
        instructions="Answer in one sentence.",
        input="What is the capital of France?",
        max_output_tokens=40,
        temperature=0,
    )
    Response.model_validate(answer.to_dict())  # strictly, not just as the client reads it
    assert answer.status in ("completed", "incomplete") and answer.output_text
    assert answer.usage is not None and 0 < answer.usage.output_tokens <= 40
    assert client.responses.retrieve(answer.id).output_text == answer.output_text


@pytest.mark.slow
def test_a_streamed_response_sends_every_event_in_order(smollm2_server: ServerProcess) -> None:
    client = sync_client(smollm2_server)
    stream = client.responses.create(
        model="test-model", input="Tell me about Paris.", max_output_tokens=30, temperature=0, stream=True
    )
    events = [EVENTS.validate_python(event.to_dict()) for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ] and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    assert smollm2_server.engine_state()["rows_in_use"] == 0


@pytest.mark.slow
def test_a_function_tool_round_trip_through_previous_response_id(smollm2_server: ServerProcess) -> None:
    client = sync_client(smollm2_server)
    first = client.responses.create(
        model="test-model",
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    outputs: Any = [
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 21})}
        for call in calls
    ]
    second = client.responses.create(
        model="test-model",
        previous_response_id=first.id,
        input=outputs,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=60,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.output_text and not [item for item in second.output if item.type == "function_call"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_validates(smollm2_server: ServerProcess, stream: bool) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    request: Any = {
        "model": "test-model",
        "input": "Name a large city and its population.",
        "temperature": 0,
        "max_output_tokens": 100,
        "text": {"format": {"type": "json_schema", "name": "city", "schema": schema}},
    }
    if stream:
        with sync_client(smollm2_server).responses.stream(**request) as events:
            for _ in events:
                pass
            answer = events.get_final_response()
    else:
        answer = sync_client(smollm2_server).responses.create(**request)
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_agents_sdk_agent_with_one_tool(smollm2_server: ServerProcess, streamed: bool) -> None:
    pytest.importorskip("agents")
    import agents  # typed, unlike importorskip's module
    from agents.result import RunResultBase

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    def not_yet_called(context: Any, agent: Any) -> bool:
        return not cities

    # SmolLM2-135M calls tools reliably only when forced, and, offered the tool again, calls it again: the agent
    # forces the call, then (tool_choice reset after it) answers with the tool's result and no tool offered.
    @agents.function_tool(is_enabled=not_yet_called)
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        cities.append(city)
        return "sunny, 21 degrees"

    model = agents.OpenAIResponsesModel(model="test-model", openai_client=async_client(smollm2_server))
    settings = agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=120)
    agent = agents.Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
    )
    result: RunResultBase
    if streamed:
        streaming = agents.Runner.run_streamed(agent, QUESTION, max_turns=4)
        async for _ in streaming.stream_events():
            pass
        result = streaming
    else:
        result = await agents.Runner.run(agent, QUESTION, max_turns=4)
    assert cities and all(isinstance(city, str) and city for city in cities)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == 2  # the call, then the answer
    assert [item.type for item in result.raw_responses[0].output] == ["function_call"]
