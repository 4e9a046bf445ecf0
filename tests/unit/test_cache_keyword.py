"""The runners hand their K/V cache to a model under the keyword its transformers version takes: `cache` from 5.24
on, where `past_key_values` only warns until it is removed in 5.40, and `past_key_values` before."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from tests.model_factory import build_tiny_t5, cache_root
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.kv_cache import cache_keyword
from transformers_openai.runners.seq2seq import Seq2SeqRunner

torch.set_num_threads(1)


class OlderForward(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, past_key_values: object = None, use_cache: bool = False) -> None:
        return None


class NewerForward(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, cache: object = None, use_cache: bool = False) -> None:
        return None


def test_the_keyword_follows_the_forward_signature() -> None:
    assert cache_keyword(OlderForward()) == "past_key_values"
    assert cache_keyword(NewerForward()) == "cache"


def cache_warnings(runner, tokenizer, requests: list[EngineRequest]) -> list[str]:
    """Runs the requests to the end; returns the warnings that name the cache keyword."""
    core = EngineCore(runner, tokenizer, Scheduler(2, 64), frozenset())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for request in requests:
            core.add(request)
        while core.has_work():
            for output in core.step():
                assert output.error is None, output.error
    return [str(w.message) for w in caught if "past_key_values" in str(w.message)]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)


def test_decoder_steps_use_the_keyword_the_model_takes(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    runner = CausalLMRunner(model, max_rows=2, max_model_len=64)
    requests = [EngineRequest(f"r{i}", list(range(10 + i, 20 + 2 * i)), greedy()) for i in range(2)]
    assert cache_warnings(runner, AutoTokenizer.from_pretrained(tiny_llama_dir), requests) == []


def test_encoder_decoder_steps_use_the_keyword_the_model_takes() -> None:
    directory = build_tiny_t5(cache_root() / "tiny-t5")
    model = AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    runner = Seq2SeqRunner(model, max_rows=2, max_model_len=32, max_input_len=32)
    requests = [
        EngineRequest(f"r{i}", [], greedy(), encoder_inputs={"input_ids": list(range(5 + i, 15 + i))}) for i in range(2)
    ]
    assert cache_warnings(runner, AutoTokenizer.from_pretrained(directory), requests) == []
