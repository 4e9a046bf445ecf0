"""Reasoning through the real server: a tiny random Llama with `<think>` and `</think>` added to its vocabulary (as
Qwen3 has them) and a Qwen3-style template that opens the thought. The greedy thought ends where a `logit_bias` on
`</think>` makes the model write it, chosen from the model's own logits; the server's split, streamed and not,
equals splitting what `model.generate` writes with the same bias, and LiteLLM's hosted_vllm route reads it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess, start_server
from tests.model_factory import built_once, cache_root
from tests.reasoning_support import THINK_TEMPLATE

MESSAGES: list[Any] = [{"role": "user", "content": "What is two plus two?"}]
MAX_TOKENS = 12
END = "</think>"


@built_once
def _build_think_llama(dest: Path, tiny_llama: Path) -> Path:
    """The tiny Llama with `<think>` and `</think>` as added (not special) tokens, their embeddings new rows."""
    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tokenizer.add_tokens(["<think>", END])
    model.resize_token_embeddings(len(tokenizer))
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


@pytest.fixture(scope="module")
def think_dir(tiny_llama_dir: Path) -> Path:
    return _build_think_llama(cache_root() / "tiny-llama-think", tiny_llama_dir)


@pytest.fixture(scope="module")
def think_server(
    think_dir: Path, server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("think-template") / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    server = start_server(think_dir, server_logs, "--chat-template", str(template), "--max-batch-size", "4")
    yield server
    server.stop()


class Generated:
    """`model.generate`, greedy, on the prompt the server renders, with a bias on `</think>`."""

    def __init__(self, model_dir: Path) -> None:
        torch.set_num_threads(1)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        end_id = self.tokenizer.convert_tokens_to_ids(END)
        assert isinstance(end_id, int)
        self.end_id = end_id

    def prompt(self, **variables: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            MESSAGES, chat_template=THINK_TEMPLATE, add_generation_prompt=True, tokenize=False, **variables
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def run(self, prompt: list[int], bias: float = 0.0) -> tuple[list[int], list[torch.Tensor]]:
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id,
                sequence_bias={(self.end_id,): bias} if bias else None,
            )
        return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]

    def bias_ending_the_thought_at(self, prompt: list[int], positions: range) -> tuple[float, int]:
        """A bias that makes `</think>` the greedy choice at one of `positions` and at no step before: above the
        gap between the best logit and its logit there, below every earlier step's gap."""
        _, logits = self.run(prompt)
        gaps = [float(step.max() - step[self.end_id]) for step in logits]
        for at in positions:
            if gaps[at] + 0.1 < min(gaps[:at]):
                return (gaps[at] + min(gaps[:at])) / 2, at
        raise AssertionError(f"no step in {positions} where a bias on {END} ends the thought alone: gaps {gaps}")

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="module")
def generated(think_dir: Path) -> Generated:
    return Generated(think_dir)


@pytest.fixture(scope="module")
def biased(generated: Generated) -> tuple[dict[str, float], str, int]:
    """The request's logit_bias, the reference's text, and where the thought ends (its tokens, marker included)."""
    prompt = generated.prompt()
    bias, at = generated.bias_ending_the_thought_at(prompt, range(2, 10))
    ids, _ = generated.run(prompt, bias)
    assert ids[at] == generated.end_id and generated.end_id not in ids[:at]
    return {str(generated.end_id): bias}, generated.text(ids), at + 1


def test_greedy_split_streamed_and_not_equals_splitting_generate(
    think_server: ServerProcess, biased: tuple[dict[str, float], str, int]
) -> None:
    logit_bias, text, thought_tokens = biased
    reasoning, _, content = text.partition(END)  # the prompt opened the thought; only the first marker ends it
    assert reasoning and content
    client = sync_client(think_server)
    # Float biases (OpenAI's client types them as integers; the API takes any number in [-100, 100]).
    request: Any = {
        "model": "test-model",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"logit_bias": logit_bias},
    }
    completion = client.chat.completions.create(**request)
    message = completion.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    assert (message.model_extra or {}).get("reasoning") == reasoning
    assert message.content == content
    assert completion.usage is not None and completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == thought_tokens
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == thought_tokens


def test_enable_thinking_false_is_all_answer(think_server: ServerProcess, generated: Generated) -> None:
    ids, _ = generated.run(generated.prompt(enable_thinking=False))
    completion = sync_client(think_server).chat.completions.create(
        model="test-model",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = completion.choices[0].message
    assert generated.end_id not in ids and not (message.model_extra or {}).get("reasoning_content")
    assert message.content == generated.text(ids)


def test_litellm_hosted_vllm_returns_the_reasoning(
    think_server: ServerProcess, biased: tuple[dict[str, float], str, int]
) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # read at import: no network
    import litellm

    logit_bias, text, _ = biased
    reasoning, _, content = text.partition(END)
    response: Any = litellm.completion(
        model="hosted_vllm/test-model",
        api_base=think_server.base_url,
        api_key="unused",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias=logit_bias,
    )
    assert response.choices[0].message.reasoning_content == reasoning
    assert response.choices[0].message.content == content


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["sum"],
    "additionalProperties": False,
}


def test_a_json_answer_and_a_forced_call_follow_the_thought(
    think_server: ServerProcess, biased: tuple[dict[str, float], str, int]
) -> None:
    """The grammar lets the model think (free text up to `</think>`), then holds the answer to the schema."""
    logit_bias, _, _ = biased
    client = sync_client(think_server)
    request: Any = {"model": "test-model", "messages": MESSAGES, "max_tokens": 80, "temperature": 0}
    schema_format: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    completion = client.chat.completions.create(
        **request, response_format=schema_format, extra_body={"logit_bias": logit_bias}
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert (choice.message.model_extra or {}).get("reasoning_content")
    assert jsonschema.validate(json.loads(choice.message.content or ""), ANSWER_SCHEMA) is None
    weather = {**ANSWER_SCHEMA, "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": weather}}
    called = client.chat.completions.create(
        **request, tools=[tool], tool_choice="required", extra_body={"logit_bias": logit_bias}
    ).choices[0]
    assert called.finish_reason == "tool_calls", called
    assert (called.message.model_extra or {}).get("reasoning_content")
    (call,) = called.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
