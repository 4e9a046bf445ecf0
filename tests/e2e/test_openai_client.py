"""The official openai client against the real server: chat and completions, streaming and not."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e import reference
from tests.e2e.conftest import Served, sync_client
from tests.e2e.server import ServerProcess


def test_models_listing(tiny_server: ServerProcess) -> None:
    client = sync_client(tiny_server)
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_streaming_equals_non_streaming(served: Served) -> None:
    client = sync_client(served.server)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there!"},
    ]
    full = client.chat.completions.create(model="test-model", messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model="test-model",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage == full.usage
    assert full.usage is not None
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completions_streaming_equals_non_streaming(served: Served) -> None:
    client = sync_client(served.server)
    prompt = "The weather today is"
    full = client.completions.create(model="test-model", prompt=prompt, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(model="test-model", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.choices[0].finish_reason in {"stop", "length"}


def test_stop_strings_cut_the_output(tiny_server: ServerProcess, tiny_llama_dir: Path) -> None:
    client = sync_client(tiny_server)
    prompt = "List three fruits."
    free, _ = reference.greedy_text(tiny_llama_dir, reference.text_prompt_ids(tiny_llama_dir, prompt), 30)
    stop = free[10:14]  # a piece of text the model will produce, likely spanning tokens
    assert len(stop) == 4
    for stream in (False, True):
        result = client.completions.create(
            model="test-model", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=stream
        )
        if isinstance(result, openai.Stream):
            chunks = list(result)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = result.choices[0].text, result.choices[0].finish_reason
        assert text == free[: free.index(stop)]
        assert reason == "stop"


def test_logprobs_and_n(served: Served) -> None:
    client = sync_client(served.server)
    chat = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        n=2,
        temperature=0.8,
        seed=7,
    )
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5 or choice.finish_reason == "stop"
        for item in choice.logprobs.content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 3
    completion = client.completions.create(model="test-model", prompt="Hi", max_tokens=4, logprobs=2, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert completion.usage is not None and len(logprobs.tokens) == completion.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_errors_are_openai_errors(tiny_server: ServerProcess) -> None:
    client = sync_client(tiny_server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "x"}], temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="test-model", prompt="hello " * 100, max_tokens=5000)
    assert too_long.value.code == "context_length_exceeded"
    ok = client.completions.create(model="test-model", prompt="still fine?", max_tokens=3)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm2_server: ServerProcess) -> None:
    client = sync_client(smollm2_server)
    chat = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in (chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    completion = client.completions.create(
        model="test-model", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in completion.choices[0].text


def test_seq2seq_rejects_echo_and_serves_chat(tiny_t5_server: ServerProcess) -> None:
    client = sync_client(tiny_t5_server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="test-model", prompt="Q: hi", echo=True, max_tokens=4)
    assert bad.value.param == "echo"
    chat = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Q: what is 2+2?"}], max_tokens=8, temperature=0
    )
    assert (
        chat.usage is not None
        and chat.usage.completion_tokens >= 1
        and chat.choices[0].finish_reason in {"stop", "length"}
    )
