"""Which K/V blocks each request holds: allocation, reference counts and the prefix cache (no tensors here).

The pool's block 0 (`NULL_BLOCK`) is never handed out: it stays zero and is what padding columns read.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from transformers_openai.runners.kv.block_table import NULL_BLOCK, BlockTable


class BlockPool:
    """Hands out fixed-size blocks; full blocks are kept by content so a later prompt with the same start reuses them.

    A block is free, held (reference count > 0), or cached (count 0, content still valid, reusable by a prefix
    match or evicted least recently used when free blocks run out).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("the K/V pool needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # popped from the end: low ids first
        self._refs = [0] * num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # count-0 blocks with content, oldest first
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        return self.usable - self.available

    @property
    def cached(self) -> int:
        """Blocks nobody holds whose content the prefix cache keeps (taken for new blocks only when none is free)."""
        return len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        """Gives an empty table the cached blocks its tokens start with; returns how many tokens they hold.

        At least the last token is left out, so the model still computes its logits.
        """
        if table.blocks or table.prefix_seed is None:
            return 0
        self.prefix_queries += len(token_ids)
        size = self.block_size
        digest = table.prefix_seed
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            digest = _digest(digest, token_ids[start : start + size])
            block = self._by_digest.get(digest)
            if block is None:
                break
            self._hold(block)
            table.blocks.append(block)
            table.digests.append(digest)
        table.length = len(table.blocks) * size
        table.tokens = list(token_ids[: table.length])
        self.prefix_hits += table.length
        return table.length

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Makes room in `table` for `tokens` tokens in all; False (nothing taken) if the pool cannot."""
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed <= 0:
            return True
        if needed > self.available:
            return False
        table.blocks.extend(self._take() for _ in range(needed))
        return True

    def written(self, table: BlockTable, token_ids: list[int]) -> None:
        """Records tokens just written at the table's end; blocks they fill join the prefix cache."""
        table.length += len(token_ids)
        if table.prefix_seed is None:
            return
        table.tokens.extend(token_ids)
        size = self.block_size
        while (len(table.digests) + 1) * size <= table.length:
            index = len(table.digests)
            parent = table.digests[-1] if table.digests else table.prefix_seed
            digest = _digest(parent, table.tokens[index * size : (index + 1) * size])
            table.digests.append(digest)
            block = table.blocks[index]
            if digest not in self._by_digest:  # an identical block already cached stays the one found
                self._by_digest[digest] = block
                self._digest_of[block] = digest

    def truncate(self, table: BlockTable, blocks: int) -> None:
        """Gives back the blocks of `table` past its first `blocks` (blocks it grew into and did not fill: held by
        this table alone, in no prefix). The table gets a new list, so whoever mirrors it sees the change."""
        if len(table.blocks) <= blocks:
            return
        for block in reversed(table.blocks[blocks:]):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        table.blocks = table.blocks[:blocks]

    def release(self, table: BlockTable) -> None:
        """Gives back every block of `table` (cached ones stay matchable until evicted) and empties it."""
        for block in reversed(table.blocks):  # the tail first: evicted before the prefix it extends
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        table.blocks, table.digests, table.tokens, table.length = [], [], [], 0

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._by_digest[self._digest_of.pop(block)]
        self._refs[block] = 1
        return block


def _digest(parent: bytes, token_ids: list[int]) -> bytes:
    """A block's identity: its tokens and everything before them (through the parent's digest)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()
