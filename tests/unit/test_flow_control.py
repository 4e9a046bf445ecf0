"""Rows follow their readers: a request whose consumer stops taking outputs is paused within a bounded number of
tokens (row and K/V memory given back), stays paused while unread, and resumes with the same greedy answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.async_engine import AsyncEngine, FlowControl
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest, FinishReason
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner

torch.set_num_threads(1)

FLOW = FlowControl(pause_at=8, resume_at=2)
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def parts(tiny_llama_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, tokenizer


def make_engine(parts: tuple[Any, Any]) -> AsyncEngine:
    model, tokenizer = parts
    runner = CausalLMRunner(model, max_rows=2, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(2, 4), frozenset({tokenizer.eos_token_id}))
    return AsyncEngine(core, flow=FLOW)


def request(rid: str) -> EngineRequest:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, [1, 5, 9, 14, 3], params)


async def settle(engine: AsyncEngine, check: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check(engine.stats()):
            await asyncio.sleep(0.01)


async def test_an_unread_stream_is_paused_and_resumes_with_the_same_answer(parts: tuple[Any, Any]) -> None:
    engine = make_engine(parts)
    await engine.start()
    try:
        alone = [t for output in [o async for o in engine.generate(request("reference"))] for t in output.token_ids]
        assert len(alone) == MAX_TOKENS

        stream = engine.generate(request("slow-reader"))
        first = await anext(stream)  # then it stops reading
        await settle(engine, lambda s: s.paused == 1)
        core = engine._core
        paused = core.scheduler.paused["slow-reader"]
        made = len(paused.output_ids)
        # Paused a few steps at most after its untaken outputs reached the limit; no row, no K/V blocks held.
        assert made <= 1 + FLOW.pause_at + 8, made  # measured: 9, the pause taking effect at the next step
        stats = engine.stats()
        assert stats.rows_in_use == 0 and stats.kv_blocks_used == 0 and stats.running == 0
        await asyncio.sleep(0.3)
        assert len(paused.output_ids) == made  # not stepped while unread

        # Another request runs meanwhile, on the row the paused one gave back.
        other = [o async for o in engine.generate(request("other"))]
        assert other[-1].finish_reason is FinishReason.LENGTH

        rest = [output async for output in stream]  # it reads again: resumed, recomputed, finished
        tokens = [*first.token_ids, *(t for output in rest for t in output.token_ids)]
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert tokens == alone  # greedy output unchanged by the pause and the recompute
        await settle(engine, lambda s: s.paused == s.in_flight == s.rows_in_use == 0)
    finally:
        await engine.stop()


async def test_a_paused_request_is_aborted_cleanly(parts: tuple[Any, Any]) -> None:
    engine = make_engine(parts)
    await engine.start()
    try:
        stream = engine.generate(request("gone"))
        await anext(stream)
        await settle(engine, lambda s: s.paused == 1)
        assert isinstance(stream, AsyncGenerator)
        await stream.aclose()  # the client leaves while paused
        await settle(engine, lambda s: s.paused == s.in_flight == s.running == s.waiting == 0)
        assert engine.stats().kv_blocks_used == 0
    finally:
        await engine.stop()
