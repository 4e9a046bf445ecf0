"""/v1/responses through the app (scripted engine, the repo's tool template): the request reaches the chat path
(template, tools, grammar), answers and every streamed event parse with the openai client's own types, the store
serves GET, DELETE and previous_response_id, and every unsupported field is a 400 that names it."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import MODEL, assert_error, make_app, make_context, running
from tests.app.test_app_tools import CALL_PIECES, TEMPLATE
from transformers_openai.api.state import Handlers
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import TokenizerService

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"type": "function", "name": "get_time", "description": "The time now."}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "What is the weather in Paris?", **fields}


async def serve(fake: FakeEngine, hf_tokenizer: Any, settings: dict[str, Any] | None = None, **context: Any) -> Any:
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's tokenizer keeps its own template
    ready = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, TEMPLATE.read_text()),
        structured=StructuredOutputs(tokenizer),
        max_model_len=2048,
        **context,
    )
    return running(make_app(fake, tokenizer, loader=lambda: ready, **(settings or {})))


@pytest.fixture
async def client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with await serve(fake, hf_tokenizer) as ready:
        yield ready


def prompt_text(fake: FakeEngine, hf_tokenizer: Any) -> str:
    return str(hf_tokenizer.decode(fake.submitted[-1].prompt_token_ids))


def events_of(response: httpx.Response) -> list[Any]:
    """The stream's events, parsed by the openai client's types; each SSE `event:` names its data's type."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event:") :].strip() for line in response.text.splitlines() if line.startswith("event:")]
    data = [line[len("data:") :].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert "[DONE]" not in data
    events = [EVENTS.validate_python(json.loads(d)) for d in data]
    assert names == [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


async def test_a_plain_response_is_the_chat_answer_in_the_response_shape(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    response = await client.post(RESPONSES, json=body(instructions="Answer in French.", temperature=0.5))
    assert response.status_code == 200, response.text
    answer = Response.model_validate(response.json())
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.status == "completed"
    assert answer.output_text == "Hello, world"
    assert answer.instructions == "Answer in French." and answer.temperature == 0.5
    assert answer.usage is not None and answer.usage.output_tokens == 3
    assert answer.usage.total_tokens == answer.usage.input_tokens + 3
    prompt = prompt_text(fake, hf_tokenizer)
    assert prompt.index("Answer in French.") < prompt.index("What is the weather in Paris?")
    assert fake.submitted[-1].params.temperature == 0.5


async def test_input_items_become_the_chat_messages(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "sunny"}'},
    ]
    response = await client.post(RESPONSES, json=body(input=items, tools=[WEATHER]))
    assert response.status_code == 200, response.text
    prompt = prompt_text(fake, hf_tokenizer)
    positions = [prompt.index(text) for text in ("Be brief.", "Weather in Paris?", '"city": "Paris"', "sunny")]
    assert positions == sorted(positions), prompt
    assert prompt.count("<|im_start|>assistant\n<tool_call>") == 1 and prompt.count("<|im_start|>tool\n") == 1


async def test_function_calls_come_back_as_function_call_items(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    response = await client.post(RESPONSES, json=body(tools=[WEATHER, TIME]))
    answer = Response.model_validate(response.json())
    kinds = [item.type for item in answer.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert answer.output_text == "Let me check."
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.call_id.startswith("call_") for c in calls)
    assert answer.tools[0].type == "function" and answer.tools[0].name == "get_weather"


async def test_a_stream_sends_the_responses_events_in_order(client: httpx.AsyncClient) -> None:
    events = events_of(await client.post(RESPONSES, json=body(stream=True)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hello, world"
    assert final.usage is not None and final.usage.output_tokens == 3
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello, world"
    stored = await client.get(f"{RESPONSES}/{final.id}")
    assert Response.model_validate(stored.json()) == final


async def test_a_streamed_call_has_its_own_item_and_argument_events(
    client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    events = events_of(await client.post(RESPONSES, json=body(tools=[WEATHER, TIME], stream=True)))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["message", "function_call", "function_call"]
    done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    deltas: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    assert {k: v for k, v in deltas.items() if v} == {k: v for k, v in done.items() if v}
    assert [json.loads(a) for a in done.values()] == [{"city": "Paris"}, {}]
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]


async def test_a_round_trip_through_previous_response_id(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    fake.script = Script(pieces=CALL_PIECES)
    first = (await client.post(RESPONSES, json=body(tools=[WEATHER, TIME], instructions="Use tools."))).json()
    call = next(item for item in first["output"] if item["type"] == "function_call")
    fake.script = Script(pieces=["It is sunny."])
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "sunny"}'}
    second = await client.post(RESPONSES, json=body(input=[output], previous_response_id=first["id"], tools=[WEATHER]))
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first["id"]
    prompt = prompt_text(fake, hf_tokenizer)
    assert "What is the weather in Paris?" in prompt and "Let me check." in prompt  # the stored conversation
    assert '{"sky": "sunny"}' in prompt
    assert "Use tools." not in prompt  # instructions are not carried over, as OpenAI's are not
    unknown = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}
    assert_error(await client.post(RESPONSES, json=body(input=[unknown])), 400, param="input")


async def test_a_forced_call_and_a_json_schema_go_through_the_grammar(
    client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    choice = {"type": "function", "name": "get_weather"}
    fake.script = Script(pieces=['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'])
    answer = (await client.post(RESPONSES, json=body(tools=[WEATHER], tool_choice=choice))).json()
    assert fake.submitted[-1].constraint is not None
    assert answer["tool_choice"] == choice and answer["output"][-1]["name"] == "get_weather"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    fake.script = Script(pieces=['{"city": "Paris"}'])
    response = await client.post(RESPONSES, json=body(text=text))
    assert response.status_code == 200, response.text
    assert fake.submitted[-1].constraint is not None
    assert response.json()["text"]["format"]["name"] == "place"
    assert Response.model_validate(response.json()).output_text == '{"city": "Paris"}'


async def test_max_output_tokens_makes_an_incomplete_response(client: httpx.AsyncClient) -> None:
    answer = Response.model_validate((await client.post(RESPONSES, json=body(max_output_tokens=2))).json())
    assert answer.status == "incomplete" and answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens" and answer.output_text == "Hello,"
    events = events_of(await client.post(RESPONSES, json=body(max_output_tokens=2, stream=True)))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


async def test_a_failure_mid_stream_is_an_error_event(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(error_after=1)
    events = events_of(await client.post(RESPONSES, json=body(stream=True)))
    assert events[-1].type == "error" and events[-1].message


async def test_stored_responses_are_read_deleted_and_evicted(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with await serve(fake, hf_tokenizer, max_stored_responses=2) as client:
        ids = [(await client.post(RESPONSES, json=body())).json()["id"] for _ in range(3)]
        assert_error(await client.get(f"{RESPONSES}/{ids[0]}"), 404)  # the least recently used went
        assert (await client.get(f"{RESPONSES}/{ids[1]}")).json()["id"] == ids[1]
        deleted = await client.delete(f"{RESPONSES}/{ids[1]}")
        assert deleted.json() == {"id": ids[1], "object": "response", "deleted": True}
        assert_error(await client.get(f"{RESPONSES}/{ids[1]}"), 404)
        assert_error(await client.delete(f"{RESPONSES}/{ids[1]}"), 404)
        unstored = (await client.post(RESPONSES, json=body(store=False))).json()
        assert_error(await client.get(f"{RESPONSES}/{unstored['id']}"), 404)
        error = assert_error(
            await client.post(RESPONSES, json=body(previous_response_id=ids[0])), 400, param="previous_response_id"
        )
        assert error["code"] == "previous_response_not_found"


async def test_no_store_when_the_store_is_off(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with await serve(fake, hf_tokenizer, max_stored_responses=0) as client:
        answer = (await client.post(RESPONSES, json=body())).json()
        assert answer["store"] is False
        assert_error(await client.get(f"{RESPONSES}/{answer['id']}"), 404)


KEY_A, KEY_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}


async def test_a_stored_response_is_seen_only_by_the_key_that_made_it(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with await serve(fake, hf_tokenizer, settings={"api_keys": ["key-a", "key-b"]}) as client:
        made = await client.post(RESPONSES, json=body(), headers=KEY_A)
        assert made.status_code == 200, made.text
        first = made.json()["id"]
        streamed = events_of(await client.post(RESPONSES, json=body(stream=True), headers=KEY_A))
        second = streamed[-1].response.id
        for response_id in (first, second):
            url = f"{RESPONSES}/{response_id}"
            # Key B: as if the response did not exist (the message a made-up id gets), for read and delete alike.
            missing = assert_error(await client.get(url, headers=KEY_B), 404, param="response_id")
            assert missing["message"] == f"Response with id '{response_id}' not found."
            assert_error(await client.delete(url, headers=KEY_B), 404, param="response_id")
            assert_error(await client.get(url), 401)
            assert (await client.get(url, headers=KEY_A)).json()["id"] == response_id  # B's delete deleted nothing
        fake.script = Script(pieces=["Again."])
        refused = await client.post(RESPONSES, json=body(previous_response_id=first), headers=KEY_B)
        error = assert_error(refused, 400, param="previous_response_id", code="previous_response_not_found")
        assert error["message"] == f"Previous response with id '{first}' not found."
        continued = await client.post(RESPONSES, json=body(previous_response_id=first), headers=KEY_A)
        assert continued.status_code == 200, continued.text
        assert "Hello, world" in prompt_text(fake, hf_tokenizer)  # A's stored answer, carried over
        # What B stores is B's alone, in turn.
        theirs = (await client.post(RESPONSES, json=body(), headers=KEY_B)).json()["id"]
        assert_error(await client.get(f"{RESPONSES}/{theirs}", headers=KEY_A), 404)
        assert (await client.delete(f"{RESPONSES}/{first}", headers=KEY_A)).json()["deleted"] is True
        assert_error(await client.get(f"{RESPONSES}/{first}", headers=KEY_A), 404)
        assert (await client.get(f"{RESPONSES}/{theirs}", headers=KEY_B)).json()["id"] == theirs


async def test_the_store_keeps_to_its_bytes(fake: FakeEngine, hf_tokenizer: Any) -> None:
    """Room for two responses of 1,800 ASCII characters holds one of 1,800 Cyrillic ones (2 bytes each in UTF-8),
    not two. A stored response is its input plus about 1 KB (its JSON, the answer): the budget, 7,600 bytes, holds
    two ASCII ones while that overhead is under 2,000 bytes, and not two Cyrillic ones while it is over 200."""
    async with await serve(fake, hf_tokenizer, max_stored_response_bytes=7600) as client:
        ascii_ids = [(await client.post(RESPONSES, json=body(input="x" * 1800))).json()["id"] for _ in range(2)]
        for response_id in ascii_ids:
            assert (await client.get(f"{RESPONSES}/{response_id}")).status_code == 200
        made = [await client.post(RESPONSES, json=body(input="я" * 1800)) for _ in range(2)]
        assert [m.status_code for m in made] == [200, 200], made[-1].text
        found = [
            (await client.get(f"{RESPONSES}/{i}")).status_code for i in [*ascii_ids, *(m.json()["id"] for m in made)]
        ]
        assert found == [404, 404, 404, 200]


METADATA_REFUSED: list[Any] = [
    {f"k{i}": "v" for i in range(17)},
    {"k" * 65: "v"},
    {"k": "v" * 513},
    {"k": 1},
    {"k": None},
    ["k", "v"],
]


async def test_metadata_is_bounded_as_openai_bounds_it(client: httpx.AsyncClient) -> None:
    for metadata in METADATA_REFUSED:
        assert_error(await client.post(RESPONSES, json=body(metadata=metadata)), 400, param="metadata")
    largest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    response = await client.post(RESPONSES, json=body(metadata=largest))
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == largest


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # a thought without its answer
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),  # no vision
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"seed": 1}, "seed"),
    ({"model": "other"}, "model"),
]


async def test_what_is_not_supported_is_a_400_that_names_it(client: httpx.AsyncClient) -> None:
    for fields, param in REFUSED:
        response = await client.post(RESPONSES, json=body(**fields))
        assert_error(response, 404 if param == "model" else 400, param=param)


async def test_what_clients_send_by_default_is_accepted(client: httpx.AsyncClient) -> None:
    """The Agents SDK and the client send these with empty or default values."""
    defaults = {
        "include": [],
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "store": True,
        "background": False,
        "parallel_tool_calls": True,
        "metadata": {"k": "v"},
        "stream_options": {"include_obfuscation": False},
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "top_logprobs": 0,
        "text": {"format": {"type": "text"}},
    }
    response = await client.post(RESPONSES, json=body(**defaults))
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"k": "v"}


def test_a_speech_model_refuses_responses_as_it_refuses_chat() -> None:
    handlers = Handlers("whisper", text=None, speech=None, tokenize=None)  # type: ignore[arg-type]  # not read here
    with pytest.raises(BadRequestError) as refused:
        handlers.responses  # noqa: B018
    assert refused.value.param == "model" and refused.value.code == "model_not_supported"


async def test_the_cheap_prompt_limits_hold_for_input_items(fake: FakeEngine, hf_tokenizer: Any) -> None:
    limits = PromptLimits(
        max_messages=2, max_content_parts=4, max_prompt_tokens=100, max_token_chars=4, max_sequences=8
    )
    async with await serve(fake, hf_tokenizer, prompt_limits=limits) as client:
        three = [{"role": "user", "content": "Hi"}] * 3
        error = assert_error(await client.post(RESPONSES, json=body(input=three)), 400, param="input")
        assert error["code"] == "too_many_messages"
        error = assert_error(await client.post(RESPONSES, json=body(input="x" * 401)), 400, param="input")
        assert error["code"] == "context_length_exceeded"
        output = [{"type": "function_call_output", "call_id": "c", "output": "x" * 401}]
        error = assert_error(await client.post(RESPONSES, json=body(input=output)), 400, param="input")
        assert error["code"] == "context_length_exceeded"
        assert not fake.submitted
