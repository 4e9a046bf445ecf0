"""Completions echo with logprobs scores the prompt (lm-eval's loglikelihood requests), by the model's own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import sync_client
from tests.e2e.reference import load
from tests.e2e.server import ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog because it is"


def own_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model, _ = load(str(model_dir))
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_scores_every_prompt_token(tiny_server: ServerProcess, tiny_llama_dir: Path) -> None:
    client = sync_client(tiny_server)
    _, tokenizer = load(str(tiny_llama_dir))
    ids = tokenizer(PROMPT).input_ids
    for max_tokens in (1, 0):  # lm-eval sends 1 (and reads all but the last entry); older versions 0
        reply = client.completions.create(
            model="test-model", prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
        )
        choice = reply.choices[0]
        scores = choice.logprobs
        assert scores is not None and scores.tokens is not None and scores.text_offset is not None
        assert scores.token_logprobs is not None and scores.top_logprobs is not None
        assert choice.text.startswith(PROMPT) and len(scores.tokens) == len(ids) + max_tokens
        assert scores.token_logprobs[0] is None and scores.top_logprobs[0] is None
        expected = own_logprobs(tiny_llama_dir, ids)
        for position in range(1, len(ids)):
            own = float(expected[position - 1, ids[position]])
            assert scores.token_logprobs[position] == pytest.approx(own, abs=1e-4)
            assert len(scores.top_logprobs[position]) >= 1
        assert scores.text_offset == sorted(scores.text_offset) and scores.text_offset[0] == 0
        if max_tokens:
            assert scores.text_offset[-1] == len(PROMPT)  # the generated token starts where the prompt ends
        assert (
            reply.usage is not None
            and reply.usage.completion_tokens == max_tokens
            and reply.usage.prompt_tokens == len(ids)
        )
    assert tiny_server.engine_state()["rows_in_use"] == 0


def test_streamed_echo_with_logprobs_equals_the_whole_response(tiny_server: ServerProcess) -> None:
    body = {"model": "test-model", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    whole = httpx.post(f"{tiny_server.base_url}/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{tiny_server.base_url}/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in parts) == whole["text"]
    joined = {key: [v for c in parts if c["logprobs"] for v in c["logprobs"][key]] for key in whole["logprobs"]}
    assert joined == whole["logprobs"]


def test_zero_tokens_without_echo_is_a_400(tiny_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sync_client(tiny_server).completions.create(model="test-model", prompt=PROMPT, max_tokens=0)
    assert bad.value.param == "max_tokens"


def test_vllm_prompt_logprobs_on_both_endpoints(tiny_server: ServerProcess, tiny_llama_dir: Path) -> None:
    """vLLM's `prompt_logprobs`: per prompt token its logprob, rank and text, plus the top alternatives; None first."""
    _, tokenizer = load(str(tiny_llama_dir))
    base = {"model": "test-model", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    completion = httpx.post(f"{tiny_server.base_url}/completions", json={**base, "prompt": PROMPT}, timeout=60).json()
    messages = [{"role": "user", "content": "Hi there"}]
    chat_url = f"{tiny_server.base_url}/chat/completions"
    chat = httpx.post(chat_url, json={**base, "messages": messages}, timeout=60).json()
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    for scored, ids in (
        (completion["choices"][0]["prompt_logprobs"], tokenizer(PROMPT).input_ids),
        (chat["prompt_logprobs"], list(chat_ids)),
    ):
        expected = own_logprobs(tiny_llama_dir, ids)
        assert len(scored) == len(ids) and scored[0] is None
        for position, entry in enumerate(scored[1:], start=1):
            token = ids[position]
            row = expected[position - 1]
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
            assert mine["rank"] == int((row > row[token]).sum()) + 1
            assert mine["decoded_token"] == tokenizer.decode([token])
            top = row.topk(3).indices.tolist()
            assert set(entry) == {str(t) for t in top} | {str(token)}
    plain = httpx.post(
        f"{tiny_server.base_url}/completions", json={**base, "prompt": PROMPT, "prompt_logprobs": None}, timeout=60
    ).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # absent unless asked for
    streamed = httpx.post(
        f"{tiny_server.base_url}/completions", json={**base, "prompt": PROMPT, "stream": True}, timeout=60
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
