"""/tokenize and /detokenize (vLLM's shapes): the tokens generation would see, counted and listed, and back."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import (
    CHAT,
    COMPLETIONS,
    MAX_MODEL_LEN,
    MODEL,
    assert_error,
    chat_body,
    completion_body,
    make_app,
    make_context,
    running,
)
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.tokenizer import TokenizerService

T = TypeVar("T")

TOOL_TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "paint", "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}}},
    }
]


@pytest.mark.parametrize("prefix", ["", "/v1"])
async def test_a_prompt_is_tokenized_as_completions_submit_it(
    client: httpx.AsyncClient, fake: FakeEngine, prefix: str
) -> None:
    prompt = "Once upon a time, in a land"
    response = await client.post(f"{prefix}/tokenize", json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (await client.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=1))).status_code == 200
    assert body["tokens"] == fake.submitted[-1].prompt_token_ids
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None


async def test_special_tokens_and_token_strings_follow_the_flags(client: httpx.AsyncClient, hf_tokenizer: Any) -> None:
    prompt = "Hello there"
    plain = (await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})).json()
    assert plain["tokens"] == hf_tokenizer.encode(prompt, add_special_tokens=False)
    full = (await client.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})).json()
    assert full["tokens"] == hf_tokenizer.encode(prompt)
    assert full["token_strs"] == hf_tokenizer.convert_ids_to_tokens(full["tokens"])


@pytest.fixture
async def tool_client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    tokenizer = copy.deepcopy(hf_tokenizer)  # the session's tokenizer keeps its own template
    context = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, TOOL_TEMPLATE.read_text()),
        max_model_len=2048,
    )
    async with running(make_app(fake, tokenizer, loader=lambda: context)) as ready:
        yield ready


async def test_messages_are_tokenized_as_chat_submits_them(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    counted = (await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
    assert (await client.post(CHAT, json=chat_body(messages=MESSAGES, max_tokens=1))).status_code == 200
    assert counted["tokens"] == fake.submitted[-1].prompt_token_ids
    assert counted["count"] == len(counted["tokens"])


async def test_offered_tools_are_rendered_as_chat_renders_them(
    tool_client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    plain = (await tool_client.post("/tokenize", json={"messages": MESSAGES})).json()
    counted = (await tool_client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})).json()
    response = await tool_client.post(CHAT, json=chat_body(messages=MESSAGES, tools=TOOLS, max_tokens=1))
    assert response.status_code == 200, response.text
    assert counted["tokens"] == fake.submitted[-1].prompt_token_ids
    assert counted["count"] > plain["count"]


async def test_tools_a_template_cannot_show_get_the_chat_error(client: httpx.AsyncClient) -> None:
    chat_error = assert_error(await client.post(CHAT, json=chat_body(messages=MESSAGES, tools=TOOLS)), 400, "tools")
    error = assert_error(await client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}), 400, "tools")
    assert error["message"] == chat_error["message"]


async def test_the_end_of_a_rendered_chat_follows_the_flags(client: httpx.AsyncClient, hf_tokenizer: Any) -> None:
    with_prompt = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
    body = {"messages": MESSAGES, "add_generation_prompt": False}
    without = (await client.post("/tokenize", json=body)).json()["tokens"]
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without == hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert len(without) < len(with_prompt) and with_prompt[: len(without)] == without
    both = {"messages": MESSAGES, "continue_final_message": True}
    assert_error(await client.post("/tokenize", json=both), 400)


# Writes a line the variable `mood` chooses, after the messages.
MOOD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if mood is defined %}Mood: {{ mood }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
async def mood_client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A server whose template reads `mood`, set to 'calm' for every request unless the request says otherwise."""
    tokenizer = copy.deepcopy(hf_tokenizer)
    context = replace(
        make_context(fake, tokenizer),
        tokenizer=TokenizerService(tokenizer, MOOD_TEMPLATE),
        default_template_kwargs={"mood": "calm"},
    )
    async with running(make_app(fake, tokenizer, loader=lambda: context)) as ready:
        yield ready


async def test_template_variables_are_rendered_as_chat_renders_them(
    mood_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    for variables in (None, {"mood": "stormy"}):
        extra = {} if variables is None else {"chat_template_kwargs": variables}
        counted = await mood_client.post("/tokenize", json={"messages": MESSAGES, **extra})
        assert counted.status_code == 200, counted.text
        response = await mood_client.post(CHAT, json=chat_body(messages=MESSAGES, max_tokens=1, **extra))
        assert response.status_code == 200, response.text
        assert counted.json()["tokens"] == fake.submitted[-1].prompt_token_ids
        mood = "calm" if variables is None else "stormy"
        assert f"Mood: {mood}" in hf_tokenizer.decode(counted.json()["tokens"])
    refused = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert_error(await mood_client.post("/tokenize", json=refused), 400, "chat_template_kwargs.add_generation_prompt")
    wrong_type = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "no"}}  # as chat refuses it
    assert_error(await mood_client.post("/tokenize", json=wrong_type), 400, "chat_template_kwargs.enable_thinking")


async def test_detokenize_gives_the_text_back(client: httpx.AsyncClient, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    response = await client.post("/v1/detokenize", json={"model": MODEL, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": hf_tokenizer.decode(ids)}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        ("/detokenize", {"tokens": ["7"]}, 400, None),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"messages": []}, 400, None),
        ("/tokenize", {"prompt": "x", "stream": True}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}, 400, None),
    ],
)
async def test_bad_bodies_get_openai_errors(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    assert_error(await client.post(path, json=body), status, param)


class SpyTokenizer(TokenizerService):
    """Counts every task handed to the tokenizer's pool (encoding, rendering, decoding)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.calls = 0

    async def _in_pool(self, fn: Callable[..., T], *args: Any) -> T:
        self.calls += 1
        return await super()._in_pool(fn, *args)


TOKEN_CHARS = 4
LIMITS = PromptLimits(
    max_messages=8, max_content_parts=8, max_prompt_tokens=MAX_MODEL_LEN, max_token_chars=TOKEN_CHARS, max_sequences=8
)


@pytest.fixture
def spy(hf_tokenizer: Any) -> SpyTokenizer:
    return SpyTokenizer(hf_tokenizer)


@pytest.fixture
async def limited(fake: FakeEngine, hf_tokenizer: Any, spy: SpyTokenizer) -> AsyncIterator[httpx.AsyncClient]:
    context = replace(make_context(fake, hf_tokenizer), tokenizer=spy, prompt_limits=LIMITS)
    async with running(make_app(fake, hf_tokenizer, loader=lambda: context)) as ready:
        yield ready


async def test_a_prompt_over_the_character_limit_is_refused_without_tokenizing(
    limited: httpx.AsyncClient, spy: SpyTokenizer
) -> None:
    most = MAX_MODEL_LEN * TOKEN_CHARS  # as /v1/completions bounds a prompt
    over = await limited.post("/tokenize", json={"prompt": "a" * (most + 1)})
    error = assert_error(over, 400, "prompt", "context_length_exceeded")
    completion = await limited.post(COMPLETIONS, json=completion_body(prompt="a" * (most + 1)))
    assert error["message"] == assert_error(completion, 400, "prompt")["message"]
    chat = {"messages": [{"role": "user", "content": "b" * (most // 2)}, {"role": "user", "content": "c" * most}]}
    assert_error(await limited.post("/tokenize", json=chat), 400, "messages", "context_length_exceeded")
    too_many = {"messages": [{"role": "user", "content": "hi"}] * 9}
    assert_error(await limited.post("/tokenize", json=too_many), 400, "messages", "too_many_messages")
    assert spy.calls == 0
    at_limit = await limited.post("/tokenize", json={"prompt": "a" * most})
    assert at_limit.status_code == 200 and spy.calls == 1


async def test_detokenize_takes_at_most_a_context_of_tokens(limited: httpx.AsyncClient, spy: SpyTokenizer) -> None:
    over = await limited.post("/detokenize", json={"tokens": [5] * (MAX_MODEL_LEN + 1)})
    error = assert_error(over, 400, "tokens", "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    assert spy.calls == 0
    assert (await limited.post("/detokenize", json={"tokens": [5] * MAX_MODEL_LEN})).status_code == 200
