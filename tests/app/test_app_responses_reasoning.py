"""/v1/responses with a reasoning model (scripted engine, a Qwen3-style `<think>` template): the thought comes back as
a `reasoning` item before the message, streamed as reasoning_text events, counted in reasoning_tokens; reasoning
items given back reach the template as the assistant's `reasoning_content`; `reasoning.effort` reaches the template;
a schema is enforced after the thought; `input_image` parts become chat image parts."""

from __future__ import annotations

import copy
import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import httpx
import pytest
import torch
from openai.types.responses import Response

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import MODEL, assert_error, make_app, make_context, running
from tests.app.test_app_responses import events_of
from tests.reasoning_support import THINK_TEMPLATE
from transformers_openai.protocol import ChatMessage, ImagePart
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.tokenizer import TokenizerService

RESPONSES = "/v1/responses"
THOUGHT_PIECES = ["Let", " me", " think", ".", "</think>", "\n\n", "Paris", " is", " sunny"]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "What is the weather in Paris?", **fields}


class FakeVision:
    """A vision model's prompts without a processor: records the messages it is given."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []

    async def encode_chat(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], dict[str, Any]]:
        self.messages = list(messages)
        return [1, 2, 3], {}


@functools.cache
def _structured(tokenizer: Any) -> StructuredOutputs:
    """One grammar compiler for the module's servers (building one reads the whole vocabulary)."""
    return StructuredOutputs(copy.deepcopy(tokenizer))


async def serve(fake: FakeEngine, hf_tokenizer: Any, **context: Any) -> Any:
    tokenizer = copy.deepcopy(hf_tokenizer)
    ready = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, THINK_TEMPLATE, workers=1),
        structured=_structured(hf_tokenizer),
        max_model_len=2048,
        reasoning_parser="qwen3",
        **context,
    )
    return running(make_app(fake, tokenizer, loader=lambda: ready))


@pytest.fixture
async def client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    fake.script = Script(pieces=THOUGHT_PIECES)
    async with await serve(fake, hf_tokenizer) as ready:
        yield ready


def prompt_text(fake: FakeEngine, hf_tokenizer: Any) -> str:
    return str(hf_tokenizer.decode(fake.submitted[-1].prompt_token_ids))


async def test_the_thought_is_a_reasoning_item_before_the_message(client: httpx.AsyncClient) -> None:
    response = await client.post(RESPONSES, json=body())
    assert response.status_code == 200, response.text
    answer = Response.model_validate(response.json())
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    thought = answer.output[0]
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert thought.content is not None and thought.content[0].type == "reasoning_text"
    assert thought.content[0].text.strip() == "Let me think."
    assert answer.output_text.strip() == "Paris is sunny"
    usage = answer.usage
    assert usage is not None and usage.output_tokens == len(THOUGHT_PIECES)
    # The thought's four pieces and its end marker (the tokens before the answer).
    assert usage.output_tokens_details.reasoning_tokens == 5


async def test_a_stream_sends_the_reasoning_events_then_the_message(client: httpx.AsyncClient) -> None:
    events = events_of(await client.post(RESPONSES, json=body(stream=True)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.reasoning_text.delta")
    texts = kinds.count("response.output_text.delta")
    assert deltas >= 1 and texts >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * texts,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert streamed == done.text and streamed.strip() == "Let me think."
    assert all(e.output_index == 0 for e in events if e.type.startswith("response.reasoning_text"))
    assert all(e.output_index == 1 for e in events if e.type.startswith("response.output_text"))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == streamed and final.output_text.strip() == "Paris is sunny"
    assert final.usage.output_tokens_details.reasoning_tokens == 5


async def test_effort_reaches_the_template_and_is_echoed(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    response = await client.post(RESPONSES, json=body(reasoning={"effort": "high", "summary": "auto"}))
    assert response.status_code == 200, response.text
    assert "Reasoning effort: high" in prompt_text(fake, hf_tokenizer)
    assert response.json()["reasoning"] == {"effort": "high", "summary": "auto"}
    response = await client.post(RESPONSES, json=body(reasoning={"summary": "concise"}))
    assert response.status_code == 200, response.text
    assert "Reasoning effort" not in prompt_text(fake, hf_tokenizer)
    # What a client keeping no state sends (the Agents SDK with store=False): the thought comes in the clear.
    fields = {"store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"effort": None}}
    response = await client.post(RESPONSES, json=body(**fields))
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"].strip() == "Let me think."


BAD_REASONING: list[tuple[Any, str]] = [
    ({"effort": "extreme"}, "reasoning.effort"),  # not a value the chat field takes
    ({"effort": 3}, "reasoning.effort"),
    ({"summary": "verbose"}, "reasoning.summary"),
    ({"mode": "pro"}, "reasoning.mode"),
    ("high", "reasoning"),
]


async def test_a_bad_reasoning_setting_is_a_400(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    for reasoning, param in BAD_REASONING:
        assert_error(await client.post(RESPONSES, json=body(reasoning=reasoning)), 400, param=param)
    assert not fake.submitted


async def test_earlier_thoughts_reach_the_template_which_drops_them(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}
    turn = [{"role": "user", "content": "Hi"}, thought, {"role": "assistant", "content": "Hello"}]
    # The template shows the thought of a final assistant message only (continued, here)...
    response = await client.post(RESPONSES, json=body(input=turn))
    assert response.status_code == 200, response.text
    assert "<think>\nHm.\n</think>" in prompt_text(fake, hf_tokenizer)
    # ...and drops it once the conversation goes on.
    response = await client.post(RESPONSES, json=body(input=[*turn, {"role": "user", "content": "And?"}]))
    assert response.status_code == 200, response.text
    prompt = prompt_text(fake, hf_tokenizer)
    assert "Hm." not in prompt and "Hello" in prompt and "And?" in prompt


async def test_previous_response_id_keeps_the_thought_from_the_next_prompt(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    first = (await client.post(RESPONSES, json=body())).json()
    response = await client.post(RESPONSES, json=body(input="And tomorrow?", previous_response_id=first["id"]))
    assert response.status_code == 200, response.text
    prompt = prompt_text(fake, hf_tokenizer)
    assert "Paris is sunny" in prompt and "And tomorrow?" in prompt
    assert "Let me think" not in prompt


async def test_a_thought_without_its_answer_is_a_400(client: httpx.AsyncClient) -> None:
    lone = {"type": "reasoning", "summary": []}
    for items in ([lone], [{"role": "user", "content": "Hi"}, lone, {"role": "user", "content": "?"}]):
        assert_error(await client.post(RESPONSES, json=body(input=items)), 400, param="input")


async def test_a_schema_is_enforced_after_the_thought(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema}}
    fake.script = Script(pieces=["Hm", "</think>", '{"city": "Paris"}'])
    response = await client.post(RESPONSES, json=body(text=text))
    assert response.status_code == 200, response.text
    assert Response.model_validate(response.json()).output_text == '{"city": "Paris"}'
    constraint = fake.submitted[-1].constraint
    assert constraint is not None
    logits = torch.zeros(len(hf_tokenizer))
    constraint.mask(logits)
    # Free text first (a bare schema would allow only its opening brace), not yet the end.
    assert logits[hf_tokenizer.encode("Hello", add_special_tokens=False)[0]] == 0
    assert logits[hf_tokenizer.eos_token_id] == float("-inf")


def image_input(**image: Any) -> list[dict[str, Any]]:
    parts = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", **image}]
    return [{"role": "user", "content": parts}]


async def test_input_images_reach_a_vision_model_as_image_parts(fake: FakeEngine, hf_tokenizer: Any) -> None:
    vision = FakeVision()
    async with await serve(fake, hf_tokenizer, vision=vision) as client:
        url = "data:image/png;base64,iVBORw0KGgo="
        response = await client.post(RESPONSES, json=body(input=image_input(image_url=url, detail="low")))
        assert response.status_code == 200, response.text
    [message] = vision.messages
    assert message.text() == "What is this?"
    [image] = message.images()
    assert isinstance(image, ImagePart) and image.image_url.url == url and image.image_url.detail == "low"


REFUSED_IMAGES: list[dict[str, Any]] = [
    {"image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"},  # a text model reads no images
    {"file_id": "file_1"},
    {"detail": "auto"},
    {"image_url": "data:image/png;base64,AAAA", "detail": "huge"},
    {"image_url": 3},
]


async def test_images_a_text_model_or_the_protocol_refuses_are_a_400(
    client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    for image in REFUSED_IMAGES:
        error = assert_error(await client.post(RESPONSES, json=body(input=image_input(**image))), 400, param="input")
        if "file_id" in image:
            assert "file_id" in error["message"], error
    assert "does not read images" in error_of_first(
        await client.post(RESPONSES, json=body(input=image_input(**REFUSED_IMAGES[0])))
    )
    assert not fake.submitted


def error_of_first(response: httpx.Response) -> str:
    return str(response.json()["error"]["message"])


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_a_forced_call_after_the_thought_and_the_round_trip(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    fake.script = Script(pieces=["Paris", " first", "</think>", "\n\n", CALL])
    fields = {"tools": [WEATHER], "tool_choice": "required"}
    events = events_of(await client.post(RESPONSES, json=body(stream=True, **fields)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "function_call"]
    assert done[0].content[0].text.strip() == "Paris first" and done[1].name == "get_weather"
    assert fake.submitted[-1].constraint is not None
    first = events[-1].response
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    output = {"type": "function_call_output", "call_id": done[1].call_id, "output": "sunny"}
    fake.script = Script(pieces=THOUGHT_PIECES)
    response = await client.post(RESPONSES, json=body(input=[output], previous_response_id=first.id))
    assert response.status_code == 200, response.text
    prompt = prompt_text(fake, hf_tokenizer)
    assert "sunny" in prompt and "Paris first" not in prompt  # the earlier thought is dropped by the template


async def test_an_answer_cut_while_thinking_streams_its_items_in_order(client: httpx.AsyncClient) -> None:
    events = events_of(await client.post(RESPONSES, json=body(stream=True, max_output_tokens=3)))
    assert events[-1].type == "response.incomplete"
    opened = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    closed = [(e.output_index, e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"]
    assert opened == [(0, "reasoning"), (1, "message")]
    assert closed == [(0, "reasoning", "incomplete"), (1, "message", "incomplete")]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ""
    assert final.output[0].content[0].text == "Let me think"
    assert final.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens == 3
