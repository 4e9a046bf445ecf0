"""AsyncEngine on the tiny Llama: admission limits, aborts of queued and running requests, and failures stay local."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.async_engine import AsyncEngine
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.errors import EngineOverloaded, TooManySequences
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def parts(tiny_llama_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, tokenizer


def make_engine(parts: tuple[Any, Any], running: int = 2, waiting: int = 1) -> AsyncEngine:
    model, tokenizer = parts
    runner = CausalLMRunner(model, max_rows=running, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(running, waiting), frozenset({tokenizer.eos_token_id}))
    return AsyncEngine(core)


def request(rid: str, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def drain(stream: Any) -> list[RequestOutput]:
    return [output async for output in stream]


async def test_limits_and_aborts(parts: tuple[Any, Any]) -> None:
    engine = make_engine(parts)
    await engine.start()
    try:
        with pytest.raises(TooManySequences):
            engine.submit([request(f"x{i}") for i in range(4)])  # 4 > 2 running + 1 waiting, ever
        long = engine.submit([request(f"long{i}", max_tokens=400) for i in range(3)])
        with pytest.raises(EngineOverloaded) as overloaded:
            engine.submit([request("one-too-many")])
        assert overloaded.value.retry_after_s == 1  # no decode step timed yet to estimate from
        first = await anext(long[0])
        assert first.token_ids and not first.finished
        for i in range(3):  # two running and one queued: all leave at once
            engine.abort(f"long{i}")
        for _ in range(100):
            stats = engine.stats()
            if stats.running == stats.waiting == stats.rows_in_use == stats.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert (stats.running, stats.waiting, stats.rows_in_use, stats.in_flight) == (0, 0, 0, 0)
        outputs = await drain(engine.generate(request("after")))
        assert outputs[-1].finish_reason == FinishReason.LENGTH and outputs[-1].completion_tokens == 8
    finally:
        await engine.stop()


async def test_a_request_the_core_rejects_fails_alone(parts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(parts)
    core = engine._core
    real_add = core.add

    def picky_add(req: EngineRequest) -> None:
        if req.request_id == "bad":
            raise ValueError("cannot take this one")
        real_add(req)

    monkeypatch.setattr(core, "add", picky_add)
    await engine.start()
    try:
        bad, good = engine.submit([request("bad"), request("good")])
        async with asyncio.timeout(30):  # a dead engine thread would leave both streams hanging
            bad_outputs, good_outputs = await asyncio.gather(drain(bad), drain(good))
        assert bad_outputs[-1].finish_reason == FinishReason.ERROR and "cannot take" in (bad_outputs[-1].error or "")
        assert good_outputs[-1].finish_reason == FinishReason.LENGTH
        assert engine.running and engine.stats().in_flight == 0
    finally:
        await engine.stop()


async def test_a_consumer_that_stops_reading_is_ended_and_frees_its_row(parts: tuple[Any, Any]) -> None:
    model, tokenizer = parts
    runner = CausalLMRunner(model, max_rows=2, max_model_len=512)
    core = EngineCore(runner, tokenizer, Scheduler(2, 1), frozenset({tokenizer.eos_token_id}))
    engine = AsyncEngine(core, max_pending_outputs=5)
    await engine.start()
    try:
        idle, reader = engine.submit([request("idle", max_tokens=300), request("reader", max_tokens=40)])
        async with asyncio.timeout(60):
            read = await drain(reader)  # read as it comes: never more than a few outputs behind
            while engine.stats().in_flight or engine.stats().rows_in_use:
                await asyncio.sleep(0.02)
            outputs = await drain(idle)
        assert read[-1].finish_reason == FinishReason.LENGTH and read[-1].completion_tokens == 40
        assert len(outputs) == 1  # what it never took was dropped, not kept
        assert outputs[0].finish_reason == FinishReason.ERROR and outputs[0].error_kind == ErrorKind.STALLED
        assert engine.stats().rows_in_use == 0
    finally:
        await engine.stop()


async def test_fail_in_flight_ends_every_request_with_a_shutdown_error_and_frees_the_rows(
    parts: tuple[Any, Any],
) -> None:
    engine = make_engine(parts)
    await engine.start()
    try:
        streams = engine.submit([request(f"long{i}", max_tokens=400) for i in range(3)])  # 2 running, 1 queued
        first = await anext(streams[0])
        assert not first.finished
        assert engine.fail_in_flight("the server is shutting down") == 3
        async with asyncio.timeout(30):
            ends = [(await drain(stream))[-1] for stream in streams]
            while engine.stats().rows_in_use or engine.stats().running or engine.stats().waiting:
                await asyncio.sleep(0.02)
        assert all(end.finish_reason == FinishReason.ERROR and end.error_kind == ErrorKind.SHUTDOWN for end in ends)
        assert all(end.error == "the server is shutting down" for end in ends)
        assert engine.stats().in_flight == 0
    finally:
        await engine.stop()


async def test_a_continuation_is_admitted_at_capacity(parts: tuple[Any, Any]) -> None:
    engine = make_engine(parts, running=1, waiting=0)
    await engine.start()
    try:
        first = engine.submit([request("first", max_tokens=30)])[0]
        with pytest.raises(EngineOverloaded):
            engine.submit([request("newcomer")])
        window = replace(request("window-2", max_tokens=4), continuation=True)
        async with asyncio.timeout(60):
            outputs = await drain(engine.submit([window])[0])
            await drain(first)
        assert outputs[-1].finish_reason == FinishReason.LENGTH
        assert outputs[0].info is None  # a causal runner learns nothing at prefill to report
    finally:
        await engine.stop()


async def test_call_runs_on_the_engine_thread_between_steps_and_propagates_errors(parts: tuple[Any, Any]) -> None:
    import threading

    engine = make_engine(parts)
    await engine.start()
    try:
        stream = engine.generate(request("busy", max_tokens=20))
        threads = await engine.call(lambda: threading.current_thread().name)
        assert threads == "engine"

        def fails() -> None:
            raise ValueError("the caller's own failure")

        with pytest.raises(ValueError, match="own failure"):
            await engine.call(fails)
        outputs = await drain(stream)  # the engine went on serving
        assert outputs[-1].finish_reason == FinishReason.LENGTH
    finally:
        await engine.stop()
