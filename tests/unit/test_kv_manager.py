"""KVManager, the scheduler side's K/V memory: reservations that keep room for the running rows' growth, prefix
reuse, growth all or nothing, the record of what a prefill wrote, and blocks given back when a request leaves."""

from __future__ import annotations

from transformers_openai.engine.kv_manager import KVManager
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.runners.base import KVPoolSpec

SIZE = 4


def manager(blocks: int, shared: bool = True) -> KVManager:
    return KVManager(KVPoolSpec(num_blocks=blocks + 1, block_size=SIZE, shared_prefixes=shared))


def test_a_reservation_keeps_a_block_for_each_running_row() -> None:
    kv = manager(6)
    job = PrefillJob(list(range(10)))  # 10 tokens and one more: 3 blocks
    assert not kv.reserve(job, 11, running=4)  # 6 free, 4 kept for the running rows' next tokens
    assert job.kv is None and job.done == 0 and kv.usage().blocks_used == 0  # nothing held
    assert kv.reserve(job, 11, running=3)
    assert job.kv is not None and len(job.kv.blocks) == 3 and kv.usage().blocks_used == 3
    assert kv.reserve(job, 11, running=3)  # already reserved: nothing more taken
    assert kv.usage().blocks_used == 3
    kv.release(job)
    assert job.kv is None and kv.usage().blocks_used == 0


def test_a_prompt_starting_like_a_written_one_skips_its_full_blocks_unless_scored() -> None:
    kv = manager(16)
    history = list(range(100, 111))  # 2 full blocks and 3 tokens
    first = PrefillJob(history)
    assert kv.reserve(first, len(history) + 1, running=0)
    first.done = len(history)  # the runner prefilled it whole
    kv.prefilled(first)
    assert first.kv is not None and first.kv.length == len(history) and len(first.kv.digests) == 2
    kv.release(first)
    turn = PrefillJob([*history, 7, 8])
    assert kv.reserve(turn, len(turn.decoder_prompt) + 1, running=0)
    assert turn.done == 2 * SIZE and turn.kv is not None and turn.kv.length == 2 * SIZE
    scored = PrefillJob([*history, 7, 8], prompt_logprobs=0)  # every position's logits are needed
    assert kv.reserve(scored, len(scored.decoder_prompt) + 1, running=0)
    assert scored.done == 0 and scored.kv is not None and scored.kv.length == 0
    usage = kv.usage()
    assert usage.prefix_hits == 2 * SIZE and usage.prefix_queries == len(history) + len(turn.decoder_prompt)


def test_blocks_of_an_unshared_pool_are_never_matched() -> None:
    kv = manager(16, shared=False)
    prompt = list(range(20, 29))
    for _ in range(2):
        job = PrefillJob(prompt)
        assert kv.reserve(job, len(prompt) + 1, running=0)
        assert job.done == 0
        job.done = len(prompt)
        kv.prefilled(job)
        kv.release(job)
    assert kv.usage().prefix_hits == 0 and kv.usage().blocks_cached == 0


def test_a_chunked_prefill_is_recorded_as_far_as_it_went() -> None:
    kv = manager(8)
    decoder_prompt = list(range(50, 60))
    job = PrefillJob(decoder_prompt)
    assert kv.reserve(job, len(decoder_prompt) + 1, running=0)
    job.done = 6  # one chunk in
    kv.prefilled(job)
    assert job.kv is not None and job.kv.length == 6 and len(job.kv.digests) == 1
    job.done = len(decoder_prompt)  # the rest
    kv.prefilled(job)
    assert job.kv.length == 10 and job.kv.tokens == decoder_prompt


def test_an_encoder_decoder_prompt_is_recorded_with_its_start_token() -> None:
    kv = manager(8, shared=False)
    job = PrefillJob([0])  # T5: no prompt; the decoder holds its start token
    assert kv.reserve(job, 2, running=0)
    job.done = 1
    kv.prefilled(job)
    assert job.kv is not None and job.kv.length == 1


def test_growth_is_all_or_nothing() -> None:
    kv = manager(3)
    rows: list[PrefillJob] = []
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8]):  # each fills its block: its next token needs a new one
        job = PrefillJob(prompt)
        assert kv.reserve(job, len(prompt), running=len(rows))
        job.done = len(prompt)
        kv.prefilled(job)
        rows.append(job)
    tables = [job.kv for job in rows if job.kv is not None]
    assert not kv.grow(tables)  # two rows need a block each, one is free
    assert [len(t.blocks) for t in tables] == [1, 1] and kv.usage().blocks_used == 2
    kv.release(rows.pop())
    assert kv.grow(tables[:1]) and len(tables[0].blocks) == 2
    kv.written(tables[0], [9])
    assert tables[0].length == 5
