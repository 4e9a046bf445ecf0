"""Non-streaming chat completions: response shape, usage, fan-out over n, prompts through the chat template."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx

from tests.app.fake_engine import FIRST_TOKEN_ID, FakeEngine, Script
from tests.app.support import CHAT, MAX_MODEL_LEN, MODEL, chat_body
from transformers_openai.engine.request import FinishReason


def template_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


async def test_response_shape_and_exact_usage(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "Hello, world"}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    [submitted] = fake.submitted
    prompt_len = len(submitted.prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3}
    assert not fake.in_flight


async def test_served_without_v1_too(client: httpx.AsyncClient) -> None:
    response = await client.post("/chat/completions", json=chat_body())
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"
    assert (await client.post("/completions", json={"model": MODEL, "prompt": "Hi"})).status_code == 200


async def test_finish_reason_comes_from_the_engine(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=["a", "b"], finish_reason=FinishReason.LENGTH)
    body = (await client.post(CHAT, json=chat_body())).json()
    assert body["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_reaches_the_engine(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    body = (await client.post(CHAT, json=chat_body(max_tokens=2))).json()
    assert fake.submitted[0].params.max_tokens == 2
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello,"},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"]["completion_tokens"] == 2


async def test_max_completion_tokens_wins_over_max_tokens(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    await client.post(CHAT, json=chat_body(max_tokens=9, max_completion_tokens=4))
    assert fake.submitted[0].params.max_tokens == 4


async def test_unset_max_tokens_is_the_rest_of_the_context(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    await client.post(CHAT, json=chat_body())
    [submitted] = fake.submitted
    assert submitted.params.max_tokens == MAX_MODEL_LEN - len(submitted.prompt_token_ids)


async def test_sampling_params_reach_the_engine(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": "END", "presence_penalty": 0.5, "seed": 3}
    await client.post(CHAT, json=chat_body(**fields, logit_bias={"42": -100}))
    params = fake.submitted[0].params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 40, 3)
    assert params.stop == ("END",)
    assert params.presence_penalty == 0.5
    assert params.logit_bias == {42: -100.0}


async def test_n_with_seed_gives_distinct_seeded_choices(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    body = (await client.post(CHAT, json=chat_body(n=3, seed=7))).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello, world" for c in body["choices"])
    assert len(fake.submitted) == 3
    assert len({r.request_id for r in fake.submitted}) == 3
    assert Counter(r.params.seed for r in fake.submitted) == Counter([7, 8, 9])
    prompt_len = len(fake.submitted[0].prompt_token_ids)
    assert all(r.prompt_token_ids == fake.submitted[0].prompt_token_ids for r in fake.submitted)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 9, "total_tokens": prompt_len + 9}


async def test_n_without_seed_leaves_seeding_to_the_engine(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    await client.post(CHAT, json=chat_body(n=2))
    assert [r.params.seed for r in fake.submitted] == [None, None]


async def test_prompt_is_the_chat_template_with_generation_prompt(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert (await client.post(CHAT, json=chat_body(messages=messages))).status_code == 200
    assert fake.submitted[0].prompt_token_ids == template_ids(hf_tokenizer, messages)


async def test_developer_role_is_treated_as_system(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert (await client.post(CHAT, json=chat_body(messages=messages))).status_code == 200
    as_system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert fake.submitted[0].prompt_token_ids == template_ids(hf_tokenizer, as_system)


async def test_content_as_text_parts(client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke"}]
    response = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": parts}]))
    assert response.status_code == 200
    expected = template_ids(hf_tokenizer, [{"role": "user", "content": "Tell me a joke"}])
    assert fake.submitted[0].prompt_token_ids == expected


async def test_logprobs_with_top_logprobs(client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any) -> None:
    body = (await client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2))).json()
    assert fake.submitted[0].params.logprobs == 2
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    first = content[0]
    token = hf_tokenizer.decode([FIRST_TOKEN_ID])
    assert first["token"] == token
    assert first["logprob"] == -0.5
    assert first["bytes"] == list(token.encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.5]
    assert first["top_logprobs"][0]["token"] == token
