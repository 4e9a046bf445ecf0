"""/v1/embeddings end to end: all-MiniLM-L6-v2 against sentence-transformers, a decoder served for embeddings against
its own last-token states, the openai client and LangChain, concurrent requests, and the 400s."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import numpy as np
import pytest

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

from tests.e2e.conftest import sync_client
from tests.e2e.server import ServerProcess, start_server

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "mix",
    "bright",
    "potions",
    "at",
    "dawn",
]


def mixed_texts(count: int = 50, longest_words: int = 180) -> list[str]:
    """Deterministic texts from one word to `longest_words` (under MiniLM's 256 tokens), in no length order."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, longest_words, size=count)
    lengths[:3] = [1, 2, longest_words]
    return [" ".join(rng.choice(WORDS, size=n)).capitalize() + "." for n in lengths]


def embed_concurrently(server: ServerProcess, texts: list[str], requests: int = 16) -> np.ndarray:
    """`texts` split over `requests` concurrent requests; the vectors in the texts' order."""
    groups = [list(range(i, len(texts), requests)) for i in range(requests)]

    def send(indexes: list[int]) -> list[list[float]]:
        body = {"model": server.model, "input": [texts[i] for i in indexes]}
        response = httpx.post(f"{server.base_url}/embeddings", json=body, timeout=120)
        response.raise_for_status()
        data = response.json()["data"]
        assert [d["index"] for d in data] == list(range(len(indexes)))
        return [d["embedding"] for d in data]

    with ThreadPoolExecutor(requests) as pool:
        answers = list(pool.map(send, groups))
    vectors = np.zeros((len(texts), len(answers[0][0])), dtype=np.float32)
    for indexes, answer in zip(groups, answers, strict=True):
        vectors[indexes] = answer
    return vectors


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def minilm_server(minilm_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(minilm_dir, server_logs, "--max-batch-size", "32")
    yield server
    server.stop()


def base64_text(embedding: list[float]) -> str:
    """An embedding asked for as base64: the client's type says floats, the wire holds the text."""
    return cast(str, embedding)


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir: Path) -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.mark.slow
def test_minilm_equals_sentence_transformers_under_concurrency(
    minilm_server: ServerProcess, sentence_transformer: SentenceTransformer
) -> None:
    texts = mixed_texts()
    before = minilm_server.engine_state()
    got = embed_concurrently(minilm_server, texts, requests=16)
    after = minilm_server.engine_state()
    expected = sentence_transformer.encode(texts, batch_size=32)
    assert cosines(got, expected).min() > 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module was applied
    assert after["requests"] - before["requests"] == 16
    assert after["inputs"] - before["inputs"] == 50
    # Whether these 16 requests meet in one round depends on how fast the client sends them (on a slow CI machine
    # each can be answered before the next arrives); that concurrent requests share forwards is shown without
    # timing in tests/unit/test_embedding_engine.py.


@pytest.mark.slow
def test_openai_client_float_and_base64(
    minilm_server: ServerProcess, sentence_transformer: SentenceTransformer
) -> None:
    client = sync_client(minilm_server)
    texts = ["A first sentence.", "And a second, somewhat longer one, to pad the batch."]
    floats = client.embeddings.create(model="test-model", input=texts, encoding_format="float")
    raw = client.embeddings.create(model="test-model", input=texts, encoding_format="base64")
    decoded_by_client = client.embeddings.create(model="test-model", input=texts)  # it asks base64 and decodes
    as_floats = np.array([d.embedding for d in floats.data])
    as_base64 = np.array([np.frombuffer(base64.b64decode(base64_text(d.embedding)), dtype="<f4") for d in raw.data])
    assert np.array_equal(as_floats.astype(np.float32), as_base64)
    assert np.array_equal(np.array([d.embedding for d in decoded_by_client.data], dtype=np.float32), as_base64)
    expected = sentence_transformer.encode(texts)
    assert cosines(as_base64, expected).min() > 0.9999
    tokens = sentence_transformer.tokenizer(texts)["input_ids"]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(ids) for ids in tokens)
    single = client.embeddings.create(model="test-model", input=tokens[0], encoding_format="float")
    assert cosines(np.array([single.data[0].embedding]), expected[:1])[0] > 0.9999  # token ids as input


@pytest.mark.slow
def test_langchain_openai_embeddings(minilm_server: ServerProcess, sentence_transformer: SentenceTransformer) -> None:
    from langchain_openai import OpenAIEmbeddings
    from pydantic import SecretStr

    # check_embedding_ctx_length=False: its default tokenizes with tiktoken, which downloads its vocabulary.
    embeddings = OpenAIEmbeddings(  # base_url and api_key by their field names, as its typed __init__ has them
        model="test-model",
        openai_api_base=minilm_server.base_url,
        openai_api_key=SecretStr("unused"),
        check_embedding_ctx_length=False,
    )
    texts = mixed_texts(count=6, longest_words=40)
    documents = np.array(embeddings.embed_documents(texts))
    query = np.array([embeddings.embed_query(texts[0])])
    expected = sentence_transformer.encode(texts)
    assert cosines(documents, expected).min() > 0.9999
    assert cosines(query, expected[:1])[0] > 0.9999


@pytest.mark.slow
def test_rerank_and_score_are_the_cosine_similarities_of_the_embeddings(
    minilm_server: ServerProcess, sentence_transformer: SentenceTransformer
) -> None:
    query = "Where do the wizards mix their potions?"
    documents = mixed_texts(count=8, longest_words=40)
    body = {"model": "test-model", "query": query, "documents": documents}
    rerank = httpx.post(f"{minilm_server.base_url}/rerank", json=body, timeout=60).json()
    indexes = [r["index"] for r in rerank["results"]]
    got = np.array([r["relevance_score"] for r in rerank["results"]])
    assert sorted(indexes) == list(range(len(documents))) and np.all(np.diff(got) <= 0)
    expected = sentence_transformer.encode([query, *documents])
    assert np.abs(got - cosines(np.repeat(expected[:1], len(documents), 0), expected[1:])[indexes]).max() < 1e-4
    own = sync_client(minilm_server).embeddings.create(model="test-model", input=[query, *documents])
    vectors = np.array([d.embedding for d in own.data])  # the server's own vectors: the same numbers to rounding
    assert np.abs(got - cosines(np.repeat(vectors[:1], len(documents), 0), vectors[1:])[indexes]).max() < 1e-6
    tokens = sentence_transformer.tokenizer([query, *documents])["input_ids"]
    assert rerank["usage"]["total_tokens"] == sum(len(ids) for ids in tokens)  # the query embedded once
    pairs = {"model": "test-model", "text_1": documents[::-1], "text_2": documents}
    scores = [d["score"] for d in httpx.post(f"{minilm_server.root_url}/score", json=pairs, timeout=60).json()["data"]]
    assert np.abs(np.array(scores) - cosines(vectors[1:][::-1], vectors[1:])).max() < 1e-6


@pytest.mark.slow
def test_length_limit_truncation_and_refusals(
    minilm_server: ServerProcess, sentence_transformer: SentenceTransformer
) -> None:
    url = f"{minilm_server.root_url}/embeddings"  # also served without /v1
    long_text = "word " * 400
    too_long = httpx.post(url, json={"model": "test-model", "input": ["short", long_text]}, timeout=60)
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "input" and "input 1" in too_long.json()["error"]["message"]
    cut = httpx.post(url, json={"model": "test-model", "input": long_text, "truncate_prompt_tokens": -1}, timeout=60)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    expected = sentence_transformer.encode([long_text])  # it truncates to 256 too
    assert cosines(np.array([cut.json()["data"][0]["embedding"]]), expected)[0] > 0.9999
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ""}, "input"),
        ({"input": [30522]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100}, "dimensions"),  # MiniLM was not trained for shorter vectors
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ]
    for body, param in cases:
        response = httpx.post(url, json={"model": "test-model", **body}, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    chat = httpx.post(
        f"{minilm_server.base_url}/chat/completions",
        json={"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"


def test_embeddings_on_a_generative_model_is_a_400(tiny_server: ServerProcess) -> None:
    response = httpx.post(f"{tiny_server.base_url}/embeddings", json={"model": "test-model", "input": "Hi"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_supported", "model")
    assert "--model-kind embedding" in error["message"]


@pytest.fixture(scope="session")
def llama_embedding_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "--model-kind", "embedding")
    yield server
    server.stop()


def test_decoder_served_for_embeddings_equals_its_last_token_state(
    llama_embedding_server: ServerProcess, tiny_llama_dir: Path
) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = mixed_texts(count=12, longest_words=60)
    got = embed_concurrently(llama_embedding_server, texts, requests=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = [model(input_ids=torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, -1] for t in texts]
    expected = torch.nn.functional.normalize(torch.stack(states), dim=-1).numpy()
    assert np.allclose(got, expected, atol=1e-4), np.abs(got - expected).max()
    chat = httpx.post(
        f"{llama_embedding_server.base_url}/completions", json={"model": "test-model", "prompt": "Hi"}, timeout=60
    )
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_supported"


@pytest.fixture(scope="session")
def matryoshka_server(
    tiny_bert_dir: Path, server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny BERT whose config says it may be cut to 8 or 16 of its 32 dimensions."""
    model_dir = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(tiny_bert_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    server = start_server(model_dir, server_logs)
    yield server
    server.stop()


def test_dimensions_cut_and_renormalize_where_the_model_allows(matryoshka_server: ServerProcess) -> None:
    client = sync_client(matryoshka_server)
    full = np.array(
        client.embeddings.create(model="test-model", input="Some text", encoding_format="float").data[0].embedding
    )
    cut = client.embeddings.create(model="test-model", input="Some text", dimensions=16, encoding_format="float")
    expected = full[:16] / np.linalg.norm(full[:16])
    assert np.allclose(cut.data[0].embedding, expected, atol=1e-6)
    refused = httpx.post(
        f"{matryoshka_server.base_url}/embeddings", json={"model": "test-model", "input": "x", "dimensions": 12}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    assert "8, 16" in refused.json()["error"]["message"]


def test_a_pipeline_module_we_cannot_apply_stops_the_start(
    tiny_bert_dir: Path, server_logs: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "with-dense"
    shutil.copytree(tiny_bert_dir, model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (model_dir / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(RuntimeError, match="sentence_transformers.models.Dense"):
        start_server(model_dir, server_logs, timeout_s=60)


def test_an_encoder_decoder_cannot_be_served_for_embeddings(tiny_t5_dir: Path, server_logs: Path) -> None:
    with pytest.raises(RuntimeError, match="not t5"):
        start_server(tiny_t5_dir, server_logs, "--model-kind", "embedding", timeout_s=60)


def wait_for(check: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_an_abandoned_big_request_frees_the_engine_within_a_piece(minilm_server: ServerProcess) -> None:
    # 320 inputs of MiniLM's 256 tokens: 20 pieces of 16 (--max-prefill-tokens 4096), about 82,000 tokens.
    texts = [f"{WORDS[i % len(WORDS)]} " + "word " * 300 for i in range(320)]
    body = json.dumps({"model": "test-model", "input": texts, "truncate_prompt_tokens": -1}).encode()
    before = minilm_server.engine_state()
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{minilm_server.port}\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", minilm_server.port), timeout=30) as sock:
        sent = time.monotonic()
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: minilm_server.engine_state()["forwards"] > before["forwards"])  # its first piece ran
        first_piece_s = time.monotonic() - sent
    # The client is gone: the next request waits for the piece running at most.
    started = time.monotonic()
    url = f"{minilm_server.base_url}/embeddings"
    response = httpx.post(url, json={"model": "test-model", "input": "Hi"}, timeout=60)
    waited = time.monotonic() - started
    assert response.status_code == 200, response.text
    wait_for(lambda: minilm_server.engine_state()["in_flight"] == 0)
    after = minilm_server.engine_state()
    embedded = after["inputs"] - before["inputs"] - 1
    assert embedded <= 3 * 16, after  # the pieces that ran before the disconnect was seen: a few of 20
    assert after["dropped"] - before["dropped"] == 320 - embedded
    print(f"abandoned after {embedded} of 320 inputs; first piece {first_piece_s:.2f} s, next request {waited:.2f} s")


@pytest.mark.slow
def test_bodies_past_the_limits_are_refused_before_tokenizing(minilm_server: ServerProcess) -> None:
    texts = ["word " * 600] * 2048  # 6.1 MB: more characters than 300,000 tokens of MiniLM's vocabulary could hold
    started = time.monotonic()
    over = httpx.post(
        f"{minilm_server.base_url}/embeddings",
        json={"model": "test-model", "input": texts, "truncate_prompt_tokens": -1},
        timeout=60,
    )
    embed_s = time.monotonic() - started
    assert over.status_code == 400, over.text
    assert (over.json()["error"]["param"], over.json()["error"]["code"]) == ("input", "max_tokens_per_request")
    started = time.monotonic()
    prompt = httpx.post(
        f"{minilm_server.root_url}/tokenize", json={"prompt": "word " * 1_900_000}, timeout=60
    )  # 9.5 MB
    tokenize_s = time.monotonic() - started
    assert prompt.status_code == 400, prompt.text
    assert (prompt.json()["error"]["param"], prompt.json()["error"]["code"]) == ("prompt", "context_length_exceeded")
    tokens = httpx.post(f"{minilm_server.root_url}/detokenize", json={"tokens": [1000] * 100_000}, timeout=60)
    assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "tokens"
    print(f"6.1 MB embeddings body refused in {embed_s:.2f} s, 9.5 MB /tokenize body in {tokenize_s:.2f} s")
