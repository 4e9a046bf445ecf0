"""BlockPool: allocation and release, the prefix cache (content-hashed full blocks), reference counts, LRU eviction."""

from __future__ import annotations

from transformers_openai.engine.block_pool import BlockPool
from transformers_openai.runners.kv.block_table import NULL_BLOCK, BlockTable

SIZE = 4


def filled(pool: BlockPool, token_ids: list[int], shared: bool = True) -> BlockTable:
    """A table holding `token_ids`, written (full blocks registered when shared)."""
    table = BlockTable(prefix_seed=b"" if shared else None)
    assert pool.grow(table, len(token_ids))
    pool.written(table, token_ids)
    return table


def test_blocks_are_handed_out_and_come_back() -> None:
    pool = BlockPool(num_blocks=5, block_size=SIZE)
    assert pool.usable == 4 and pool.available == 4 and pool.used == 0
    table = filled(pool, list(range(9)), shared=False)  # 9 tokens: 3 blocks
    assert len(table.blocks) == 3 and NULL_BLOCK not in table.blocks
    assert len(set(table.blocks)) == 3 and pool.used == 3
    assert table.slot(5, SIZE) == table.blocks[1] * SIZE + 1
    pool.release(table)
    assert pool.used == 0 and table.blocks == [] and table.length == 0


def test_grow_that_cannot_be_met_takes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=SIZE)
    holder = filled(pool, list(range(8)), shared=False)  # 2 of 3 usable blocks
    table = BlockTable()
    assert not pool.grow(table, 2 * SIZE)
    assert table.blocks == [] and pool.available == 1
    assert pool.grow(table, SIZE) and pool.available == 0
    assert pool.grow(table, SIZE)  # already has room: nothing more taken
    pool.release(holder)
    assert pool.available == 2


def test_a_prompt_starting_with_cached_blocks_reuses_them() -> None:
    pool = BlockPool(num_blocks=10, block_size=SIZE)
    history = list(range(100, 110))  # 2 full blocks and 2 tokens
    first = filled(pool, history)
    assert len(first.digests) == 2
    second = BlockTable()
    matched = pool.match_prefix(second, [*history, 7, 8, 9])
    assert matched == 2 * SIZE
    assert second.blocks == first.blocks[:2] and second.length == 2 * SIZE
    assert pool.prefix_hits == 2 * SIZE and pool.prefix_queries == len(history) + 3
    # Shared blocks are held twice: the first request leaving keeps them for the second.
    used = pool.used
    pool.release(first)
    assert pool.used == used - 1  # only its own partial third block came back
    assert pool.grow(second, 13)
    pool.written(second, [*history, 7, 8, 9][second.length :])
    assert len(second.digests) == 3


def test_the_last_token_is_never_matched() -> None:
    """The model must still compute the last prompt token's logits: a prompt of exactly cached blocks leaves it."""
    pool = BlockPool(num_blocks=10, block_size=SIZE)
    prompt = list(range(2 * SIZE))
    pool.release(filled(pool, prompt))
    table = BlockTable()
    assert pool.match_prefix(table, prompt) == SIZE
    assert table.tokens == prompt[:SIZE]


def test_a_different_start_matches_nothing_even_with_equal_later_blocks() -> None:
    pool = BlockPool(num_blocks=10, block_size=SIZE)
    pool.release(filled(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    table = BlockTable()
    assert pool.match_prefix(table, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert table.blocks == []


def test_unshared_tables_neither_register_nor_match() -> None:
    pool = BlockPool(num_blocks=10, block_size=SIZE)
    pool.release(filled(pool, list(range(9)), shared=False))
    assert pool.match_prefix(BlockTable(), list(range(9))) == 0
    assert pool.match_prefix(BlockTable(prefix_seed=None), list(range(9))) == 0


def test_cached_blocks_are_evicted_oldest_first_when_free_ones_run_out() -> None:
    pool = BlockPool(num_blocks=5, block_size=SIZE)  # 4 usable
    old = list(range(10, 14))
    new = list(range(20, 24))
    pool.release(filled(pool, old))
    pool.release(filled(pool, new))
    assert pool.used == 0 and pool.available == 4  # cached blocks count as available
    assert pool.cached == 2  # the one full block of each, kept for reuse
    # Three blocks: the 2 free ones, then the oldest cached block (the one holding `old`).
    taker = BlockTable(prefix_seed=None)
    assert pool.grow(taker, 3 * SIZE)
    assert pool.cached == 1
    assert pool.match_prefix(BlockTable(), [*old, 0]) == 0
    assert pool.match_prefix(probe := BlockTable(), [*new, 0]) == SIZE
    pool.release(probe)
    pool.release(taker)
    assert pool.used == 0


def test_a_matched_cached_block_is_not_evicted_while_held() -> None:
    pool = BlockPool(num_blocks=3, block_size=SIZE)  # 2 usable
    prompt = list(range(SIZE))
    pool.release(filled(pool, prompt))
    holder = BlockTable()
    assert pool.match_prefix(holder, [*prompt, 99]) == SIZE
    other = BlockTable(prefix_seed=None)
    assert pool.grow(other, SIZE)
    assert not pool.grow(other, 2 * SIZE)  # the held cached block is not up for eviction
    assert holder.blocks[0] not in other.blocks
