"""Non-streaming text completions: shape, usage, prompts as text or token ids, prompts x n, echo, logprobs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx

from tests.app.fake_engine import FIRST_TOKEN_ID, FakeEngine
from tests.app.support import COMPLETIONS, MODEL, completion_body


async def test_response_shape_and_exact_usage(client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any) -> None:
    response = await client.post(COMPLETIONS, json=completion_body())
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, "Hello, world", "stop")
    assert choice["logprobs"] is None
    [submitted] = fake.submitted
    assert submitted.prompt_token_ids == hf_tokenizer.encode("Once upon a time")
    prompt_len = len(submitted.prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3}


async def test_unset_max_tokens_defaults_to_16(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    await client.post(COMPLETIONS, json=completion_body())
    assert fake.submitted[0].params.max_tokens == 16


async def test_prompts_times_n_give_indices_p_times_n_plus_i(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    prompts = ["The cat", "A dog ran"]
    body = (await client.post(COMPLETIONS, json=completion_body(prompt=prompts, n=2, seed=5, echo=True))).json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        prompt = prompts[choice["index"] // 2]
        assert choice["text"] == prompt + "Hello, world"
    assert len(fake.submitted) == 4
    assert Counter(r.params.seed for r in fake.submitted) == Counter([5, 5, 6, 6])
    prompt_tokens = sum(len(hf_tokenizer.encode(p)) for p in prompts)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
    }


async def test_token_id_prompt(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    body = (await client.post(COMPLETIONS, json=completion_body(prompt=[1, 2, 3]))).json()
    assert fake.submitted[0].prompt_token_ids == [1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"] == "Hello, world"


async def test_list_of_token_id_lists(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    body = (await client.post(COMPLETIONS, json=completion_body(prompt=[[1, 2], [3, 4, 5]]))).json()
    assert sorted(r.prompt_token_ids for r in fake.submitted) == [[1, 2], [3, 4, 5]]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 6


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient) -> None:
    body = (await client.post(COMPLETIONS, json=completion_body(echo=True))).json()
    assert body["choices"][0]["text"] == "Once upon a timeHello, world"


async def test_echo_of_a_token_id_prompt_decodes_it(client: httpx.AsyncClient, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode("Hello there")
    body = (await client.post(COMPLETIONS, json=completion_body(prompt=ids, echo=True))).json()
    assert body["choices"][0]["text"] == "Hello thereHello, world"


async def test_logprobs(client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any) -> None:
    body = (await client.post(COMPLETIONS, json=completion_body(logprobs=2))).json()
    assert fake.submitted[0].params.logprobs == 2
    logprobs = body["choices"][0]["logprobs"]
    tokens = [hf_tokenizer.decode([FIRST_TOKEN_ID + k]) for k in range(3)]
    assert logprobs["tokens"] == tokens
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
