"""Multi-turn round trips with the real openai client: the message it returns goes back into the history as is."""

from __future__ import annotations

from typing import Any

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess


def test_a_reply_and_a_streamed_reply_go_back_into_the_history(tiny_server: ServerProcess) -> None:
    client = sync_client(tiny_server)
    # The history as clients hand it back: replies as dumped dicts, later LiteLLM's own shape, not the SDK's params.
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    # The helper parses only replies that stopped (not cut at max_tokens): stop at the first space.
    with client.chat.completions.stream(
        model=tiny_server.model, messages=messages, max_tokens=64, temperature=0, stop=[" "]
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "stop"
    messages += [streamed.choices[0].message.model_dump(), {"role": "user", "content": "Thanks."}]
    third = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=4)
    assert third.choices[0].finish_reason in ("length", "stop")
    assert first.usage is not None and third.usage is not None
    assert third.usage.prompt_tokens > first.usage.prompt_tokens
    # LiteLLM hands back its own message shape: nulls for what did not happen, and a key of its own.
    litellm_message = {
        "role": "assistant",
        "content": third.choices[0].message.content,
        "tool_calls": None,
        "function_call": None,
        "provider_specific_fields": {"refusal": None},
    }
    messages += [litellm_message, {"role": "user", "content": "Bye."}]
    fourth = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=4)
    assert fourth.usage is not None and fourth.usage.prompt_tokens > third.usage.prompt_tokens
