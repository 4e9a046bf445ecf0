"""/v1/embeddings in process, on a fake embedding engine: shapes, base64, dimensions, usage and every refusal."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.app.fake_engine import FakeEngine
from tests.app.support import MODEL, RawExchange, assert_error, make_app, running
from transformers_openai.engine.embedding_engine import EmbeddingEngine
from transformers_openai.engine.errors import EngineOverloaded
from transformers_openai.serving import embeddings
from transformers_openai.serving.context import Capability, EmbeddingModel, ServingContext
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.tokenizer import TokenizerService

WIDTH = 8
MAX_INPUT = 32


class FakeEmbedder:
    """A unit vector per input made from its token ids; records the inputs it was given."""

    def __init__(self) -> None:
        self.inputs: list[list[int]] = []
        self.overloaded = False

    async def embed(self, inputs: list[list[int]], priority: int = 0) -> list[Any]:
        if self.overloaded:
            raise EngineOverloaded("server is at capacity; retry later", retry_after_s=2)
        self.inputs.extend(inputs)
        vectors = [np.cos(np.arange(1, WIDTH + 1) * (sum(ids) + len(ids))).astype(np.float32) for ids in inputs]
        return [v / np.linalg.norm(v) for v in vectors]


def embedding_context(
    hf_tokenizer: Any,
    embedder: FakeEmbedder,
    dims: tuple[int, ...] | None = None,
    matryoshka: bool = False,
    service: TokenizerService | None = None,
) -> ServingContext:
    return ServingContext(
        engine=FakeEngine(),
        tokenizer=service or TokenizerService(hf_tokenizer),
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=MAX_INPUT,
        model_kind="embedding",
        capabilities=frozenset({Capability.EMBEDDINGS}),
        embeddings=EmbeddingModel(
            engine=embedder,
            max_input_len=MAX_INPUT,
            width=WIDTH,
            normalized=True,
            matryoshka=matryoshka,
            matryoshka_dims=dims,
        ),
    )


@pytest.fixture
def embedder() -> FakeEmbedder:
    return FakeEmbedder()


@pytest.fixture
async def embed_client(hf_tokenizer: Any, embedder: FakeEmbedder) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(FakeEngine(), hf_tokenizer, loader=lambda: embedding_context(hf_tokenizer, embedder, (4, 6), True))
    async with running(app) as ready:
        yield ready


async def test_floats_base64_and_usage(
    embed_client: httpx.AsyncClient, embedder: FakeEmbedder, hf_tokenizer: Any
) -> None:
    texts = ["Hello there", "A second, longer input text"]
    floats = await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": texts})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    tokens = sum(len(hf_tokenizer.encode(t)) for t in texts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert embedder.inputs == [hf_tokenizer.encode(t) for t in texts]
    packed = await embed_client.post("/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed.json()["data"]]
    assert np.array_equal(np.array(decoded), np.array([d["embedding"] for d in body["data"]], dtype=np.float32))


async def test_token_id_inputs_and_truncation(embed_client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    response = await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": [[5, 6, 7], [8]]})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 4
    long = list(range(1, 41))
    assert_error(await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": long}), 400, "input")
    cut = await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": long, "truncate_prompt_tokens": 10})
    assert cut.status_code == 200 and embedder.inputs[-1] == long[:10]
    whole = await embed_client.post(
        "/v1/embeddings", json={"model": MODEL, "input": long, "truncate_prompt_tokens": -1}
    )
    assert whole.status_code == 200 and embedder.inputs[-1] == long[:MAX_INPUT]


async def test_dimensions_cut_and_renormalize(embed_client: httpx.AsyncClient) -> None:
    full = (await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": "Hi"})).json()["data"][0]
    cut = (await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": "Hi", "dimensions": 4})).json()
    vector = np.array(full["embedding"][:4])
    assert np.allclose(cut["data"][0]["embedding"], vector / np.linalg.norm(vector), atol=1e-6)
    error = assert_error(
        await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": "Hi", "dimensions": 5}),
        400,
        "dimensions",
    )
    assert "4, 6" in error["message"]


async def test_dimensions_refused_without_matryoshka(hf_tokenizer: Any) -> None:
    app = make_app(FakeEngine(), hf_tokenizer, loader=lambda: embedding_context(hf_tokenizer, FakeEmbedder()))
    async with running(app) as client:
        body = {"model": MODEL, "input": "Hi", "dimensions": 4}
        assert_error(await client.post("/v1/embeddings", json=body), 400, "dimensions")
        same = await client.post("/v1/embeddings", json={**body, "dimensions": WIDTH})  # its own size is fine
        assert same.status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": 3}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
        ({"input": "x", "stream": True}, "stream"),
    ],
)
async def test_bad_inputs_are_400s_naming_the_param(
    embed_client: httpx.AsyncClient, fields: dict[str, Any], param: str
) -> None:
    assert_error(await embed_client.post("/v1/embeddings", json={"model": MODEL, **fields}), 400, param)


async def test_unknown_model_user_and_overload(embed_client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    assert_error(await embed_client.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404, "model")
    user = await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": "x", "user": "someone"})
    assert user.status_code == 200
    embedder.overloaded = True
    busy = await embed_client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert_error(busy, 429)
    assert busy.headers["retry-after"] == "2"


async def test_generation_on_an_embedding_model_is_a_400(embed_client: httpx.AsyncClient) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"model": MODEL, "prompt": "Hi"})]:
        error = assert_error(await embed_client.post(path, json=body), 400, "model", "model_not_supported")
        assert "/v1/embeddings" in error["message"]
    audio = await embed_client.post(
        "/v1/audio/transcriptions", data={"model": MODEL}, files={"file": ("a.wav", b"RIFF", "audio/wav")}
    )
    assert_error(audio, 400, "model", "model_not_supported")


async def test_embeddings_on_a_text_model_is_a_400(client: httpx.AsyncClient) -> None:
    error = assert_error(
        await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 400, "model", "model_not_supported"
    )
    assert "--model-kind embedding" in error["message"]


class CountingTokenizer(TokenizerService):
    """Counts the texts handed to the tokenizer, and the calls."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.calls = 0
        self.texts = 0

    async def encode_texts(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        self.calls += 1
        self.texts += len(texts)
        return await super().encode_texts(texts, max_length)


BUDGET = 60  # tokens a request may hold over all its inputs
TOKEN_CHARS = 8  # the most characters one token stands for, as these limits state it


@pytest.fixture
def counting(hf_tokenizer: Any) -> CountingTokenizer:
    return CountingTokenizer(hf_tokenizer)


@asynccontextmanager
async def limited_embedding_app(
    hf_tokenizer: Any, embedder: FakeEmbedder, counting: CountingTokenizer
) -> AsyncIterator[httpx.AsyncClient]:
    """An embedding model (whose tokenizer also serves /tokenize) with small limits: `BUDGET` tokens a request,
    `TOKEN_CHARS` characters a token, `MAX_INPUT` tokens an input."""
    base = embedding_context(hf_tokenizer, embedder, service=counting)
    assert base.embeddings is not None
    limits = PromptLimits(
        max_messages=8, max_content_parts=8, max_prompt_tokens=MAX_INPUT, max_token_chars=TOKEN_CHARS, max_sequences=8
    )
    context = replace(base, prompt_limits=limits, embeddings=replace(base.embeddings, max_total_tokens=BUDGET))
    async with running(make_app(FakeEngine(), hf_tokenizer, loader=lambda: context)) as ready:
        yield ready


@pytest.fixture
async def budget_client(
    hf_tokenizer: Any, embedder: FakeEmbedder, counting: CountingTokenizer
) -> AsyncIterator[httpx.AsyncClient]:
    async with limited_embedding_app(hf_tokenizer, embedder, counting) as ready:
        yield ready


async def test_token_ids_over_the_budget_are_counted_not_embedded(
    budget_client: httpx.AsyncClient, embedder: FakeEmbedder
) -> None:
    at_budget = [[5] * 20] * 3
    assert (await budget_client.post("/v1/embeddings", json={"model": MODEL, "input": at_budget})).status_code == 200
    over = {"model": MODEL, "input": [*at_budget, [5]]}
    error = assert_error(await budget_client.post("/v1/embeddings", json=over), 400, "input", "max_tokens_per_request")
    assert "61 tokens" in error["message"] and f"at most {BUDGET}" in error["message"]
    assert "--max-embedding-tokens" in error["message"]
    cut = {**over, "input": [[5] * 30] * 4, "truncate_prompt_tokens": 15}  # 4 x 15 after the cut: within
    assert (await budget_client.post("/v1/embeddings", json=cut)).status_code == 200
    assert len(embedder.inputs) == 7


async def test_texts_certainly_over_the_budget_are_refused_before_tokenizing(
    budget_client: httpx.AsyncClient, counting: CountingTokenizer, embedder: FakeEmbedder
) -> None:
    most = BUDGET * TOKEN_CHARS
    texts = ["a" * (most // 4)] * 4 + ["b"]  # one character more than the budget's tokens could stand for
    error = assert_error(
        await budget_client.post("/v1/embeddings", json={"model": MODEL, "input": texts, "truncate_prompt_tokens": -1}),
        400,
        "input",
        "max_tokens_per_request",
    )
    assert f"{most + 1} characters" in error["message"]
    one = "c" * (MAX_INPUT * TOKEN_CHARS + 1)  # more than one input may have without truncate_prompt_tokens
    error = assert_error(await budget_client.post("/v1/embeddings", json={"model": MODEL, "input": one}), 400, "input")
    assert error["code"] == "context_length_exceeded" and "truncate_prompt_tokens" in error["message"]
    assert counting.calls == 0 and embedder.inputs == []


async def test_texts_are_counted_in_chunks_and_refused_at_the_chunk_that_passes_the_budget(
    budget_client: httpx.AsyncClient,
    counting: CountingTokenizer,
    embedder: FakeEmbedder,
    hf_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(embeddings, "TOKENIZE_CHUNK_CHARS", 20)
    text = "seven wizards mix potions"  # a chunk of its own: longer than 20 characters
    per_text = len(hf_tokenizer.encode(text))
    texts = [text] * 15  # 375 characters: under what the budget could stand for, over it in tokens
    error = assert_error(
        await budget_client.post("/v1/embeddings", json={"model": MODEL, "input": texts}),
        400,
        "input",
        "max_tokens_per_request",
    )
    passing = BUDGET // per_text + 1  # the text that takes the count over the budget
    assert counting.calls == counting.texts == passing < len(texts)
    assert f"before input {passing} have {passing * per_text} tokens" in error["message"]
    within = texts[: BUDGET // per_text]
    response = await budget_client.post("/v1/embeddings", json={"model": MODEL, "input": within})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(within) * per_text
    assert embedder.inputs == [hf_tokenizer.encode(text)] * len(within)  # the chunks' tokens in the inputs' order


class GatedEmbedder:
    """A runner for the real engine whose forwards each wait for a permit."""

    def __init__(self) -> None:
        self.forwards = 0
        self.permits = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        self.entered.release()
        assert self.permits.acquire(timeout=10)
        self.forwards += 1
        return torch.ones(len(inputs), WIDTH)


async def test_a_client_that_leaves_frees_the_engine_within_one_piece(hf_tokenizer: Any) -> None:
    runner = GatedEmbedder()
    engine = EmbeddingEngine(runner, max_rows=64, max_tokens=2 * MAX_INPUT, max_requests=8, threads=1)
    base = embedding_context(hf_tokenizer, FakeEmbedder())
    assert base.embeddings is not None
    context = replace(base, engine=engine, embeddings=replace(base.embeddings, engine=engine))
    app = make_app(FakeEngine(), hf_tokenizer, loader=lambda: context)
    async with running(app) as client:
        exchange = RawExchange(app, "/v1/embeddings", {"model": MODEL, "input": [[5] * MAX_INPUT] * 40})  # 20 pieces
        task = asyncio.create_task(exchange.run())
        assert await asyncio.to_thread(runner.entered.acquire, True, 10)  # its first piece is running
        exchange.disconnect.set()
        await asyncio.wait_for(task, 5)
        for _ in range(2):  # the abandoned forward, then the next request's
            runner.permits.release()
        response = await client.post("/v1/embeddings", json={"model": MODEL, "input": [[6, 7]]})
        assert response.status_code == 200, response.text
        stats = engine.stats()
    assert exchange.status == 499
    assert runner.forwards == 2 and stats.dropped == 38 and stats.in_flight == 0
