"""Structured outputs after a thought, through the real server: a tiny random Llama with `<think>`/`</think>` added
and a Qwen3-style template that opens the thought. A `logit_bias` on `</think>` (chosen from the model's own logits)
ends the greedy thought after a few tokens; the grammar then forces the answer. With `response_format: json_schema`
and with `tool_choice: "required"`, greedy and sampled, streamed and not: the answer validates, and the thought is
the one `model.generate` writes with the same bias. The Responses API gives the thought as its reasoning item."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import sync_client
from tests.e2e.fuzz_schema import nasty_schemas
from tests.e2e.server import ServerProcess, start_server
from tests.e2e.test_reasoning import END, MESSAGES, Generated, _build_think_llama
from tests.model_factory import cache_root
from tests.reasoning_support import THINK_TEMPLATE

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
MAX_TOKENS = 80
SAMPLED: list[dict[str, Any]] = [{"temperature": 1.0, "seed": seed} for seed in range(3)]
# Sampled thoughts wander off the greedy one: a larger bias ends them soon all the same (some right away).
SAMPLED_EXTRA_BIAS = 10.0
GREEDY: dict[str, Any] = {"temperature": 0}


@pytest.fixture(scope="module")
def think_dir(tiny_llama_dir: Path) -> Path:
    return _build_think_llama(cache_root() / "tiny-llama-think", tiny_llama_dir)


@pytest.fixture(scope="module")
def server(think_dir: Path, server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("think-structured") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    started = start_server(think_dir, server_logs, "--chat-template", str(template), "--max-batch-size", "4")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def generated(think_dir: Path) -> Generated:
    return Generated(think_dir)


@pytest.fixture(scope="module")
def biased(generated: Generated) -> tuple[dict[str, float], str]:
    """The logit_bias that ends the greedy thought after a few tokens, and that thought (from `model.generate`)."""
    prompt = generated.prompt()
    bias, at = generated.bias_ending_the_thought_at(prompt, range(2, 10))
    ids, _ = generated.run(prompt, bias)
    assert ids[at] == generated.end_id
    thought = generated.text(ids[:at])
    assert thought
    return {str(generated.end_id): bias}, thought


@pytest.fixture(scope="module")
def biased_tools(server: ServerProcess, generated: Generated) -> tuple[dict[str, float], str]:
    """The same for the prompt that shows the tools, as the server renders it."""
    rendered = httpx.post(
        server.base_url + "/tokenize",
        json={"model": "test-model", "messages": MESSAGES, "tools": TOOLS},
        timeout=60,
    )
    assert rendered.status_code == 200, rendered.text
    prompt = list(rendered.json()["tokens"])
    bias, at = generated.bias_ending_the_thought_at(prompt, range(2, 10))
    ids, _ = generated.run(prompt, bias)
    assert ids[at] == generated.end_id
    return {str(generated.end_id): bias}, generated.text(ids[:at])


def chat(server: ServerProcess, logit_bias: dict[str, float], **fields: Any) -> Any:
    if fields.get("temperature"):
        logit_bias = {token: bias + SAMPLED_EXTRA_BIAS for token, bias in logit_bias.items()}
    request: Any = {"model": "test-model", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "logit_bias": logit_bias}
    return sync_client(server).chat.completions.create(**request, **fields)


def reasoning_of(message: Any) -> str | None:
    extra = message.model_extra or {}
    return extra.get("reasoning_content")


def test_a_json_answer_after_the_thought(server: ServerProcess, biased: tuple[dict[str, float], str]) -> None:
    logit_bias, thought = biased
    form = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    greedy = chat(server, logit_bias, response_format=form, **GREEDY).choices[0]
    assert greedy.finish_reason == "stop"
    assert reasoning_of(greedy.message) == thought
    jsonschema.validate(json.loads(greedy.message.content), SCHEMA)
    for sampling in SAMPLED:
        choice = chat(server, logit_bias, response_format=form, **sampling).choices[0]
        assert choice.finish_reason == "stop" and END not in (reasoning_of(choice.message) or "")
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = chat(server, logit_bias, response_format=form, stream=True, **GREEDY)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == thought
    assert json.loads("".join(d.content or "" for d in deltas)) == json.loads(greedy.message.content)


def test_a_choice_a_regex_and_a_grammar_after_the_thought(
    server: ServerProcess, biased: tuple[dict[str, float], str]
) -> None:
    """The forms beyond JSON wait for the thought as a schema does: the same thought, then a matching answer."""
    logit_bias, thought = biased
    forms = [
        ({"choice": ["sunny", "rainy", "foggy"]}, r"sunny|rainy|foggy"),
        ({"regex": r"[0-9]{2} (C|F)"}, r"[0-9]{2} (C|F)"),
        ({"grammar": 'root ::= [a-z]{2,5} ("," [a-z]{2,5}){0,2}'}, r"[a-z]{2,5}(,[a-z]{2,5}){0,2}"),
    ]
    for fields, pattern in forms:
        extra = {"structured_outputs": fields}
        choice = chat(server, logit_bias, extra_body=extra, **GREEDY).choices[0]
        assert choice.finish_reason == "stop" and reasoning_of(choice.message) == thought, (fields, choice)
        assert re.fullmatch(pattern, choice.message.content or ""), (fields, choice.message.content)
    stream = chat(server, logit_bias, extra_body={"structured_outputs": forms[1][0]}, stream=True, **GREEDY)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == thought
    assert re.fullmatch(forms[1][1], "".join(d.content or "" for d in deltas))


def test_a_required_tool_call_after_the_thought(
    server: ServerProcess, biased_tools: tuple[dict[str, float], str]
) -> None:
    logit_bias, thought = biased_tools
    for sampling in [GREEDY, *SAMPLED]:
        choice = chat(server, logit_bias, tools=TOOLS, tool_choice="required", **sampling).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        assert END not in (reasoning_of(choice.message) or "")
        if sampling is GREEDY:
            assert reasoning_of(choice.message) == thought
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    stream = chat(server, logit_bias, tools=TOOLS, tool_choice="required", stream=True, **GREEDY)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    arguments = "".join(c.delta.tool_calls[0].function.arguments or "" for c in chunks if c.delta.tool_calls)
    jsonschema.validate(json.loads(arguments), PARAMETERS)
    assert chunks[-1].finish_reason == "tool_calls"


def test_the_responses_api_gives_the_thought_as_its_reasoning_item(server: ServerProcess, generated: Generated) -> None:
    """The Responses API has no logit_bias: the tiny model never ends its thought, so the answer is cut while it
    thinks, and the whole greedy output is the reasoning item, as `model.generate` writes it (the schema waits)."""
    ids, _ = generated.run(generated.prompt())
    assert generated.end_id not in ids
    text: Any = {"format": {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}}
    response = sync_client(server).responses.create(
        model="test-model", input=MESSAGES[0]["content"], text=text, max_output_tokens=len(ids), temperature=0
    )
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == generated.text(ids)
    assert response.output_text == ""
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == len(ids)
    events = list(
        sync_client(server).responses.create(
            model="test-model",
            input=MESSAGES[0]["content"],
            text=text,
            max_output_tokens=len(ids),
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == generated.text(ids)
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_nasty_schemas_after_a_thought_get_answers_or_400s_never_5xx(
    server: ServerProcess, biased: tuple[dict[str, float], str], stream: bool
) -> None:
    """The grammar after the thought is bounded as one without: over the size cap at once, past llguidance's limits
    or too costly once the thought ends (a 400, or the stream's error event), the server up for the next."""
    logit_bias, _ = biased
    statuses = {}
    for name, schema in nasty_schemas().items():
        body = {
            "model": "test-model",
            "messages": MESSAGES,
            "max_tokens": 30,
            "temperature": 0,
            "logit_bias": logit_bias,
            "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        }
        response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
        status = response.status_code
        if status == 200 and stream and '"error"' in response.text:  # failed mid-answer: the error event's shape
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
            status = 400 if json.loads(events[-1])["error"]["type"] == "invalid_request_error" else 500
        elif status == 400:
            assert response.json()["error"]["type"] == "invalid_request_error"
            # Refused up front (it names the field) or failed once the thought ended (the answer's grammar_failed).
            error = response.json()["error"]
            assert error["param"] == "response_format" or error["code"] == "grammar_failed", error
        statuses[name] = status
    assert set(statuses.values()) <= {200, 400}, statuses
    refused = ("over the size cap", "past the lexer's limits", "costly from the first token", "costly mid-answer")
    assert [statuses[name] for name in refused] == [400] * len(refused), statuses
    assert statuses["only annotated"] == statuses["empty"] == 200
    assert server.process.poll() is None and server.engine_state()
