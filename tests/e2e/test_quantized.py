"""Quantized models served: greedy outputs under batching, streamed or not, with preemption among them, equal the
same quantized model's own `generate` alone; /v1/models and /metrics name the quantization; a format this host
cannot run stops the start with an error that names what it needs."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e import reference
from tests.e2e.conftest import async_client
from tests.e2e.server import ServerProcess, start_server
from tests.quantized_models import build_compressed_tensors, build_gptq, build_torchao, with_quantization_config
from transformers_openai.runners.base import Acceleration
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kv.block_table import BlockTable
from transformers_openai.runners.packed_linear import pack_linear_layers

# As in test_kv_budget.py: 200 KiB hold 24 blocks of 16 tokens of the tiny Llama, fewer than 8 rows of 72 tokens need.
BUDGET = ["--max-batch-size", "8", "--kv-cache-memory", "200KiB"]
PROMPTS = [
    f"Item {i}: a line about {topic} and nothing else"
    for i, topic in enumerate(["rivers", "bread", "old maps", "winter", "trains", "stars", "the moon", "cats"])
]
MAX_TOKENS = 60


@dataclass
class Quantized:
    served: str  # what /v1/models and /metrics must say
    model_dir: Path  # what the server is started on
    reference_dir: Path  # the quantized model `generate` runs alone
    args: tuple[str, ...] = ()
    int8_dynamic: bool = False  # the reference swaps in the int8 layers as the server does
    # Activations quantized per token at run time: a float difference of the batched kernels (paged attention,
    # another summation order) can round one activation a quantization step the other way, so a greedy path may
    # leave the reference's, where two tokens nearly tie.
    quantized_activations: bool = False
    int8_layers: int = 0  # linear layers the server computes with in int8 (our own layers)


@pytest.fixture(scope="session")
def quantized_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quantized")


def _format(name: str, tiny_llama_dir: Path, root: Path) -> Quantized:
    if name == "torchao-int8-weight-only checkpoint":
        made = build_torchao(tiny_llama_dir, root / "torchao-int8wo", "Int8WeightOnlyConfig")
        return Quantized("torchao-int8-weight-only", made, made)
    if name == "--quantization int8-weight-only":  # the same weights as the checkpoint above, made at load
        made = build_torchao(tiny_llama_dir, root / "torchao-int8wo", "Int8WeightOnlyConfig")
        return Quantized("torchao-int8-weight-only", tiny_llama_dir, made, ("--quantization", "int8-weight-only"))
    if name.startswith("compressed-tensors "):
        scheme = name.split()[1]
        made = build_compressed_tensors(tiny_llama_dir, root / f"ct-{scheme}", scheme)
        served = {"W8A8": "compressed-tensors-int-quantized", "W4A16": "compressed-tensors-pack-quantized"}[scheme]
        w8a8 = scheme == "W8A8"
        return Quantized(served, made, made, quantized_activations=w8a8, int8_layers=14 if w8a8 else 0)
    if name == "gptq 4-bit checkpoint":
        made = build_gptq(tiny_llama_dir, root / "gptq-4bit")
        return Quantized("gptq-4bit", made, made)
    if name == "--quantization int8-dynamic":
        return Quantized(
            "int8-dynamic", tiny_llama_dir, tiny_llama_dir, ("--quantization", "int8-dynamic"), True, True, 14
        )
    raise AssertionError(name)


FORMATS = [
    "torchao-int8-weight-only checkpoint",
    "--quantization int8-weight-only",
    "--quantization int8-dynamic",
    "compressed-tensors W8A8 checkpoint",
    "compressed-tensors W4A16 checkpoint",
    "gptq 4-bit checkpoint",
]


@pytest.fixture(scope="module", params=FORMATS)
def quantized(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, quantized_root: Path, server_logs: Path
) -> Iterator[tuple[Quantized, ServerProcess]]:
    case = _format(request.param, tiny_llama_dir, quantized_root)
    # A GPTQ model's first load on a machine compiles GPTQModel's CPU kernel (about two minutes).
    server = start_server(case.model_dir, server_logs, *BUDGET, *case.args, timeout_s=420)
    yield case, server
    server.stop()


def metric_line(server: ServerProcess, name: str) -> str:
    text = httpx.get(f"{server.root_url}/metrics", timeout=10).text
    match = re.search(rf"^transformers_openai:{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return match.group(0)


NEAR_TIE = 0.1  # logprob between the reference's best token and its second best (seen: 0.0016)


def first_divergence(model_dir: Path, expected: reference.Reference, text: str) -> int:
    """The first generated step whose token the served `text` does not continue with."""
    _, tokenizer = reference.load(str(model_dir))
    for step in range(len(expected.token_ids)):
        prefix = tokenizer.decode(expected.token_ids[: step + 1], skip_special_tokens=True)
        if not prefix.endswith("\ufffd") and not text.startswith(prefix):  # (a character cut in two: not yet)
            return step
    raise AssertionError(f"{text!r} continues all of {expected.text!r}")


async def _burst(server: ServerProcess) -> list[tuple[str, int]]:
    """The prompts at once: even ones streamed, odd ones not."""
    client = async_client(server)

    async def one(i: int, prompt: str) -> tuple[str, int]:
        if i % 2:
            response = await client.completions.create(
                model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert response.usage is not None
            return response.choices[0].text, response.usage.completion_tokens
        stream = await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens = "", 0
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return text, tokens

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
    finally:
        await client.close()


def test_greedy_under_batching_and_preemption_equals_the_quantized_model_alone(
    quantized: tuple[Quantized, ServerProcess],
) -> None:
    case, server = quantized
    results = asyncio.run(_burst(server))
    for prompt, got in zip(PROMPTS, results, strict=True):
        ids = reference.text_prompt_ids(case.reference_dir, prompt)
        expected = reference.greedy(case.reference_dir, ids, MAX_TOKENS, case.int8_dynamic)
        if case.quantized_activations and got[0] != expected.text:
            step = first_divergence(case.reference_dir, expected, got[0])
            assert expected.margins[step] < NEAR_TIE, (prompt, step, expected.margins[step])
            continue
        assert got == (expected.text, expected.completion_tokens), prompt
    assert float(metric_line(server, "num_preemptions_total").split()[-1]) > 0
    assert server.engine_state()["kv_blocks_used"] == 0


def test_the_quantization_is_named_in_models_and_metrics(quantized: tuple[Quantized, ServerProcess]) -> None:
    case, server = quantized
    card = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]
    assert card["quantization"] == case.served
    assert f'quantization="{case.served}"' in metric_line(server, "model_info")
    swapped = re.search(r"(\d+) linear layers swapped for int8 ones", server.log())
    assert (int(swapped.group(1)) if swapped else 0) == case.int8_layers  # the tiny Llama's 2 x 7 projections


def test_an_unquantized_model_says_none(tiny_server: ServerProcess) -> None:
    assert httpx.get(f"{tiny_server.base_url}/models", timeout=10).json()["data"][0]["quantization"] == "none"
    assert 'quantization="none"' in metric_line(tiny_server, "model_info")


@pytest.mark.parametrize(
    ("claimed", "args", "message"),
    [
        (None, ("--quantization", "fp8"), "--quantization fp8 runs on CUDA GPUs only"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, (), "needs the package(s) bitsandbytes"),
        ({"quant_method": "gptq", "bits": 4}, ("--quantization", "int8-dynamic"), "already quantized (gptq-4bit)"),
    ],
)
def test_a_format_this_host_cannot_run_stops_the_start_with_a_clear_error(
    tiny_llama_dir: Path,
    quantized_root: Path,
    server_logs: Path,
    claimed: dict[str, object] | None,
    args: tuple[str, ...],
    message: str,
) -> None:
    model = (
        tiny_llama_dir
        if claimed is None
        else with_quantization_config(tiny_llama_dir, quantized_root / "claimed", claimed)
    )
    with pytest.raises(RuntimeError, match="server exited with 1") as failed:
        start_server(model, server_logs, *args, timeout_s=120)
    assert message in str(failed.value)


TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Bees make honey from the nectar of flowers they visit in the spring.",
    "Two plus two is four, and four plus four is eight.",
    "The largest planet in our solar system is Jupiter, a gas giant.",
]


def prompt_scores(model_dir: Path, text: str, int8_dynamic: bool) -> tuple[list[int], list[float]]:
    model, tokenizer = reference.load(str(model_dir), int8_dynamic)
    ids = list(tokenizer(text).input_ids)
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return ids, [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def runner_prompt_scores(model_dir: Path, text: str, kernels: Path) -> list[float]:
    """`text`'s prompt scores from the int8 model alone, loaded and run as the int8 server runs it: int8 layers,
    the output layer packed, every query attending alone through the in-place kernel (built in `kernels`)."""
    model, tokenizer = reference.load(str(model_dir), int8_dynamic=True)
    pack_linear_layers(model)
    runner = CausalLMRunner(model, max_rows=1, max_model_len=1024)
    runner.prepare(Acceleration(kernels=True, store=kernels))
    ids = list(tokenizer(text).input_ids)
    pool = runner.spec.kv_pool
    table = BlockTable(blocks=list(range(2, 2 + -(-len(ids) // pool.block_size))))
    with torch.inference_mode():
        logprobs = runner.executor.forward([(table, ids)], keep=0)[0].float().log_softmax(-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.slow
def test_smollm2_in_int8_scores_text_as_its_int8_model_alone(
    smollm2_dir: Path, server_logs: Path, tmp_path: Path
) -> None:
    """A real model: the int8 server's prompt scores, four texts at once, are those of the int8 model alone run
    through the same kernels (to the rounding of int8 activations, which sends tiny float differences one
    quantization step either way), and differ from the float32 model's by more than that: the quantization is real.

    The int8 server attends through the in-place kernel, query by query (batch-invariant answers), whose float
    order differs from `sdpa`'s by about 1e-5: per-token int8 rounding turns that into gaps as large as the
    quantization's own on SmolLM2 (a mean of 0.26 nats against `sdpa`'s int8 model, 0.33 against float32), so the
    reference runs the model through `CausalLMRunner` as the server does (`runner_prompt_scores`).

    (Long greedy answers are not compared: on a real model a near-tie between two tokens, decided by such a step,
    sends the rest of an answer another way.)"""
    server = start_server(smollm2_dir, server_logs, "--quantization", "int8-dynamic", "--max-batch-size", "8")
    try:

        async def score_all() -> list[list[float]]:
            client = async_client(server)

            async def score(text: str) -> list[float]:
                reply = await client.completions.create(
                    model=server.model, prompt=text, echo=True, logprobs=0, max_tokens=1, temperature=0
                )
                scores = reply.choices[0].logprobs
                assert scores is not None and scores.token_logprobs is not None
                return [float(x) for x in scores.token_logprobs[1:-1]]

            try:
                return list(await asyncio.gather(*(score(t) for t in TEXTS)))
            finally:
                await client.close()

        served = asyncio.run(score_all())
    finally:
        server.stop()
    int8_gaps, float_gaps = [], []
    for text, got in zip(TEXTS, served, strict=True):
        int8 = runner_prompt_scores(smollm2_dir, text, tmp_path)
        _, full = prompt_scores(smollm2_dir, text, int8_dynamic=False)
        assert len(got) == len(int8)
        int8_gaps += [abs(a - b) for a, b in zip(got, int8, strict=True)]
        float_gaps += [abs(a - b) for a, b in zip(got, full, strict=True)]
    mean = sum(int8_gaps) / len(int8_gaps)
    assert max(int8_gaps) < 0.05 and mean < 0.005, (max(int8_gaps), mean)
    assert sum(float_gaps) / len(float_gaps) > 3 * mean, "the served model scores as the float32 one"
