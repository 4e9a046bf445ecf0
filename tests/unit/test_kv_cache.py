"""BatchKVCache + SlotTable: right-aligned rows, compaction on leave, trimming, growth and the attention mask."""

from __future__ import annotations

import random

import pytest
import torch

from transformers_openai.runners.kv_cache import BatchKVCache
from transformers_openai.runners.slots import SlotTable

torch.set_num_threads(1)

LAYERS, HEADS, DIM = 2, 2, 4


def kv(length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A single-request cache: per layer `[1, heads, length, dim]` keys and values, never zero."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(1, HEADS, length, DIM, generator=g) + 1, torch.rand(1, HEADS, length, DIM, generator=g) + 1)
        for _ in range(LAYERS)
    ]


def view(cache: BatchKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's `[rows, heads, length, dim]` K/V as an attention layer sees them (a zero-column write)."""
    empty = torch.zeros(cache.rows, HEADS, 0, DIM)
    return cache.write(layer, empty, empty)


def assert_row(cache: BatchKVCache, pos: int, expected: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Row `pos` holds `expected` in its last columns and zeros before them."""
    n = expected[0][0].shape[-2]
    assert cache.lens[pos] == n
    pad = cache.length - n
    for layer, (key, value) in enumerate(expected):
        k, v = view(cache, layer)
        assert torch.equal(k[pos, :, pad:], key[0]) and torch.equal(v[pos, :, pad:], value[0])
        assert not k[pos, :, :pad].any() and not v[pos, :, :pad].any()


def test_insert_right_aligns_rows_of_different_lengths() -> None:
    cache = BatchKVCache(LAYERS, max_rows=4, max_len=64)
    rows = [kv(3, 0), kv(7, 1), kv(5, 2)]
    assert [cache.insert(r) for r in rows] == [0, 1, 2]
    assert cache.rows == 3 and cache.length == 7 and cache.lens == [3, 7, 5]
    assert cache.get_seq_length() == 7
    for pos, r in enumerate(rows):
        assert_row(cache, pos, r)


def test_insert_beyond_max_rows_fails() -> None:
    cache = BatchKVCache(LAYERS, max_rows=1, max_len=64)
    cache.insert(kv(2, 0))
    with pytest.raises(RuntimeError):
        cache.insert(kv(2, 1))


def test_remove_middle_row_moves_last_row_into_hole() -> None:
    cache = BatchKVCache(LAYERS, max_rows=4, max_len=64)
    rows = [kv(3, 0), kv(7, 1), kv(5, 2), kv(2, 3)]
    for r in rows:
        cache.insert(r)
    assert cache.remove(1) == 3
    assert cache.rows == 3 and cache.lens == [3, 2, 5]
    assert cache.length == 5  # the longest row left: leading padding trimmed
    for pos, r in enumerate([rows[0], rows[3], rows[2]]):
        assert_row(cache, pos, r)


def test_remove_last_row_moves_nothing() -> None:
    cache = BatchKVCache(LAYERS, max_rows=4, max_len=64)
    rows = [kv(4, 0), kv(6, 1)]
    for r in rows:
        cache.insert(r)
    assert cache.remove(1) is None
    assert cache.length == 4 and cache.lens == [4]
    assert_row(cache, 0, rows[0])


def test_buffers_dropped_when_empty() -> None:
    cache = BatchKVCache(LAYERS, max_rows=2, max_len=64)
    cache.insert(kv(5, 0))
    cache.insert(kv(3, 1))
    cache.remove(0)
    cache.remove(0)
    assert cache.rows == 0 and cache.length == 0 and cache.lens == []
    assert cache._k == [] and cache._v == []  # memory follows live requests
    again = kv(2, 2)
    assert cache.insert(again) == 0
    assert_row(cache, 0, again)


def test_attention_mask_marks_real_tokens_and_new_ones() -> None:
    cache = BatchKVCache(LAYERS, max_rows=3, max_len=64)
    for n, seed in [(2, 0), (5, 1), (1, 2)]:
        cache.insert(kv(n, seed))
    mask = cache.attention_mask(extra=1)
    expected = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    assert torch.equal(mask, expected)


def test_decode_steps_grow_capacity_and_keep_data() -> None:
    cache = BatchKVCache(LAYERS, max_rows=2, max_len=256)
    rows = [kv(3, 0), kv(9, 1)]
    for r in rows:
        cache.insert(r)
    steps = [kv(1, 100 + s) for s in range(60)]  # many more columns than the first allocation
    for step in steps:
        cache.ensure_room(1)
        for layer, (key, value) in enumerate(step):
            cache.write(layer, key.expand(2, -1, -1, -1), value.expand(2, -1, -1, -1))
        cache.advance(1)
    assert cache.length == 69 and cache.lens == [63, 69]
    for pos, r in enumerate(rows):
        grown = [
            (torch.cat([k, *(s[layer][0] for s in steps)], dim=2), torch.cat([v, *(s[layer][1] for s in steps)], dim=2))
            for layer, (k, v) in enumerate(r)
        ]
        assert_row(cache, pos, grown)


@pytest.mark.parametrize("seed", range(5))
def test_slot_table_follows_rows_through_random_joins_and_leaves(seed: int) -> None:
    rng = random.Random(seed)
    cache, slots = BatchKVCache(LAYERS, max_rows=4, max_len=128), SlotTable(4)
    live: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for step in range(40):
        if live and (len(live) == 4 or rng.random() < 0.45):
            slot = rng.choice(list(live))
            moved = cache.remove(slots.pos(slot))
            slots.remove(slot, moved)
            del live[slot]
        else:
            data = kv(rng.randint(1, 20), seed * 100 + step)
            slot = slots.add(cache.insert(data))
            assert slot not in live
            live[slot] = data
        assert len(slots) == cache.rows == len(live)
        assert sorted(slots.order()) == sorted(live)
        assert cache.length == max(cache.lens, default=0)
        for slot, data in live.items():
            assert slots.order()[slots.pos(slot)] == slot
            assert_row(cache, slots.pos(slot), data)
