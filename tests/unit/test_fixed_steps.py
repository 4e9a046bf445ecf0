"""Steps of fixed shapes (`runners/steps/fixed_steps.py`): under continuous batching, padded to buckets or not, greedy
outputs equal `generate()` alone, decode steps and prompts' prefills alike; slots never written cannot reach
attention; a step too wide for the buckets is run by the grouped step instead; decode attention may read the pool in
place; the CPU's compiled decode step is two graphs for every batch, kept on disk between starts. (CUDA graph capture
itself needs a GPU: `stress-test/cuda_run.sh breakdown`.)"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.kv_manager import KVUsage
from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.block_table import NULL_BLOCK
from transformers_openai.runners.packed_linear import pack_linear_layers
from transformers_openai.runners.steps import fixed_steps as fixed_steps_module
from transformers_openai.runners.steps.fixed_steps import batch_buckets, width_buckets
from transformers_openai.runners.steps.step_store import has_cxx_compiler, traced_sources

torch.set_num_threads(1)

NEW_TOKENS = 10
LENGTHS = [1, 30, 7, 33, 13, 25, 20, 3, 17]  # prompts of one to three blocks of 16, and more as they decode


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [list(range(100 + 3 * n, 100 + 4 * n)) or [100] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        out.append(generated[0, len(prompt) :].tolist())
    return out


def drive(runner: CausalLMRunner, tokenizer, prompts: list[list[int]], every: int = 2, usage=None) -> list[list[int]]:
    """Adds a request every `every` steps to an engine over `runner`; each request's greedy tokens (`usage`, a list,
    receives the K/V manager's usage at the end)."""
    core = EngineCore(runner, tokenizer, Scheduler(max_running=runner.spec.max_rows, max_waiting=32), frozenset())
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = [EngineRequest(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    step = 0
    while pending or core.has_work():
        if pending and step % every == 0:
            core.add(pending.pop(0))
        for output in core.step():
            assert output.error is None, output.error
            tokens[output.request_id].extend(output.token_ids)
        step += 1
    assert core.kv.usage().blocks_used == 0 and core.slots.in_use == 0
    if usage is not None:
        usage.append(core.kv.usage())
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert width_buckets(1) == [1]
    assert width_buckets(65) == [1, 2, 4, 8, 16, 32, 64, 65]
    assert width_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


class KernelCalls(TorchDispatchMode):
    """Counts the calls of the paged decode attention operator."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "transformers_openai::paged_decode_attention":
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reading", ["gathered", "in-place"])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact-shape", "bucketed"])
@pytest.mark.parametrize("every", [1, 3])
def test_fixed_steps_under_batching_match_generate(
    model, tokenizer, prompts, reference, buckets, every, reading, tmp_path
) -> None:
    """Decode attention gathering the rows' K/V for sdpa, or reading them in place (the CPU's kernel)."""
    runner = CausalLMRunner(model, max_rows=5, max_model_len=128)
    assert runner.fix_steps(graphs=False, buckets=buckets)
    fixed = runner.fixed
    assert fixed is not None
    taken = {"decode": 0, "prefill": 0, "kernel": 0}
    if reading == "in-place":
        if not has_cxx_compiler():
            pytest.skip("the kernel is built with a C++ compiler")
        assert fixed.read_in_place(tmp_path)

    def counting(name: str):
        method = getattr(fixed, name)

        def counted(*args):
            out = method(*args)
            taken[name] += out is not None
            return out

        return counted

    fixed.decode = counting("decode")  # type: ignore[method-assign]
    fixed.prefill = counting("prefill")  # type: ignore[method-assign]
    with KernelCalls() as calls:
        assert drive(runner, tokenizer, prompts, every) == reference
    taken["kernel"] = calls.count
    assert taken["decode"] > NEW_TOKENS  # the decode steps ran the fixed path
    assert taken["prefill"] > 0  # and so did the prompts' prefills
    layers = model.config.num_hidden_layers
    if reading == "in-place":  # every layer of every step of one new token a row (one-token prompts' prefills too)
        assert taken["kernel"] >= taken["decode"] * layers and taken["kernel"] % layers == 0
    else:
        assert taken["kernel"] == 0


@pytest.mark.parametrize("reading", ["gathered", "in-place"])
def test_the_store_key_covers_every_module_the_decode_step_runs(tiny_llama_dir: Path, reading, tmp_path) -> None:
    """The compiled step's store key hashes the source of `TRACED_MODULES` only: the eager decode step, which is
    what the compiler traces, calls into no other module of this package (packed weights, the matrix-vector kernel
    of few rows and the in-place kernel included)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    pack_linear_layers(model, tmp_path / "kernels" if has_cxx_compiler() else None)  # with the 1-4 row kernel
    runner = CausalLMRunner(model, max_rows=4, max_model_len=128)
    assert runner.fix_steps(graphs=False, prefills=False)
    fixed = runner.fixed
    assert fixed is not None
    if reading == "in-place" and not (has_cxx_compiler() and fixed.read_in_place(tmp_path)):
        pytest.skip("the kernel is built with a C++ compiler")
    package = Path(fixed_steps_module.__file__).resolve().parents[2]
    called: set[str] = set()

    def record(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(str(package)):
            called.add(str(Path(frame.f_code.co_filename).resolve()))

    with torch.inference_mode():
        for rows in (1, 2):
            example = fixed._example((rows, 1, 2))
            sys.setprofile(record)
            try:
                example[0]._device_step(*example[1:])
            finally:
                sys.setprofile(None)
    assert str(Path(fixed_steps_module.__file__).resolve()) in called
    assert called <= {str(source) for source in traced_sources()}


def test_a_background_compile_that_fails_leaves_eager_steps_serving(
    model, tokenizer, prompts, reference, tmp_path, caplog
) -> None:
    """The server's compiled step is made in the background (`compile_in_background`): when its compile fails,
    steps go on eagerly with the same outputs, and the log says so."""
    runner = CausalLMRunner(model, max_rows=5, max_model_len=128)
    told: list[str] = []

    def fails() -> None:
        raise RuntimeError("the compile process exited with code 1")

    with caplog.at_level(logging.INFO, logger="transformers_openai.runners.steps.background_steps"):
        assert runner.compile_in_background(tmp_path, fails, told.append)
        background = runner._background
        assert background is not None and background.finished.wait(120)
        assert drive(runner, tokenizer, prompts) == reference
    assert runner.fixed is None and runner._background is None
    assert told == ["compiling", "eager"]
    assert "decode steps stay eager" in caplog.text


def test_slots_never_written_do_not_reach_attention(model, tokenizer, prompts, reference) -> None:
    """A pool whose unwritten slots hold NaN (as fresh `torch.empty` memory may): the padded columns of a fixed
    step read the zero block instead, so nothing changes."""
    runner = CausalLMRunner(model, max_rows=4, max_model_len=128)
    assert runner.fix_steps(graphs=False, buckets=True)
    cache = runner._pool.cache
    size = cache.block_size
    for pool in (*cache._k, *cache._v):
        pool[:, (NULL_BLOCK + 1) * size : cache.trash_block * size] = float("nan")
    assert drive(runner, tokenizer, prompts) == reference


def test_a_step_too_wide_for_the_buckets_runs_grouped(model, tokenizer, prompts, reference) -> None:
    runner = CausalLMRunner(model, max_rows=4, max_model_len=128)
    assert runner.fix_steps(graphs=False, buckets=True)
    fixed = runner.fixed
    assert fixed is not None
    fixed.most_tokens = 2 * 2 * 16  # two rows of two blocks: wider steps go the grouped way
    grouped = 0
    forward = runner.executor.forward

    def counted(rows, keep):
        nonlocal grouped
        grouped += all(len(tokens) == 1 for _, tokens in rows)
        return forward(rows, keep)

    runner.executor.forward = counted  # type: ignore[method-assign]
    assert drive(runner, tokenizer, prompts, every=1) == reference
    assert grouped > 0


def test_a_cached_prefix_is_followed_by_a_fixed_prefill_of_the_rest(model, tokenizer, prompts, reference) -> None:
    """The second request with the same prompt reuses its full blocks: its prefill starts after them."""
    runner = CausalLMRunner(model, max_rows=4, max_model_len=128)
    assert runner.fix_steps(graphs=False, buckets=True)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    twice = [prompts[longest], prompts[longest]]
    usage: list[KVUsage] = []
    assert drive(runner, tokenizer, twice, every=NEW_TOKENS + 2, usage=usage) == [reference[longest]] * 2
    assert usage[0].prefix_hits >= 16


def test_fixed_steps_need_plain_causal_attention(tiny_llama_dir: Path) -> None:
    eager = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    runner = CausalLMRunner(eager.eval(), max_rows=2, max_model_len=64)
    assert not runner.fix_steps(graphs=False)
    assert runner.fixed is None


@pytest.mark.skipif(
    not has_cxx_compiler(), reason="torch.compile's CPU kernels need a C++ compiler (scripts/test.sh installs g++)"
)
# Packed (oneDNN) weights: the server's default, compiled in a child process and loaded by the server in
# tests/e2e/test_background_compile.py.
@pytest.mark.parametrize("weights", ["plain"])
def test_compiled_decode_under_batching_matches_generate(
    tiny_llama_dir, tokenizer, prompts, weights, tmp_path, caplog
) -> None:
    """The CPU server's decode step: compiled at a first start and kept on disk, then loaded by the next start with
    nothing compiled; either way its two graphs (one row; two rows or more) run every decode step, whatever the
    batch size and width as rows join and leave, and prompts keep the grouped eager prefill. Packed (oneDNN) weights
    reach the graph through their own operator."""
    expected = None
    for how in ("compiled", "loaded"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        if weights == "packed" and not pack_linear_layers(model):
            pytest.skip("this CPU or torch build cannot pack weights for oneDNN")
        if expected is None:
            expected = [
                model.generate(
                    torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
                )[0, len(p) :].tolist()
                for p in prompts
            ]
        runner = CausalLMRunner(model, max_rows=5, max_model_len=128)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="transformers_openai.runners.steps.fixed_steps"):
            assert runner.fix_steps(graphs=False, compiled=True, prefills=False, store=tmp_path)
        assert f"{how} 1/2 decode step graphs" in caplog.text and f"{how} 2/2" in caplog.text, caplog.text
        assert "reads each row's K/V in place" in caplog.text
        fixed = runner.fixed
        assert fixed is not None
        taken = {"decode": 0, "prefill": 0, "compiled": 0}
        for name in ("decode", "prefill"):
            method = getattr(fixed, name)

            def counted(*args, name=name, method=method, taken=taken):
                out = method(*args)
                taken[name] += out is not None
                return out

            setattr(fixed, name, counted)
        for rows, step in list(fixed._compiled.items()):

            def compiled(*args, step=step, taken=taken):
                taken["compiled"] += 1
                return step(*args)

            fixed._compiled[rows] = compiled
        assert drive(runner, tokenizer, prompts, every=1) == expected
        assert taken["prefill"] == 0 and taken["decode"] > NEW_TOKENS
        assert taken["compiled"] == taken["decode"]  # every decode step ran one of the two graphs
    assert len(list(tmp_path.glob("decode-*.bin"))) == 2
