"""Lockstep without processes: what rank 0's executor sends, replayed by a follower over its own pool, leaves that
pool equal to rank 0's (prefills, chunks, identical prompts copied, decode steps, an abort, rows reused)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.parallel.lockstep import CopySlots, Forward, LockstepExecutor, Stop, follow
from transformers_openai.parallel.ranks import Ranks
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_pool import KVSpace
from transformers_openai.serving.tokenizer import engine_decoder

torch.set_num_threads(1)


class Channel(Ranks):
    """Rank 0's messages kept in order; the follower reads them back from the same list."""

    messages: list[object]

    def __init__(self) -> None:
        super().__init__(rank=0, size=2, control=None)
        object.__setattr__(self, "messages", [])

    def send(self, message: object) -> None:
        self.messages.append(message)

    def receive(self) -> object:
        return self.messages.pop(0)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def zeroed_runner(model) -> CausalLMRunner:
    runner = CausalLMRunner(model, max_rows=4, max_model_len=256, kv=KVSpace(bytes=2**20, block_size=4))
    for pool in (*runner._pool.cache._k, *runner._pool.cache._v):
        pool.zero_()  # an `empty` pool: unwritten slots hold whatever was there
    return runner


def test_a_follower_replaying_rank_0_holds_the_same_pool(model, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    leader, follower = zeroed_runner(model), zeroed_runner(model)
    channel = Channel()
    leader.executor = LockstepExecutor(leader.executor, channel)
    scheduler = Scheduler(max_running=4, max_waiting=16, max_prefill_tokens=24)  # longer prompts go in chunks
    core = EngineCore(leader, engine_decoder(tokenizer), scheduler, frozenset())
    ids = tokenizer("a follower holds no rows, only its shard of the pool " * 4, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
    prompts = [ids[:5], ids[:5], ids[:40], ids[:9], ids[:17], ids[:3]]  # the first two identical: one is copied
    for n, prompt in enumerate(prompts):
        core.add(EngineRequest(f"r{n}", prompt, params))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        if steps == 3:
            assert core.abort("r2") is not None  # mid-prefill or mid-decode: its blocks go back to the pool
    leader.executor.stop()
    kinds = {type(m) for m in channel.messages}
    assert kinds == {Forward, CopySlots, Stop}
    follow(follower.executor, channel)
    assert channel.messages == []
    for mine, theirs in zip(
        (*leader._pool.cache._k, *leader._pool.cache._v),
        (*follower._pool.cache._k, *follower._pool.cache._v),
        strict=True,
    ):
        assert torch.equal(mine, theirs)
    assert core.slots.in_use == 0 and core.kv.usage().blocks_used == 0


def test_a_call_that_fails_on_a_follower_ends_it(model) -> None:
    """Rank 0 would wait for it in the step's collectives: the follower raises (and exits) rather than going on."""
    follower = zeroed_runner(model)
    channel = Channel()
    channel.messages.extend([CopySlots([4], [8]), Forward([([10**9], 0, [1, 2])], keep=1), Stop()])
    with pytest.raises(IndexError):
        follow(follower.executor, channel)
    assert channel.messages == [Stop()]  # it did not go on to the next call
    cache = follower._pool.cache
    assert torch.equal(cache._k[0][:, 8], cache._k[0][:, 4])  # the call before the failure ran


class OutOfStep(Exception):
    pass


def test_a_step_that_fails_on_rank_0_after_it_was_sent_ends_rank_0(model) -> None:
    leader = zeroed_runner(model)
    channel = Channel()
    failures: list[BaseException] = []

    def out_of_step(error: BaseException):
        failures.append(error)
        raise OutOfStep  # the real one exits the process

    leader.executor = LockstepExecutor(leader.executor, channel, out_of_step)
    with pytest.raises(OutOfStep):
        leader.executor.forward([(BlockTable(None, [10**9], 0), [1, 2])], keep=1)
    assert [type(m) for m in channel.messages] == [Forward]  # the others were told to run it
    assert len(failures) == 1 and isinstance(failures[0], IndexError)
