"""The nasty-input matrix for /v1/embeddings, /tokenize and /detokenize: wrong types, lone surrogates, numbers
past every bound, and bodies past the token and character limits each get a 400 in our shape naming the field,
before any tokenizing or embedding."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.app.support import MODEL, assert_error
from tests.app.test_app_embeddings import (
    MAX_INPUT,
    TOKEN_CHARS,
    CountingTokenizer,
    FakeEmbedder,
    limited_embedding_app,
)

SURROGATE = "\ud800"
MOST_CHARS = MAX_INPUT * TOKEN_CHARS  # a prompt of more characters cannot fit the model's input
EMBED, TOKENIZE, DETOKENIZE = "/v1/embeddings", "/tokenize", "/detokenize"


def embed(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", **fields}


def tokenize(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", **fields}


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # lone surrogates
    ("input", EMBED, embed(input=f"a{SURROGATE}"), "input"),
    ("input list", EMBED, embed(input=["ok", SURROGATE]), "input"),
    ("embeddings model", EMBED, embed(model=SURROGATE), "model"),
    ("embeddings user", EMBED, embed(user=SURROGATE), "user"),
    ("tokenize prompt", TOKENIZE, tokenize(prompt=SURROGATE), "prompt"),
    ("tokenize message", TOKENIZE, {"messages": user(SURROGATE)}, "messages"),
    ("tokenize model", TOKENIZE, tokenize(model=SURROGATE), "model"),
    ("detokenize model", DETOKENIZE, {"model": SURROGATE, "tokens": [1]}, "model"),
    # no coercion, no shapes beside the documented ones
    ("input of booleans", EMBED, embed(input=[True, False]), "input"),
    ("input of floats", EMBED, embed(input=[1.0, 2.0]), "input"),
    ("strings and ids mixed", EMBED, embed(input=["a", 1]), "input"),
    ("ids nested too deep", EMBED, embed(input=[[[1]]]), "input"),
    ("input object", EMBED, embed(input={"text": "x"}), "input"),
    ("input null", EMBED, embed(input=None), "input"),
    ("dimensions string", EMBED, embed(dimensions="4"), "dimensions"),
    ("dimensions bool", EMBED, embed(dimensions=True), "dimensions"),
    ("dimensions float", EMBED, embed(dimensions=4.0), "dimensions"),
    ("encoding_format int", EMBED, embed(encoding_format=1), "encoding_format"),
    ("truncate string", EMBED, embed(truncate_prompt_tokens="5"), "truncate_prompt_tokens"),
    ("truncate -2", EMBED, embed(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ("tokenize prompt list", TOKENIZE, tokenize(prompt=["a"]), "prompt"),
    ("tokenize prompt of ids", TOKENIZE, tokenize(prompt=[1, 2]), "prompt"),
    ("add_special_tokens string", TOKENIZE, tokenize(add_special_tokens="yes"), "add_special_tokens"),
    ("return_token_strs int", TOKENIZE, tokenize(return_token_strs=1), "return_token_strs"),
    ("detokenize booleans", DETOKENIZE, {"tokens": [True]}, "tokens"),
    ("detokenize floats", DETOKENIZE, {"tokens": [1.5]}, "tokens"),
    ("detokenize strings", DETOKENIZE, {"tokens": ["1"]}, "tokens"),
    ("detokenize nested", DETOKENIZE, {"tokens": [[1]]}, "tokens"),
    ("detokenize null", DETOKENIZE, {"tokens": None}, "tokens"),
    # numbers past every bound
    ("id 2**64", EMBED, embed(input=[2**64]), "input"),
    ("id list with 2**70", EMBED, embed(input=[[1, 2**70]]), "input"),
    ("id below 0", EMBED, embed(input=[[-1]]), "input"),
    ("id beyond vocabulary", EMBED, embed(input=[[1, 10**9]]), "input"),
    ("dimensions 2**64", EMBED, embed(dimensions=2**64), "dimensions"),
    ("truncate 2**64", EMBED, embed(truncate_prompt_tokens=2**64), "truncate_prompt_tokens"),
    ("detokenize 2**64", DETOKENIZE, {"tokens": [2**64]}, "tokens"),
    ("detokenize below 0", DETOKENIZE, {"tokens": [-1]}, "tokens"),
    ("detokenize beyond vocabulary", DETOKENIZE, {"tokens": [10**9]}, "tokens"),
    # past the token and character limits
    ("ids over the request's budget", EMBED, embed(input=[[5] * MAX_INPUT] * 2), "input"),
    ("ids past OpenAI's input count", EMBED, embed(input=[[5]] * 2049), "input"),
    ("characters over the budget", EMBED, embed(input=["a" * 200] * 3, truncate_prompt_tokens=-1), "input"),
    ("one input over its characters", EMBED, embed(input=["ok", "a" * (MOST_CHARS + 1)]), "input"),
    ("ids over the model's input", EMBED, embed(input=[5] * (MAX_INPUT + 1)), "input"),
    ("tokenize prompt over the characters", TOKENIZE, tokenize(prompt="a" * (MOST_CHARS + 1)), "prompt"),
    ("tokenize messages over the characters", TOKENIZE, {"messages": user("a" * (MOST_CHARS + 1))}, "messages"),
    ("tokenize too many messages", TOKENIZE, {"messages": user("hi") * 9}, "messages"),
    ("detokenize over the context", DETOKENIZE, {"tokens": [5] * (MAX_INPUT + 1)}, "tokens"),
]


@pytest.fixture
def embedder() -> FakeEmbedder:
    return FakeEmbedder()


@pytest.fixture
def counting(hf_tokenizer: Any) -> CountingTokenizer:
    return CountingTokenizer(hf_tokenizer)


@pytest.fixture
async def client(
    hf_tokenizer: Any, embedder: FakeEmbedder, counting: CountingTokenizer
) -> AsyncIterator[httpx.AsyncClient]:
    async with limited_embedding_app(hf_tokenizer, embedder, counting) as ready:
        yield ready


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_nasty_input_gets_our_400_before_any_tokenizing(
    client: httpx.AsyncClient,
    embedder: FakeEmbedder,
    counting: CountingTokenizer,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    raw = json.dumps(body).encode()  # a lone surrogate travels as the escape "\ud800"
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400)
    assert (error["param"] or "").startswith(param), error
    assert embedder.inputs == [] and counting.calls == 0
