"""A CPU kernel for decode attention that reads each row's K/V in place in the paged pool.

A decode step's query is one token per row. Gathering the rows' K/V out of the pool into a padded batch (what
`scaled_dot_product_attention` needs) copies all of it every layer, and then attention reads the copy again: at 64
rows of about 120 tokens that was a third of SmolLM2's step on two cores. This kernel walks each row's block table
instead and reads every key and value once: scores, softmax and the weighted sum of values per (row, K/V head),
the query heads that share a K/V head together, rows and heads spread over the calling thread's OpenMP team.

It is C++ (`csrc/decode_attention.cpp`) built here once with the system's compiler (the one inductor's kernels
need) against torch's headers, and kept beside the compiled steps, named by a digest of its source, the compiler
command, the CPU's flags and torch's version. It registers the operator
`torch.ops.transformers_openai.paged_decode_attention` itself, in C++, which compiled graphs call as an opaque step:
dispatched without Python, a call costs a few microseconds where an operator implemented in Python cost several times
more.

The same library holds `torch.ops.transformers_openai.cross_decode_attention`: a decode query over K/V kept whole
per row with the keys transposed, as `CrossKVCache` keeps an encoder-decoder model's cross-attention K/V
(`cross_attention.py` routes Whisper's decode steps to it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from transformers_openai.runners.kernels.native_build import build_and_load

OP = "transformers_openai::paged_decode_attention"
CROSS_OP = "transformers_openai::cross_decode_attention"

SOURCE_FILE = Path(__file__).parent / "csrc" / "decode_attention.cpp"  # shipped as package data


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of `query` `[rows, heads, 1, dim]` over each row's first `lengths[row]` tokens in the pools
    `[kv_heads, slots, dim]` through its block table `tables[row]`; returns `[rows, heads, 1, dim]` (float32; the
    operator must be loaded: `load`)."""
    out: torch.Tensor = torch.ops.transformers_openai.paged_decode_attention(
        query, keys, values, tables, lengths, block_size, scale
    )
    return out


def cross_attention(query: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of `query` `[rows, heads, 1, dim]` over K/V kept whole per row, the keys transposed: `keys_t`
    `[rows, heads, dim, length]`, `values` `[rows, heads, length, dim]`, each with its last dimension contiguous;
    returns `[rows, heads, 1, dim]` (float32 or bfloat16, all alike; the library must be loaded: `load`)."""
    out: torch.Tensor = torch.ops.transformers_openai.cross_decode_attention(query, keys_t, values, scale)
    return out


def load(directory: Path) -> bool:
    """Makes `torch.ops.transformers_openai.paged_decode_attention` available: the library built for this CPU and
    this torch, from `directory` where an earlier start left it, else built there now (seconds); False where
    there is no compiler or the build fails (attention then gathers as before). One library serves the process: once
    the operator is there, nothing is built or loaded again."""
    if _registered():
        return True
    if not build_and_load(SOURCE_FILE, "paged-decode", directory, "paged decode attention kernel"):
        return False
    # Their outputs' shapes, for the compiler.
    for op in (OP, CROSS_OP):
        torch.library.register_fake(op, _like_query)
    return True


def _like_query(query: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _registered() -> bool:
    return hasattr(torch.ops.transformers_openai, "paged_decode_attention")
