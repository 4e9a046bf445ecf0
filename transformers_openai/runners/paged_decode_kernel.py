"""A CPU kernel for decode attention that reads each row's K/V in place in the paged pool.

A decode step's query is one token per row. Gathering the rows' K/V out of the pool into a padded batch (what
`scaled_dot_product_attention` needs) copies all of it every layer, and then attention reads the copy again: at 64
rows of about 120 tokens that was a third of SmolLM2's step on two cores. This kernel walks each row's block table
instead and reads every key and value once: scores, softmax and the weighted sum of values per (row, K/V head),
the query heads that share a K/V head together, rows and heads spread over the calling thread's OpenMP team.

It is plain C++ built here once with the system's compiler (the one inductor's kernels need) and kept beside the
compiled steps, named by a digest of its source, the compiler command and the CPU's flags; it is reached through the
operator `torch.ops.transformers_openai.paged_decode_attention`, which compiled graphs call as an opaque step.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import subprocess
import tempfile
from pathlib import Path

import torch

from transformers_openai.runners.step_store import cpu_flags, cxx_compiler

logger = logging.getLogger(__name__)

OP = "transformers_openai::paged_decode_attention"

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <vector>

// q [rows, heads, dim]; pools [kv_heads, slots, dim]; tables [rows, width] (block ids); lengths [rows] (tokens
// each row attends to, its newest included); out [rows, heads, dim]. Query head h reads K/V head h / group.
extern "C" void paged_decode_attention_f32(
    const float* q, const float* k_pool, const float* v_pool, const int64_t* tables, const int64_t* lengths,
    float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots, int64_t width,
    int64_t block, float scale, int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t items = rows * kv_heads;
  const int64_t most = width * block;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(group * most);
    std::vector<float> top(group);
    std::vector<float> acc(group * dim);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t row = item / kv_heads, head = item % kv_heads;
      const int64_t length = lengths[row] < most ? lengths[row] : most;
      const float* query = q + (row * heads + head * group) * dim;
      const float* keys = k_pool + head * slots * dim;
      const float* values = v_pool + head * slots * dim;
      const int64_t* table = tables + row * width;
      for (int64_t g = 0; g < group; ++g) top[g] = -INFINITY;
      // Scores, block by block: each block's keys are `block` consecutive slots.
      for (int64_t start = 0; start < length; start += block) {
        const float* key = keys + table[start / block] * block * dim;
        const int64_t count = length - start < block ? length - start : block;
        for (int64_t i = 0; i < count; ++i, key += dim) {
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = query + g * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * key[d];
            dot *= scale;
            scores[g * most + start + i] = dot;
            top[g] = dot > top[g] ? dot : top[g];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * most;
        float total = 0.0f;
        for (int64_t pos = 0; pos < length; ++pos) {
          s[pos] = std::exp(s[pos] - top[g]);
          total += s[pos];
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t pos = 0; pos < length; ++pos) s[pos] *= inverse;
      }
      for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.0f;
      for (int64_t start = 0; start < length; start += block) {
        const float* value = values + table[start / block] * block * dim;
        const int64_t count = length - start < block ? length - start : block;
        for (int64_t i = 0; i < count; ++i, value += dim) {
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * most + start + i];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
          }
        }
      }
      float* o = out + (row * heads + head * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) o[i] = acc[i];
    }
  }
}
"""


def _command(cxx: str, source: Path, target: Path) -> list[str]:
    return [cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(target), str(source)]


class PagedDecodeKernel:
    """The built kernel, called on float32 tensors (see the module's docstring)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.paged_decode_attention_f32
        function.restype = None
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
        self._function = function

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of `query` `[rows, heads, 1, dim]` over each row's first `lengths[row]` tokens in the pools
        `[kv_heads, slots, dim]` through its block table `tables[row]`; returns `[rows, heads, 1, dim]`."""
        rows, heads, _, dim = query.shape
        query = query.contiguous()
        tables, lengths = tables.contiguous(), lengths.contiguous()
        out = torch.empty_like(query)
        self._function(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
            out.data_ptr(), rows, heads, keys.shape[0], dim, keys.shape[1], tables.shape[1], block_size, scale,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def load(directory: Path) -> PagedDecodeKernel | None:
    """The kernel built for this CPU, from `directory` where an earlier start left it, else built there now (a second
    or two); None where there is no compiler or the build fails (attention then gathers as before)."""
    cxx = cxx_compiler()
    if cxx is None:
        return None
    digest = hashlib.sha256(
        "\0".join([SOURCE, " ".join(_command(Path(cxx).name, Path(), Path())), cpu_flags()]).encode()
    )
    target = directory / f"paged-decode-{digest.hexdigest()[:24]}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                source, built = Path(scratch) / "kernel.cpp", Path(scratch) / "kernel.so"
                source.write_text(SOURCE)
                subprocess.run(_command(cxx, source, built), check=True, capture_output=True, text=True, timeout=300)
                built.replace(target)  # atomic: a start beside this one sees the whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("the paged decode attention kernel could not be built: %s", detail)
            return None
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(target)))
    except OSError as exc:
        logger.warning("the paged decode attention kernel could not be loaded: %s", exc)
        return None


def register_op(kernel: PagedDecodeKernel) -> None:
    """Registers `torch.ops.transformers_openai.paged_decode_attention` (the kernel; its output's shape for the
    compiler). The first kernel registered serves the process."""
    if hasattr(torch.ops.transformers_openai, "paged_decode_attention"):
        return
    torch.library.define(
        OP,
        "(Tensor query, Tensor keys, Tensor values, Tensor tables, Tensor lengths, int block_size, float scale)"
        " -> Tensor",
    )

    torch.library.impl(OP, "CompositeExplicitAutograd", lambda *args: kernel(*args))
    torch.library.register_fake(OP, lambda query, *_: torch.empty_like(query, memory_format=torch.contiguous_format))
