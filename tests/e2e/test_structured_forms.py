"""Choice lists, regexes and grammars on SmolLM2: every answer matches its constraint, for chat, completions and
Responses, streamed and not, with requests of different constraints batched together (and a free one beside)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess

SENTIMENTS = ["positive", "negative", "neutral"]
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
# A list of one to five digits separated by commas, as GBNF (llama.cpp's) and as the regex that says the same.
DIGITS_GBNF = 'root ::= digit ("," digit){0,4}\ndigit ::= [0-9]'
DIGITS = r"[0-9](,[0-9]){0,4}"
# Colours in llguidance's Lark, with rules and a terminal; the regex that says the same.
COLOURS_LARK = 'start: colour (", " colour){0,2} "."\ncolour: "red" | "green" | "blue" | OTHER\nOTHER: /[a-z]{3,6}/'
COLOURS = r"[a-z]{3,6}(, [a-z]{3,6}){0,2}\."
MAX_TOKENS = 24  # every constraint above ends well within it

Check = Callable[[str], bool]
# (what to ask, the request's constraint fields, what every answer must satisfy)
CASES: list[tuple[str, dict[str, Any], Check]] = [
    ("Is 'I love this film' positive or negative?", {"choice": SENTIMENTS}, lambda text: text in SENTIMENTS),
    ("When did the Berlin wall fall? Give the date.", {"regex": DATE}, lambda text: bool(re.fullmatch(DATE, text))),
    ("List a few digits.", {"grammar": DIGITS_GBNF}, lambda text: bool(re.fullmatch(DIGITS, text))),
    ("Name some colours.", {"grammar": COLOURS_LARK}, lambda text: bool(re.fullmatch(COLOURS, text))),
]


async def chat(client: AsyncOpenAI, question: str, fields: dict[str, Any], stream: bool, seed: int) -> tuple[str, str]:
    messages: Any = [{"role": "user", "content": question}]
    extra = {"structured_outputs": fields}
    common: Any = {"model": "test-model", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.8}
    if not stream:
        reply = await client.chat.completions.create(**common, seed=seed, extra_body=extra)
        return reply.choices[0].message.content or "", str(reply.choices[0].finish_reason)
    chunks = await client.chat.completions.create(**common, seed=seed, extra_body=extra, stream=True)
    text, finish = "", ""
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def completion(
    client: AsyncOpenAI, question: str, fields: dict[str, Any], stream: bool, seed: int
) -> tuple[str, str]:
    prompt = f"Question: {question}\nAnswer: "
    common: Any = {"model": "test-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed}
    extra = {f"guided_{kind}": value for kind, value in fields.items()}  # vLLM's older names, here
    if not stream:
        reply = await client.completions.create(**common, extra_body=extra)
        return reply.choices[0].text, str(reply.choices[0].finish_reason)
    chunks = await client.completions.create(**common, extra_body=extra, stream=True)
    text, finish = "", ""
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def response(
    client: AsyncOpenAI, question: str, fields: dict[str, Any], stream: bool, seed: int
) -> tuple[str, str]:
    common: Any = {"model": "test-model", "input": question, "max_output_tokens": MAX_TOKENS, "temperature": 0.8}
    extra = {"structured_outputs": fields}
    if not stream:
        reply = await client.responses.create(**common, extra_body=extra)
        return reply.output_text, reply.status or ""
    events = await client.responses.create(**common, extra_body=extra, stream=True)
    text, status = "", ""
    async for event in events:
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            status = event.response.status or ""
            assert event.response.output_text == text
    return text, status


Ask = Callable[[AsyncOpenAI, str, dict[str, Any], bool, int], Awaitable[tuple[str, str]]]
DONE = {chat: "stop", completion: "stop", response: "completed"}


@pytest.mark.slow
def test_choice_regex_and_grammar_answers_always_match_batched(smollm2_server: ServerProcess) -> None:
    """Every endpoint runs every constraint, streamed for half of them: 24 requests at once, and a free one."""
    client = async_client(smollm2_server)
    asks: list[tuple[str, Ask, str, Check, Awaitable[tuple[str, str]]]] = []
    for e, ask in enumerate((chat, completion, response)):
        for c, (question, fields, check) in enumerate(CASES):
            for stream in (False, True):
                seed = 10 * e + 2 * c + stream
                name = f"{ask.__name__} {next(iter(fields))} {'streamed' if stream else 'whole'}"
                asks.append((name, ask, DONE[ask], check, ask(client, question, fields, stream, seed)))

    async def everything() -> tuple[list[tuple[str, str]], Any]:
        free = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=MAX_TOKENS
        )
        return await asyncio.gather(asyncio.gather(*(a[4] for a in asks)), free)

    answers, free = asyncio.run(everything())
    for (name, _, done, check, _), (text, finish) in zip(asks, answers, strict=True):
        print(f"{name}: {text!r} ({finish})")
        assert finish == done and check(text), (name, text, finish)
    assert free.choices[0].message.content  # the free row beside them answered
    assert len({text for text, _ in answers}) > 8  # real, varied answers, not one forced string
