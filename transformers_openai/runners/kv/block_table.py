"""A request's place in the paged K/V pool, as the engine's K/V manager hands it to the runner (no tensors here).

The pool's block 0 is never handed out: it stays zero and is what padding columns read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NULL_BLOCK = 0


@dataclass
class BlockTable:
    """One request's blocks in order, the tokens written to them, and the digests of its full blocks.

    The engine's K/V manager allocates the blocks and records what is written; the runner reads `blocks` and
    `length` (its next token's position) and writes K/V there. `prefix_seed` is None when its blocks are never
    shared (an encoder-decoder's decoder K/V depend on the input).
    """

    prefix_seed: bytes | None = b""
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are written
    tokens: list[int] = field(default_factory=list)  # those tokens' ids, kept while blocks may be shared
    digests: list[bytes] = field(default_factory=list)  # one per full block registered in the prefix cache

    def slot(self, position: int, block_size: int) -> int:
        """The pool slot holding token `position`."""
        return self.blocks[position // block_size] * block_size + position % block_size
