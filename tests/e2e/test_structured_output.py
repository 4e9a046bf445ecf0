"""response_format through the real server and the openai client: answers that validate, batched with free ones."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from pydantic import BaseModel, Field

from tests.e2e.conftest import async_client, sync_client
from tests.e2e.fuzz_schema import nasty_schemas
from tests.e2e.server import ServerProcess
from tests.schemas import COSTLY, SCHEMAS

QUESTIONS = [
    "Describe a person.",
    "Pick a color.",
    "Tag this article about gardening.",
    "Is water wet?",
    "Score this student.",
    "Make a small order.",
    "How urgent is this?",
    "Give me some numbers.",
    "What is the capital of France?",
    "Forecast the weather in Paris.",
]
FREE = ["Tell me a joke.", "Write a haiku about autumn leaves.", "What is a hash table?"]
T = TypeVar("T")


def json_format(schema: dict[str, Any], name: str = "answer") -> ResponseFormatJSONSchema:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.slow
def test_fifty_schema_bound_answers_validate_and_free_answers_are_unchanged(smollm2_server: ServerProcess) -> None:
    client = async_client(smollm2_server)

    async def free(prompt: str) -> str | None:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
        response = await client.chat.completions.create(
            model="test-model", messages=messages, max_tokens=40, temperature=0
        )
        return response.choices[0].message.content

    async def constrained(i: int) -> tuple[dict[str, Any], str | None, str | None]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}
        ]
        response = await client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=400,
            temperature=0.8,
            seed=i,
            response_format=json_format(schema),
        )
        choice = response.choices[0]
        return schema, choice.message.content, choice.finish_reason

    async def everything() -> tuple[
        list[str | None], list[tuple[dict[str, Any], str | None, str | None]], list[str | None]
    ]:
        alone = [await free(prompt) for prompt in FREE]
        room = asyncio.Semaphore(40)  # within the server's 16 running + 32 queued

        async def limited(coro: Awaitable[T]) -> T:
            async with room:
                return await coro

        # The free requests go in first, so they decode beside grammar-bound rows all the way.
        busy, answers = await asyncio.gather(
            asyncio.gather(*(limited(free(p)) for p in FREE)),
            asyncio.gather(*(limited(constrained(i)) for i in range(50))),
        )
        return alone, answers, busy

    alone, answers, busy = asyncio.run(everything())
    for schema, content, finish_reason in answers:
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content or ""), schema)
    assert len({content for _, content, _ in answers}) > 10  # real, varied answers
    assert busy == alone  # the free requests' greedy answers are the same in a batch full of grammars


class Weather(BaseModel):
    city: str = Field(max_length=30)
    temperature_c: int = Field(ge=-50, le=60)
    sunny: bool


@pytest.mark.slow
def test_parse_with_a_pydantic_model_and_a_streamed_answer(smollm2_server: ServerProcess) -> None:
    client = sync_client(smollm2_server)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Rome today?"}]
    parsed = client.chat.completions.parse(
        model="test-model", messages=messages, response_format=Weather, max_tokens=200, temperature=0
    )
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and weather.city
    stream = client.chat.completions.create(
        model="test-model",
        messages=messages,
        max_tokens=200,
        temperature=0,
        stream=True,
        response_format=json_format(Weather.model_json_schema(), "weather"),
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert Weather.model_validate_json(text) == weather


def test_a_schema_that_cannot_be_used_is_a_400(tiny_server: ServerProcess) -> None:
    client = sync_client(tiny_server)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            response_format=json_format({"type": "nonsense"}),
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format" and "nonsense" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body={"response_format": {"type": "json_schema"}},  # no json_schema: past the typed client
        )
    assert "json_schema" in str(caught.value)


def test_costly_grammars_end_alone_and_do_not_stall_a_plain_stream(tiny_server: ServerProcess) -> None:
    """A plain stream beside 8 requests whose grammar costs 5-7 ms a mask mid-answer takes at most 1.5x its time
    alone: those
    rows end with an in-stream 400 (grammar_failed) once their masks pass the budget, the plain stream goes on."""
    client = async_client(tiny_server)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story."}]

    async def plain() -> float:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=800,  # 2-4 s alone on 2 cores, as the stream (4.0 s)
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
        assert finish[-1] == "length"
        return time.perf_counter() - start

    async def costly() -> object:
        stream = await client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=400,
            temperature=0,
            stream=True,
            response_format=json_format(COSTLY),
        )
        try:
            async for _ in stream:
                pass
        except openai.APIError as exc:
            return exc.body
        return None

    async def beside() -> tuple[float, list[object]]:
        timed = asyncio.create_task(plain())
        await asyncio.sleep(0.05)  # the plain stream runs first, the costly rows join its batch
        errors = await asyncio.gather(*(costly() for _ in range(8)))
        return await timed, list(errors)

    async def everything() -> tuple[float, float, list[object]]:
        await plain()  # warm
        before = await plain()
        with_costly, errors = await beside()
        after = await plain()  # alone again: the mean of both, as a shared machine's load drifts
        return (before + after) / 2, with_costly, errors

    alone, with_costly, errors = asyncio.run(everything())
    print(f"a plain stream of 800 tokens: {alone:.2f} s alone, {with_costly:.2f} s beside 8 costly grammars")
    for error in errors:
        assert isinstance(error, dict) and error["type"] == "invalid_request_error", error
        assert error["code"] == "grammar_failed" and "too costly" in error["message"]
    assert with_costly <= 1.5 * alone, (alone, with_costly)


def test_grammar_failures_and_limits_are_400s(tiny_server: ServerProcess) -> None:
    client = sync_client(tiny_server)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:  # fails mid-answer, not streamed: a 400 all the same
        client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=400,
            response_format=json_format(COSTLY),
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "grammar_failed"
    with pytest.raises(openai.BadRequestError) as caught:  # past llguidance's limits: refused before any token
        client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=5,
            response_format=json_format({"type": "string", "pattern": "^x{50000}$"}),
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "response_format" and "lexer" in body["message"]
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(openai.BadRequestError) as caught:  # over --max-schema-bytes (64 KiB)
        client.chat.completions.create(
            model="test-model",
            messages=messages,
            max_tokens=5,
            response_format=json_format(huge),
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "schema_too_large" and "65,536" in body["message"]
    answer = client.chat.completions.create(  # the server goes on
        model="test-model",
        messages=messages,
        max_tokens=40,
        response_format=json_format(SCHEMAS[0]),
    )
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMAS[0])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_nasty_schemas_get_answers_or_400s_never_5xx(tiny_server: ServerProcess, stream: bool) -> None:
    messages = [{"role": "user", "content": "hi"}]
    statuses = {}
    for name, schema in nasty_schemas().items():
        body = {
            "model": "test-model",
            "messages": messages,
            "max_tokens": 30,
            "stream": stream,
            "response_format": json_format(schema),
        }
        response = httpx.post(f"{tiny_server.base_url}/chat/completions", json=body, timeout=60)
        status = response.status_code
        if status == 200 and stream and '"error"' in response.text:  # failed mid-answer: the error event's shape
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
            status = 400 if json.loads(events[-1])["error"]["type"] == "invalid_request_error" else 500
        elif status == 400:
            assert response.json()["error"]["type"] == "invalid_request_error"
        statuses[name] = status
    assert set(statuses.values()) <= {200, 400}, statuses
    refused = ("over the size cap", "past the lexer's limits", "costly from the first token", "costly mid-answer")
    assert [statuses[name] for name in refused] == [400] * len(refused), statuses
    assert statuses["only annotated"] == statuses["empty"] == 200
    assert tiny_server.process.poll() is None and tiny_server.engine_state()  # still up and answering
