"""The nasty-input matrix of the Batch API routes and the `priority` field: every bad input gets a 4xx in our
shape, never a 5xx, and nothing reaches the engine; ids never reach the file system unchecked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, ERROR_KEYS, MODEL, make_app, running

SURROGATE = "\ud800"
LINE = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": MODEL, "messages": []}})


@pytest.fixture
async def batch_client(fake: FakeEngine, hf_tokenizer: Any, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    (tmp_path / "data").mkdir()
    (tmp_path / "secret.jsonl").write_text("secret")
    async with running(make_app(fake, hf_tokenizer, data_dir=tmp_path / "data")) as client:
        yield client


def batch(**fields: Any) -> dict[str, Any]:
    return {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h", **fields}


GENERATION_BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi"}),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
    ("/v1/responses", {"model": MODEL, "input": "hi"}),
]
BAD_PRIORITIES: list[Any] = [2**31, -(2**31) - 1, 10**30, "0", 0.5, True, None, [], {}]
PRIORITY_CASES = [(path, {**body, "priority": value}) for path, body in GENERATION_BODIES for value in BAD_PRIORITIES]
BATCH_BODIES = [
    batch(input_file_id=SURROGATE),
    batch(input_file_id=5),
    batch(input_file_id="../../secret"),
    batch(endpoint="/v1/chat/completions/"),
    batch(endpoint=SURROGATE),
    batch(completion_window=24),
    batch(metadata={SURROGATE: "x"}),
    batch(metadata={"k": 5}),
    batch(metadata={f"k{i}": "v" for i in range(17)}),
    batch(metadata={"k" * 65: "v"}),
    batch(metadata={"k": "v" * 513}),
    batch(metadata=[]),
    {},
    [],
    "x",
]
GETS = [
    "/v1/files/..%2F..%2Fsecret.jsonl/content",
    "/v1/files/..%2Fsecret.jsonl",
    "/v1/files/%ED%A0%80",
    "/v1/files/" + "x" * 5000,
    "/v1/files?limit=0",
    "/v1/files?limit=-1",
    "/v1/files?limit=abc",
    "/v1/files?limit=99999999999999999999999",
    "/v1/batches?limit=101",
    "/v1/batches?limit=1e3",
    "/v1/batches/%00",
    "/v1/batches/..%2F..%2Fsecret.jsonl",
]


def assert_our_4xx(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert set(response.json()["error"]) == ERROR_KEYS


async def test_priority_out_of_range_or_not_an_integer_is_a_400(
    batch_client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    for path, body in PRIORITY_CASES:
        response = await batch_client.post(path, json=body)
        assert response.status_code == 400, (path, body["priority"], response.text)
        assert response.json()["error"]["param"] == "priority"
    assert fake.submitted == []


async def test_nasty_batch_bodies_get_our_4xx(batch_client: httpx.AsyncClient, fake: FakeEngine) -> None:
    for body in BATCH_BODIES:
        raw = json.dumps(body).encode()
        response = await batch_client.post("/v1/batches", content=raw, headers={"content-type": "application/json"})
        assert_our_4xx(response)
    for raw in (b"{", b"\xff", b"", b'{"input_file_id": "' + b"9" * 5000 + b'"'):
        response = await batch_client.post("/v1/batches", content=raw, headers={"content-type": "application/json"})
        assert_our_4xx(response)
    assert fake.submitted == []


async def test_nasty_uploads_get_our_4xx(batch_client: httpx.AsyncClient) -> None:
    uploads: list[dict[str, Any]] = [
        {"data": {"purpose": "batch"}},
        {"data": {"purpose": "batch", "file": "not a file"}},
        {"files": {"file": ("a.jsonl", LINE.encode())}},
        {"files": {"file": ("a.jsonl", LINE.encode())}, "data": {"purpose": "batch\x00"}},
        {"files": {"file": ("a.jsonl", b"")}, "data": {"purpose": "batch"}},
        {"files": {"file": ("a.jsonl", LINE.encode())}, "data": {"purpose": "batch_output"}},
        {"files": {"file": ("a.jsonl", LINE.encode())}, "data": {"purpose": "assistants"}},
        {"content": b"raw bytes", "headers": {"content-type": "application/octet-stream"}},
        {"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}},
        {"json": {"file": LINE, "purpose": "batch"}},
    ]
    for upload in uploads:
        assert_our_4xx(await batch_client.post("/v1/files", **upload))


async def test_a_strange_filename_is_stored_as_a_name_only(batch_client: httpx.AsyncClient, tmp_path: Path) -> None:
    for name in ("../../escape.jsonl", "/etc/passwd.jsonl", "a\x00b.jsonl", "é" * 300 + ".jsonl"):
        response = await batch_client.post(
            "/v1/files", files={"file": (name, LINE.encode())}, data={"purpose": "batch"}
        )
        assert response.status_code in (200, 400), response.text
        if response.status_code == 200:
            file_id = response.json()["id"]
            assert (tmp_path / "data" / "files" / file_id).exists()
    assert not (tmp_path / "escape.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "secret.jsonl"]


async def test_nasty_ids_and_queries_get_our_4xx(batch_client: httpx.AsyncClient) -> None:
    for path in GETS:
        response = await batch_client.get(path)
        assert_our_4xx(response)
        assert b"secret" not in response.content
    unknown_cursor = await batch_client.get("/v1/files?after=%ED%A0%80")  # an unknown cursor: from the start
    assert unknown_cursor.status_code == 200 and unknown_cursor.json()["data"] == []
    for method, path in (("DELETE", "/v1/files/..%2F..%2Fsecret.jsonl"), ("POST", "/v1/batches/%ED%A0%80/cancel")):
        assert_our_4xx(await batch_client.request(method, path))
