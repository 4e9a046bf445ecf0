"""PagedKVCache: a step's plan writes each row's new K/V into its own blocks and reads every row back right-aligned."""

from __future__ import annotations

import pytest
import torch

from transformers_openai.engine.block_pool import BlockPool
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.kv.kv_cache import OwnedLayer
from transformers_openai.runners.kv.paged_cache import KVGeometry, PagedKVCache

torch.set_num_threads(1)

LAYERS, HEADS, DIM, SIZE = 2, 2, 3, 4


def setup(num_blocks: int = 12) -> tuple[BlockPool, PagedKVCache]:
    geometry = KVGeometry(LAYERS, HEADS, DIM, torch.float32)
    return BlockPool(num_blocks, SIZE), PagedKVCache(geometry, num_blocks, SIZE, torch.device("cpu"))


def new_kv(rows: int, queries: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, HEADS, queries, DIM)
    return torch.rand(shape, generator=g) + 1, torch.rand(shape, generator=g) + 1


def owned(cache: PagedKVCache, layer: int) -> OwnedLayer:
    """A layer of the cache, as the model's attention reaches it."""
    found = cache.layers[layer]
    assert isinstance(found, OwnedLayer)
    return found


def step(pool: BlockPool, cache: PagedKVCache, rows: list[tuple[BlockTable, int]], seed: int):
    """Runs one planned step through every layer; returns the plan, the new K/V and each layer's read-back."""
    for table, n in rows:
        assert pool.grow(table, table.length + n)
    plan = cache.plan(rows)
    key, value = new_kv(len(rows), plan.queries, seed)
    reads = []
    with cache.running(plan):
        assert cache.past == plan.width - plan.queries
        for layer in range(LAYERS):
            k, v = owned(cache, layer).update(key + layer, value + layer)
            reads.append((k.clone(), v.clone()))
    for table, n in rows:
        pool.written(table, [0] * n)
    return plan, key, value, reads


def test_rows_of_different_lengths_read_back_right_aligned_with_zero_padding() -> None:
    pool, cache = setup()
    short, long = BlockTable(prefix_seed=None), BlockTable(prefix_seed=None)
    plan, key, value, reads = step(pool, cache, [(short, 3), (long, 6)], seed=0)
    assert (plan.rows, plan.queries, plan.width) == (2, 6, 6)
    assert plan.mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    assert plan.positions.tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    for layer, (k, v) in enumerate(reads):
        assert k.shape == (2, HEADS, 6, DIM)
        # The short row's 3 new tokens are the last 3 query positions of its row; its padding reads zeros.
        assert torch.equal(k[0, :, 3:], key[0, :, 3:] + layer) and torch.equal(v[0, :, 3:], value[0, :, 3:] + layer)
        assert not k[0, :, :3].any() and not v[0, :, :3].any()
        assert torch.equal(k[1], key[1] + layer) and torch.equal(v[1], value[1] + layer)


def test_decode_steps_read_every_earlier_token_from_the_blocks() -> None:
    pool, cache = setup()
    short, long = BlockTable(prefix_seed=None), BlockTable(prefix_seed=None)
    _, key0, _, _ = step(pool, cache, [(short, 3), (long, 6)], seed=0)
    history = [[key0[0, :, 3:]], [key0[1]]]
    for i in range(4):  # crosses block boundaries of both rows
        plan, key, _, reads = step(pool, cache, [(short, 1), (long, 1)], seed=i + 1)
        assert plan.queries == 1 and plan.positions.tolist() == [[3 + i], [6 + i]]
        history[0].append(key[0])
        history[1].append(key[1])
        k = reads[0][0]
        for row, parts in enumerate(history):
            expected = torch.cat(parts, dim=1)
            pad = plan.width - expected.shape[1]
            assert torch.equal(k[row, :, pad:], expected)
            assert not k[row, :, :pad].any()
    assert short.length == 7 and long.length == 10 and len(long.blocks) == 3


def test_a_row_added_to_a_running_batch_sees_only_its_own_tokens() -> None:
    """Chunked prefill beside decode: rows in one step add different numbers of tokens."""
    pool, cache = setup()
    old = BlockTable(prefix_seed=None)
    _, key0, _, _ = step(pool, cache, [(old, 5)], seed=0)
    new = BlockTable(prefix_seed=None)
    plan, key, _, reads = step(pool, cache, [(old, 1), (new, 2)], seed=1)
    assert (plan.queries, plan.width) == (2, 6)
    assert plan.mask.tolist() == [[1] * 6, [0, 0, 0, 0, 1, 1]]
    k = reads[1][0]
    assert torch.equal(k[0], torch.cat([key0[0] + 1, key[0, :, 1:] + 1], dim=1))
    assert torch.equal(k[1, :, 4:], key[1] + 1) and not k[1, :, :4].any()


def test_released_blocks_reused_by_another_row_hold_its_own_values() -> None:
    pool, cache = setup(num_blocks=3)  # 2 usable blocks: rows must take turns
    first = BlockTable(prefix_seed=None)
    step(pool, cache, [(first, 8)], seed=0)
    pool.release(first)
    second = BlockTable(prefix_seed=None)
    _, key, _, reads = step(pool, cache, [(second, 5)], seed=1)
    assert torch.equal(reads[0][0][0], key[0])


def test_copy_slots_duplicates_a_prefix_into_another_table() -> None:
    pool, cache = setup()
    source = BlockTable(prefix_seed=None)
    _, key, _, _ = step(pool, cache, [(source, 6)], seed=0)
    target = BlockTable(prefix_seed=None)
    assert pool.grow(target, 6)
    positions = range(6)
    cache.copy_slots(
        torch.tensor([source.slot(p, SIZE) for p in positions]), torch.tensor([target.slot(p, SIZE) for p in positions])
    )
    pool.written(target, [0] * 6)
    _, key1, _, reads = step(pool, cache, [(target, 1)], seed=1)
    assert torch.equal(reads[0][0][0], torch.cat([key[0], key1[0]], dim=1))


# ----------------------------------------------------------------------------------------- grouped attention

Q_HEADS = 4  # two query heads per K/V head, as in grouped-query attention


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One row alone: `query` `[heads, n, dim]` are its last n tokens, `keys`/`values` `[kv heads, len, dim]` all of
    them; causal. Returns `[n, heads, dim]`."""
    n, length = query.shape[1], keys.shape[1]
    k = keys.repeat_interleave(Q_HEADS // HEADS, dim=0)
    v = values.repeat_interleave(Q_HEADS // HEADS, dim=0)
    scores = query @ k.transpose(1, 2) / DIM**0.5
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def grouped_step(cache: PagedKVCache, pool: BlockPool, rows: list[tuple[BlockTable, int]], seed: int):
    """A grouped step over layer 0: writes new K/V, attends; returns the plan, queries, new K/V and the output."""
    for table, n in rows:
        assert pool.grow(table, table.length + n)
    plan = cache.plan(rows)
    key, value = new_kv(len(rows), plan.queries, seed)
    query = torch.randn(len(rows), Q_HEADS, plan.queries, DIM, generator=torch.Generator().manual_seed(seed + 100))
    with cache.running(plan):
        owned(cache, 0).update(key, value)
        out = cache.attend(0, query, None)
    for table, n in rows:
        pool.written(table, [0] * n)
    return plan, query, key, value, out


@pytest.mark.parametrize("padding", [0.25, 100.0])  # rows split by length, or all in one padded group
def test_grouped_attention_equals_each_row_alone(padding: float) -> None:
    geometry = KVGeometry(LAYERS, HEADS, DIM, torch.float32)
    pool, cache = BlockPool(64, SIZE), PagedKVCache(geometry, 64, SIZE, torch.device("cpu"), group_padding=padding)
    tables = [BlockTable(prefix_seed=None) for _ in range(3)]
    history: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in tables]
    # A prefill step of three very different prompts, a chunk beside decode tokens, then decode steps.
    for seed, news in enumerate([[2, 30, 7], [1, 5, 1], [1, 1, 1], [1, 1, 1]]):
        rows = list(zip(tables, news, strict=True))
        plan, query, key, value, out = grouped_step(cache, pool, rows, seed)
        assert (len(plan.groups) == 1) == (padding == 100.0)
        assert out.shape == (3, plan.queries, Q_HEADS, DIM)
        for r, n in enumerate(news):
            history[r][0].append(key[r, :, plan.queries - n :])
            history[r][1].append(value[r, :, plan.queries - n :])
            keys, values = torch.cat(history[r][0], dim=1), torch.cat(history[r][1], dim=1)
            expected = dense_attention(query[r, :, plan.queries - n :], keys, values)
            torch.testing.assert_close(out[r, plan.queries - n :], expected, atol=1e-5, rtol=1e-5)
            assert not out[r].isnan().any()  # padding queries too: no row of scores is all masked


def test_groups_gather_only_their_own_columns() -> None:
    geometry = KVGeometry(LAYERS, HEADS, DIM, torch.float32)
    pool, cache = BlockPool(64, SIZE), PagedKVCache(geometry, 64, SIZE, torch.device("cpu"), group_padding=0.25)
    short = [BlockTable(prefix_seed=None) for _ in range(3)]
    long = BlockTable(prefix_seed=None)
    grouped_step(cache, pool, [(t, 3) for t in short] + [(long, 100)], seed=0)
    for table in [*short, long]:
        assert pool.grow(table, table.length + 1)
    plan = cache.plan([(t, 1) for t in [*short, long]])
    assert plan.gather is None
    assert sorted((g.width, g.gather.numel()) for g in plan.groups) == [(4, 12), (101, 101)]
    assert plan.groups[0].mask is None  # equal lengths, one query each: every column is seen
