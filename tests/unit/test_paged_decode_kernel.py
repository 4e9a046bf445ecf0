"""The CPU kernel for decode attention over the paged pool gives what gathering each row's K/V and running
`scaled_dot_product_attention` gives: any block tables (shared blocks included), any lengths, grouped K/V heads; its
cross-attention kernel, over K/V kept per row with the keys transposed, gives what sdpa gives over the same views."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformers_openai.runners.kernels.paged_decode_kernel import attention, cross_attention, load
from transformers_openai.runners.steps.step_store import has_cxx_compiler

pytestmark = pytest.mark.skipif(not has_cxx_compiler(), reason="the kernel is built with a C++ compiler")

BLOCK = 4


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., torch.Tensor]:
    assert load(tmp_path_factory.mktemp("kernels"))
    return attention


def gathered(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    block: int = BLOCK,
    scale: float | None = None,
) -> torch.Tensor:
    """The reference: each row's tokens read out of the pool, padded to the widest, masked past its length."""
    rows, width = tables.shape
    slots = (tables[:, :, None] * block + torch.arange(block)).reshape(rows, width * block)
    k = keys[:, slots].transpose(0, 1)  # [rows, kv_heads, columns, dim]
    v = values[:, slots].transpose(0, 1)
    mask = (torch.arange(width * block)[None, :] < lengths[:, None])[:, None, None, :]
    gqa = query.shape[1] != keys.shape[0]
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_kernel_equals_gathered_sdpa(
    kernel: Callable[..., torch.Tensor], heads: int, kv_heads: int, rows: int
) -> None:
    generator = torch.Generator().manual_seed(rows * 100 + heads)
    dim, blocks, width = 32, 40, 6
    keys = torch.randn(kv_heads, blocks * BLOCK, dim, generator=generator)
    values = torch.randn(kv_heads, blocks * BLOCK, dim, generator=generator)
    tables = torch.randint(1, blocks, (rows, width), generator=generator)
    tables[-1] = tables[0]  # two rows holding the same blocks (a shared prefix)
    lengths = torch.randint(1, width * BLOCK + 1, (rows,), generator=generator)
    lengths[0] = 1  # a row of one token
    query = torch.randn(rows, 1, heads, dim, generator=generator).transpose(1, 2)  # as the model hands it over
    expected = gathered(query, keys, values, tables, lengths)
    got = kernel(query, keys, values, tables, lengths, BLOCK, dim**-0.5)
    assert got.shape == (rows, heads, 1, dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [16, 64, 80])  # sizes unrolled at compile time, and one that is not
@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])  # flat to sharp scores: e^x over its whole range
def test_head_sizes_and_blocks_of_sixteen(kernel: Callable[..., torch.Tensor], dim: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(dim)
    block, blocks, width, rows, heads, kv_heads = 16, 40, 5, 7, 6, 3
    keys = torch.randn(kv_heads, blocks * block, dim, generator=generator)
    values = torch.randn(kv_heads, blocks * block, dim, generator=generator)
    tables = torch.randperm(blocks, generator=generator)[: rows * width].view(rows, width)
    lengths = torch.tensor([1, 3, 16, 17, 33, 61, 80])  # part-blocks, whole blocks, a tail of 1 to 3 keys
    query = torch.randn(rows, 1, heads, dim, generator=generator).transpose(1, 2)
    expected = gathered(query, keys, values, tables, lengths, block, scale)
    got = kernel(query, keys, values, tables, lengths, block, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tokens_past_a_row_s_length_are_never_read(kernel: Callable[..., torch.Tensor]) -> None:
    keys, values = torch.randn(2, 10 * BLOCK, 8), torch.randn(2, 10 * BLOCK, 8)
    tables, lengths = torch.tensor([[3, 4, 5]]), torch.tensor([5])
    query = torch.randn(1, 2, 1, 8)
    before = kernel(query, keys, values, tables, lengths, BLOCK, 0.3)
    keys[:, 4 * BLOCK + 1 :] = float("nan")  # the row's tokens 5.. and everything after its blocks
    values[:, 4 * BLOCK + 1 :] = float("nan")
    keys[:, : 3 * BLOCK] = float("nan")
    after = kernel(query, keys, values, tables, lengths, BLOCK, 0.3)
    assert torch.equal(before, after)


LOAD_AND_CALL = """
import sys
from pathlib import Path
import torch
from transformers_openai.runners.kernels.paged_decode_kernel import attention, cross_attention, load
assert load(Path(sys.argv[1]))
keys, values = torch.ones(1, 8, 4), torch.arange(32.0).view(1, 8, 4)
out = attention(torch.ones(1, 1, 1, 4), keys, values, torch.tensor([[1]]), torch.tensor([2]), 4, 0.5)
print(out.flatten().tolist())
"""


def test_a_kernel_built_once_is_loaded_from_its_directory(tmp_path: Path) -> None:
    """A fresh process builds the library into the directory; the next one loads it from there, and both get the
    operator (here: equal scores, so the mean of the values of slots 4 and 5). The build, with -Wall -Wextra, warns
    of nothing (a warning would be logged to stderr)."""

    def start() -> str:
        done = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, str(tmp_path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "compiler warnings" not in done.stderr, done.stderr
        return done.stdout.strip()

    assert start() == "[18.0, 19.0, 20.0, 21.0]"
    built = list(tmp_path.glob("paged-decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert start() == "[18.0, 19.0, 20.0, 21.0]"
    assert built[0].stat().st_mtime_ns == stamp and list(tmp_path.glob("*")) == built  # not built again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 24])
def test_the_cross_attention_kernel_equals_sdpa_over_the_same_views(
    kernel: Callable[..., torch.Tensor], dim: int, dtype: torch.dtype
) -> None:
    """Buffers as `CrossKVCache` keeps them (keys `[rows, heads, dim, max_len]`, values `[rows, heads, max_len,
    dim]`), read through the views a step takes: some rows of the buffer, a width short of its length."""
    generator = torch.Generator().manual_seed(dim)
    rows, heads, max_len, width = 7, 3, 40, 33
    keys_t = torch.randn(rows, heads, dim, max_len, generator=generator).to(dtype)
    values = torch.randn(rows, heads, max_len, dim, generator=generator).to(dtype)
    keys_view, values_view = keys_t[1:6, ..., :width], values[1:6, :, :width]
    query = (torch.randn(5, heads, 1, dim, generator=generator) * 3).to(dtype)
    got = cross_attention(query, keys_view, values_view, 0.3)
    assert got.dtype == dtype
    # The reference in float32 from the same stored values: the kernel computes in float32 and rounds its output.
    want = F.scaled_dot_product_attention(
        query.float(), keys_view.transpose(-1, -2).float(), values_view.float(), scale=0.3
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
