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

import hashlib
import logging
import subprocess
import tempfile
from pathlib import Path

import torch

from transformers_openai.runners.steps.step_store import cpu_flags, cxx_compiler

logger = logging.getLogger(__name__)

OP = "transformers_openai::paged_decode_attention"
CROSS_OP = "transformers_openai::cross_decode_attention"

SOURCE_FILE = Path(__file__).parent / "csrc" / "decode_attention.cpp"  # shipped as package data


def _command(cxx: str, source: Path, target: Path) -> list[str]:
    """Built against this torch's headers and libraries, as its own C++ operators are."""
    torch_dir = Path(torch.__file__).parent
    libraries = torch_dir / "lib"
    return [
        cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-Wall", "-Wextra",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        # torch's headers as system headers: the warnings asked for are this kernel's own.
        "-isystem", str(torch_dir / "include"),
        "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
        "-o", str(target), str(source), f"-L{libraries}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libraries}",
    ]  # fmt: skip


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
    cxx = cxx_compiler()
    if cxx is None:
        return False
    source_text = SOURCE_FILE.read_text()
    key = [source_text, " ".join(_command(Path(cxx).name, Path(), Path())), cpu_flags(), torch.__version__]
    target = directory / f"paged-decode-{hashlib.sha256(chr(0).join(key).encode()).hexdigest()[:24]}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                source, built = Path(scratch) / "kernel.cpp", Path(scratch) / "kernel.so"
                source.write_text(source_text)  # the digested text, whatever happens to the package's file meanwhile
                done = subprocess.run(
                    _command(cxx, source, built), check=True, capture_output=True, text=True, timeout=600
                )
                if done.stderr.strip():  # built with -Wall -Wextra: a warning here is a finding in the kernel
                    logger.warning("the decode attention kernel built with compiler warnings:\n%s", done.stderr)
                built.replace(target)  # atomic: a start beside this one sees the whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("the paged decode attention kernel could not be built: %s", detail)
            return False
    try:
        torch.ops.load_library(str(target))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("the paged decode attention kernel could not be loaded: %s", exc)
        return False
    # Their outputs' shapes, for the compiler.
    for op in (OP, CROSS_OP):
        torch.library.register_fake(op, _like_query)
    return True


def _like_query(query: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _registered() -> bool:
    return hasattr(torch.ops.transformers_openai, "paged_decode_attention")
