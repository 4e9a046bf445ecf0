"""Chat with a reasoning model on the fake engine: the thought in reasoning_content (and reasoning), the answer in
content, streamed or not, with markers cut across pieces, tools after the thought, the thinking controls and the
reasoning fields of vLLM and SGLang, a tokenizer's own response_template."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import BASE_URL, CHAT, MAX_MODEL_LEN, MODEL, assert_error, chat_body, running, sse_chunks
from tests.reasoning_support import RESPONSE_TEMPLATE, THINK_TEMPLATE, THOUGHT_END, THOUGHT_START
from transformers_openai.api.app import create_app
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.tokenizer import TokenizerService
from transformers_openai.settings import Settings

# The template opened the thought: the model writes the rest of it, the end marker cut across three pieces.
THOUGHT_PIECES = ["Let me", " think</", "th", "ink>\n\nThe ", "answer."]
THOUGHT, ANSWER = "Let me think", "\n\nThe answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# A thought that writes a call as an example (not a call), then the call itself.
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOL_PIECES = ["Maybe <tool_call>{}</tool", "_call>. Call it.</thi", "nk>\n<tool_call>\n", CALL, "\n</tool_call>"]
TOOL_THOUGHT = "Maybe <tool_call>{}</tool_call>. Call it."


def _context(fake: FakeEngine, tokenizer: Any, **fields: Any) -> ServingContext:
    return ServingContext(
        engine=fake,
        tokenizer=TokenizerService(tokenizer, THINK_TEMPLATE, workers=1),
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=MAX_MODEL_LEN,
        model_kind="causal-lm",
        reasoning_parser="auto",
        **fields,
    )


@asynccontextmanager
async def _served(context: ServingContext) -> AsyncIterator[httpx.AsyncClient]:
    async with running(create_app(Settings(model=MODEL), loader=lambda: context)) as client:
        yield client


@pytest.fixture
async def client(fake: FakeEngine, hf_tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    fake.script = Script(pieces=THOUGHT_PIECES)
    async with _served(_context(fake, copy.deepcopy(hf_tokenizer))) as ready:
        yield ready


def _rendered(hf_tokenizer: Any, messages: list[dict[str, Any]], **variables: Any) -> str:
    return str(
        hf_tokenizer.apply_chat_template(
            messages, chat_template=THINK_TEMPLATE, add_generation_prompt=True, tokenize=False, **variables
        )
    )


def _prompt_text(fake: FakeEngine, hf_tokenizer: Any, index: int = -1) -> str:
    return str(hf_tokenizer.decode(fake.submitted[index].prompt_token_ids))


def _deltas(chunks: list[dict[str, Any]], key: str, index: int = 0) -> list[str]:
    return [
        c["choices"][0]["delta"][key]
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index and c["choices"][0]["delta"].get(key)
    ]


async def test_the_thought_and_the_answer_apart(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body())
    assert response.status_code == 200, response.text
    body = response.json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT, "reasoning": THOUGHT}
    # The pieces up to the one with the end of the marker are the thought's.
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert body["usage"]["completion_tokens"] == 5


async def test_streamed_the_deltas_switch_at_the_marker(client: httpx.AsyncClient) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    chunks = sse_chunks((await client.post(CHAT, json=body)).text)
    reasoning, content = _deltas(chunks, "reasoning_content"), _deltas(chunks, "content")
    assert "".join(reasoning) == THOUGHT and "".join(content) == ANSWER
    assert _deltas(chunks, "reasoning") == reasoning
    assert all("<" not in piece and ">" not in piece for piece in reasoning + content)  # no half marker sent
    last_reasoning = max(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("reasoning"))
    first_content = min(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert last_reasoning < first_content
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


async def test_each_of_n_choices_is_split(client: httpx.AsyncClient) -> None:
    body = (await client.post(CHAT, json=chat_body(n=2))).json()
    assert [c["message"]["reasoning_content"] for c in body["choices"]] == [THOUGHT] * 2
    assert [c["message"]["content"] for c in body["choices"]] == [ANSWER] * 2
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    chunks = sse_chunks((await client.post(CHAT, json=chat_body(n=2, stream=True))).text)
    for index in (0, 1):
        assert "".join(_deltas(chunks, "reasoning_content", index)) == THOUGHT
        assert "".join(_deltas(chunks, "content", index)) == ANSWER


async def test_a_thought_that_never_ends_is_all_reasoning(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=["Hmm", ", long", " thought"])
    message = (await client.post(CHAT, json=chat_body(max_tokens=3))).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Hmm, long thought" and message["content"] is None


async def test_tool_calls_are_read_from_the_answer_only(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    fake.script = Script(pieces=TOOL_PIECES)
    body = (await client.post(CHAT, json=chat_body(tools=TOOLS))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == TOOL_THOUGHT
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_streamed_tool_calls_after_a_thought_keep_openai_shape(
    client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    fake.script = Script(pieces=TOOL_PIECES)
    chunks = sse_chunks((await client.post(CHAT, json=chat_body(tools=TOOLS, stream=True))).text)
    assert "".join(_deltas(chunks, "reasoning_content")) == TOOL_THOUGHT
    assert not _deltas(chunks, "content")
    calls = [call for c in chunks if c["choices"] for call in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(call["function"].get("arguments") or "" for call in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


async def test_include_reasoning_false_leaves_the_thought_out(client: httpx.AsyncClient) -> None:
    body = (await client.post(CHAT, json=chat_body(include_reasoning=False))).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}  # it was still generated
    chunks = sse_chunks((await client.post(CHAT, json=chat_body(include_reasoning=False, stream=True))).text)
    assert not _deltas(chunks, "reasoning_content") and not _deltas(chunks, "reasoning")
    assert "".join(_deltas(chunks, "content")) == ANSWER


async def test_separate_reasoning_false_keeps_the_thought_in_the_content(client: httpx.AsyncClient) -> None:
    body = (await client.post(CHAT, json=chat_body(separate_reasoning=False))).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(THOUGHT_PIECES)}
    assert "completion_tokens_details" not in body["usage"]
    chunks = sse_chunks((await client.post(CHAT, json=chat_body(separate_reasoning=False, stream=True))).text)
    assert "".join(_deltas(chunks, "content")) == "".join(THOUGHT_PIECES)
    assert not _deltas(chunks, "reasoning_content")


async def test_stream_reasoning_false_sends_the_thought_in_one_piece(client: httpx.AsyncClient) -> None:
    chunks = sse_chunks((await client.post(CHAT, json=chat_body(stream_reasoning=False, stream=True))).text)
    assert _deltas(chunks, "reasoning_content") == [THOUGHT]
    assert "".join(_deltas(chunks, "content")) == ANSWER


async def test_enable_thinking_false_renders_the_template_without_thinking(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    fake.script = Script(pieces=["Just", " the answer."])
    messages = [{"role": "user", "content": "Hi"}]
    body = chat_body(messages=messages, chat_template_kwargs={"enable_thinking": False})
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    rendered = _rendered(hf_tokenizer, messages, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert fake.submitted[-1].prompt_token_ids == hf_tokenizer.encode(rendered, add_special_tokens=False)
    message = response.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Just the answer."}
    assert response.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


async def test_the_server_default_variables_and_a_request_override(fake: FakeEngine, hf_tokenizer: Any) -> None:
    context = _context(fake, copy.deepcopy(hf_tokenizer), default_template_kwargs={"enable_thinking": False})
    messages = [{"role": "user", "content": "Hi"}]
    async with _served(context) as client:
        assert (await client.post(CHAT, json=chat_body(messages=messages))).status_code == 200
        assert _prompt_text(fake, hf_tokenizer) == _rendered(hf_tokenizer, messages, enable_thinking=False)
        body = chat_body(messages=messages, chat_template_kwargs={"enable_thinking": True})
        assert (await client.post(CHAT, json=body)).status_code == 200
        assert _prompt_text(fake, hf_tokenizer) == _rendered(hf_tokenizer, messages)


async def test_reasoning_effort_reaches_the_template(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any
) -> None:
    assert (await client.post(CHAT, json=chat_body(reasoning_effort="high"))).status_code == 200
    assert "Reasoning effort: high" in _prompt_text(fake, hf_tokenizer)
    body = chat_body(chat_template_kwargs={"reasoning_effort": "low"})
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert "Reasoning effort: low" in _prompt_text(fake, hf_tokenizer)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"reasoning_effort": "extreme"}}, "chat_template_kwargs.reasoning_effort"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"notes": ["ok", {"deep": "\ud800"}]}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"include_reasoning": "no"}, "include_reasoning"),
        ({"messages": [{"role": "user", "content": "Hi", "reasoning_content": "x"}]}, "messages.0"),
    ],
)
async def test_wrong_thinking_controls_are_a_400_naming_them(
    client: httpx.AsyncClient, fake: FakeEngine, fields: dict[str, Any], param: str
) -> None:
    # ensure_ascii: a lone surrogate travels as the escape "\ud800"
    raw = json.dumps(chat_body(**fields)).encode()
    response = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, param=param)
    assert not fake.submitted


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
async def test_a_history_with_thoughts_is_accepted_and_earlier_thoughts_dropped(
    client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any, key: str
) -> None:
    earlier = {"role": "assistant", "content": "Hello!", key: "They greet me."}
    messages = [{"role": "user", "content": "Hi"}, earlier, {"role": "user", "content": "How are you?"}]
    assert (await client.post(CHAT, json=chat_body(messages=messages))).status_code == 200
    prompt = _prompt_text(fake, hf_tokenizer)
    assert "Hello!" in prompt and "They greet me." not in prompt  # the template drops earlier thoughts
    # A final assistant message's thought is shown to the template, which writes it (continuing that message).
    body = chat_body(messages=messages[:2], add_generation_prompt=False, continue_final_message=True)
    assert (await client.post(CHAT, json=body)).status_code == 200
    assert "<think>\nThey greet me.\n</think>\n\nHello!" in _prompt_text(fake, hf_tokenizer)


async def test_the_openai_client_reads_the_reasoning_from_model_extra(fake: FakeEngine, hf_tokenizer: Any) -> None:
    fake.script = Script(pieces=THOUGHT_PIECES)
    app = create_app(Settings(model=MODEL), loader=lambda: _context(fake, copy.deepcopy(hf_tokenizer)))
    async with running(app):
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        oai = AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="x", http_client=http_client, max_retries=0)  # type: ignore[arg-type]
        async with oai:
            messages: Any = [{"role": "user", "content": "Hi"}]
            completion = await oai.chat.completions.create(model=MODEL, messages=messages)
            message = completion.choices[0].message
            assert message.content == ANSWER
            assert message.model_extra == {"reasoning_content": THOUGHT, "reasoning": THOUGHT}
            assert completion.usage is not None and completion.usage.completion_tokens_details is not None
            assert completion.usage.completion_tokens_details.reasoning_tokens == 4
            stream = await oai.chat.completions.create(model=MODEL, messages=messages, stream=True)
            deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
            assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
            assert "".join(d.content or "" for d in deltas) == ANSWER


async def test_a_tokenizer_response_template_is_used(fake: FakeEngine, hf_tokenizer: Any) -> None:
    """Its markers, not `<think>`: a `<think>` the model writes is plain answer text to it."""
    tokenizer = copy.deepcopy(hf_tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    fake.script = Script(
        pieces=[THOUGHT_START[:3], f"{THOUGHT_START[3:]}Hm", f"m.{THOUGHT_END[:2]}", f"{THOUGHT_END[2:]}Ok <think>"]
    )
    context = _context(fake, tokenizer)
    async with _served(context) as client:
        message = (await client.post(CHAT, json=chat_body())).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "Hmm." and message["content"] == "Ok <think>"
        chunks = sse_chunks((await client.post(CHAT, json=chat_body(stream=True))).text)
        assert "".join(_deltas(chunks, "reasoning_content")) == "Hmm."
        assert "".join(_deltas(chunks, "content")) == "Ok <think>"


@pytest.mark.parametrize(
    ("parser", "split"),
    [("none", False), ("qwen3", True), ("deepseek_r1", True), ("response_schema", False)],
)
async def test_the_reasoning_parser_setting(fake: FakeEngine, hf_tokenizer: Any, parser: str, split: bool) -> None:
    fake.script = Script(pieces=THOUGHT_PIECES)
    context = _context(fake, copy.deepcopy(hf_tokenizer))
    context.reasoning_parser = parser
    async with _served(context) as client:
        message = (await client.post(CHAT, json=chat_body())).json()["choices"][0]["message"]
    expected: Callable[[], dict[str, Any]] = lambda: (  # noqa: E731
        {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT, "reasoning": THOUGHT}
        if split
        else {"role": "assistant", "content": "".join(THOUGHT_PIECES)}
    )
    assert message == expected()


async def test_special_token_markers_are_kept_in_the_decoded_text(fake: FakeEngine, hf_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(hf_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    fake.script = Script(pieces=THOUGHT_PIECES)
    async with _served(_context(fake, tokenizer)) as client:
        message = (await client.post(CHAT, json=chat_body())).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
        assert (await client.post(CHAT, json=chat_body(separate_reasoning=False))).status_code == 200
    split, unsplit = (request.params.skip_special_tokens for request in fake.submitted)
    assert not split and unsplit
