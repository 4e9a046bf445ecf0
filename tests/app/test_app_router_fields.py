"""The fields vLLM's router (vllm-router 0.1.17) writes into every request it forwards, as captured from it: accepted
at the values it sends, honoured where this server has the meaning, a 400 naming the field for a value it cannot
honour; other unknown fields still get their 400. (The reasoning fields' effect: tests/app/test_app_reasoning.py.)"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, assert_error, chat_body, completion_body, sse_chunks

# What vllm-router added to a plain `{"model", "messages", "max_tokens"}` and `{"model", "prompt", "max_tokens"}`.
CHAT_ADDED = {
    "stream": False,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
COMPLETIONS_ADDED = {
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
MESSAGES = [{"role": "user", "content": "Write a word"}, {"role": "assistant", "content": "Once"}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, chat_body(max_tokens=5, **CHAT_ADDED)), (COMPLETIONS, completion_body(max_tokens=5, **COMPLETIONS_ADDED))],
    ids=["chat", "completions"],
)
async def test_what_the_router_forwards_is_served(
    client: httpx.AsyncClient, fake: FakeEngine, path: str, body: dict[str, Any], stream: bool
) -> None:
    response = await client.post(path, json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        assert sse_chunks(response.text)
    params = fake.submitted[0].params
    assert not params.ignore_eos and params.skip_special_tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat_body(no_stop_trim=True), "no_stop_trim"),
        (COMPLETIONS, completion_body(no_stop_trim=True), "no_stop_trim"),
        (CHAT, chat_body(return_hidden_states=True), "return_hidden_states"),
        (COMPLETIONS, completion_body(return_hidden_states=True), "return_hidden_states"),
        (CHAT, chat_body(stream_reasoning="no"), "stream_reasoning"),
        (CHAT, chat_body(include_reasoning=0), "include_reasoning"),
        (CHAT, chat_body(continue_final_message=True), "continue_final_message"),  # with a generation prompt
        (COMPLETIONS, completion_body(include_reasoning=True), "include_reasoning"),  # a chat field only
        (CHAT, chat_body(**CHAT_ADDED, frobnicate=1), "frobnicate"),
    ],
)
async def test_a_value_this_server_cannot_honour_is_a_400_naming_the_field(
    client: httpx.AsyncClient, fake: FakeEngine, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_error(await client.post(path, json=body), 400, param=param)
    assert param in error["message"]
    assert not fake.submitted


@pytest.mark.parametrize("field", ["separate_reasoning", "stream_reasoning", "include_reasoning"])
async def test_each_reasoning_field_is_accepted_at_either_value(client: httpx.AsyncClient, field: str) -> None:
    """Without a reasoning format (this tokenizer's template writes no thought) they change nothing."""
    for stream in (False, True):
        response = await client.post(CHAT, json=chat_body(**{**CHAT_ADDED, field: False, "stream": stream}))
        assert response.status_code == 200, response.text
        if not stream:
            assert response.json()["choices"][0]["message"]["content"] == "Hello, world"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_ignore_eos_and_skip_special_tokens_are_honoured(
    client: httpx.AsyncClient, fake: FakeEngine, path: str
) -> None:
    body = chat_body(**CHAT_ADDED) if path == CHAT else completion_body(**COMPLETIONS_ADDED)
    response = await client.post(path, json={**body, "ignore_eos": True, "skip_special_tokens": False})
    assert response.status_code == 200, response.text
    params = fake.submitted[0].params
    assert params.ignore_eos and not params.skip_special_tokens


async def test_continue_final_message_continues_the_assistant_message(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    body = chat_body(messages=MESSAGES, add_generation_prompt=False, continue_final_message=True)
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    rendered = hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert rendered.endswith("Once")
    assert fake.submitted[0].prompt_token_ids == hf_tokenizer.encode(rendered, add_special_tokens=False)


async def test_add_generation_prompt_false_ends_after_the_last_message(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    assert (await client.post(CHAT, json=chat_body(messages=MESSAGES[:1]))).status_code == 200
    response = await client.post(CHAT, json=chat_body(messages=MESSAGES[:1], add_generation_prompt=False))
    assert response.status_code == 200, response.text
    rendered = hf_tokenizer.apply_chat_template(MESSAGES[:1], add_generation_prompt=False, tokenize=False)
    with_prompt, without = (list(request.prompt_token_ids) for request in fake.submitted)
    assert without == hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert len(without) < len(with_prompt) and with_prompt[: len(without)] == without
