"""The Batch API in process, on the fake engine: file and batch shapes, a batch run to its output file, bad lines as
error lines, whole-file failures, cancel, priorities, limits and errors."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine, Script
from tests.app.support import ERROR_KEYS, MODEL, make_app, running, wait_until_async
from transformers_openai.engine.errors import EngineOverloaded
from transformers_openai.engine.request import EngineRequest, RequestOutput
from transformers_openai.protocol.common import BATCH_PRIORITY

CHAT_URL = "/v1/chat/completions"


@pytest.fixture
async def batch_client(fake: FakeEngine, hf_tokenizer: Any, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, hf_tokenizer, data_dir=tmp_path / "data", batch_concurrency=2, max_batch_lines=50)
    async with running(app) as client:
        yield client


def chat_line(custom_id: str, text: str = "hi", **body: Any) -> str:
    fields = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": fields})


async def upload(client: httpx.AsyncClient, lines: list[str] | bytes, name: str = "in.jsonl") -> dict[str, Any]:
    data = lines if isinstance(lines, bytes) else "\n".join(lines).encode()
    response = await client.post("/v1/files", files={"file": (name, data)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return dict(response.json())


async def run_batch(client: httpx.AsyncClient, lines: list[str] | bytes, endpoint: str = CHAT_URL) -> dict[str, Any]:
    file = await upload(client, lines)
    response = await client.post(
        "/v1/batches", json={"input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h"}
    )
    assert response.status_code == 200, response.text
    return await wait_final(client, response.json()["id"])


async def wait_final(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def final() -> bool:
        seen.update((await client.get(f"/v1/batches/{batch_id}")).json())
        return seen["status"] in ("completed", "failed", "cancelled", "expired")

    await wait_until_async(final, timeout=20)
    return seen


async def lines_of(client: httpx.AsyncClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = await client.get(f"/files/{file_id}/content")  # also without /v1
    assert response.status_code == 200
    return [json.loads(line) for line in response.text.splitlines()]


async def test_file_shapes_list_get_content_delete(batch_client: httpx.AsyncClient) -> None:
    file = await upload(batch_client, [chat_line("a")])
    assert file["id"].startswith("file-") and file["object"] == "file" and file["purpose"] == "batch"
    assert file["filename"] == "in.jsonl" and file["bytes"] == len(chat_line("a")) and file["status"] == "processed"
    assert (await batch_client.get(f"/v1/files/{file['id']}")).json() == file
    listed = (await batch_client.get("/v1/files")).json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [file["id"]]
    assert (await batch_client.get(f"/v1/files/{file['id']}/content")).text == chat_line("a")
    deleted = (await batch_client.delete(f"/v1/files/{file['id']}")).json()
    assert deleted == {"id": file["id"], "object": "file", "deleted": True}
    gone = await batch_client.get(f"/v1/files/{file['id']}")
    assert gone.status_code == 404 and set(gone.json()["error"]) == ERROR_KEYS


async def test_a_batch_runs_every_line_at_the_batch_priority(batch_client: httpx.AsyncClient, fake: FakeEngine) -> None:
    batch = await run_batch(batch_client, [chat_line(f"req-{i}") for i in range(6)])
    assert batch["status"] == "completed" and batch["object"] == "batch" and batch["id"].startswith("batch_")
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert batch["error_file_id"] is None and batch["completion_window"] == "24h"
    assert all(batch[key] for key in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"))
    output = await lines_of(batch_client, batch["output_file_id"])
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(6)]
    first = output[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "Hello, world"
    assert {request.priority for request in fake.submitted} == {BATCH_PRIORITY}
    output_file = (await batch_client.get(f"/v1/files/{batch['output_file_id']}")).json()
    assert output_file["purpose"] == "batch_output"


async def test_bad_lines_become_error_lines_not_a_failed_batch(batch_client: httpx.AsyncClient) -> None:
    wrong_url = json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines = [
        chat_line("good"),
        "{not json",
        wrong_url,
        chat_line("good"),  # a duplicate custom_id
        chat_line("bad-body", temperature="hot"),
        chat_line("wrong-model").replace(MODEL, "other-model"),
        chat_line("streams", stream=True),
    ]
    batch = await run_batch(batch_client, lines)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 7, "completed": 1, "failed": 6}
    assert [line["custom_id"] for line in await lines_of(batch_client, batch["output_file_id"])] == ["good"]
    errors = {line["custom_id"]: line for line in await lines_of(batch_client, batch["error_file_id"])}
    assert errors[None]["error"]["code"] in ("invalid_json_line", "duplicate_custom_id")
    assert errors["url"]["error"]["code"] == "mismatched_url" and errors["url"]["response"] is None
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert errors["bad-body"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors["wrong-model"]["response"]["status_code"] == 404
    assert errors["streams"]["response"]["body"]["error"]["param"] == "stream"


WHOLE_FILE_PROBLEMS = [
    (b"\xff\xfe not utf-8", "invalid_file"),
    (b"\n\n", "empty_file"),
    (b"not json at all\n{]", "invalid_json_line"),
    ("\n".join([chat_line(f"r{i}") for i in range(51)]).encode(), "too_many_lines"),
]


async def test_whole_file_problems_fail_the_batch(batch_client: httpx.AsyncClient) -> None:
    for content, code in WHOLE_FILE_PROBLEMS:
        batch = await run_batch(batch_client, content)
        assert batch["status"] == "failed" and batch["failed_at"], code
        assert batch["errors"]["object"] == "list" and batch["errors"]["data"][0]["code"] == code


async def test_cancel_stops_the_lines_and_keeps_what_was_answered(
    batch_client: httpx.AsyncClient, fake: FakeEngine
) -> None:
    fake.script = Script(hang=True)
    file = await upload(batch_client, [chat_line(f"req-{i}") for i in range(5)])
    body = {"input_file_id": file["id"], "endpoint": CHAT_URL, "completion_window": "24h", "metadata": {"k": "v"}}
    created = (await batch_client.post("/v1/batches", json=body)).json()
    assert created["status"] == "validating" and created["metadata"] == {"k": "v"}
    await wait_until_async(lambda: _true(len(fake.in_flight) == 2), timeout=10)  # --batch-concurrency 2
    cancelling = (await batch_client.post(f"/v1/batches/{created['id']}/cancel")).json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    batch = await wait_final(batch_client, created["id"])
    assert batch["status"] == "cancelled" and batch["cancelled_at"]
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert not fake.in_flight and len(fake.aborted) == 2
    again = await batch_client.post(f"/v1/batches/{created['id']}/cancel")
    assert again.json()["status"] == "cancelled"


async def _true(value: bool) -> bool:
    return value


async def test_list_batches_newest_first_with_cursor(batch_client: httpx.AsyncClient) -> None:
    ids = [(await run_batch(batch_client, [chat_line("a")]))["id"] for _ in range(3)]
    page = (await batch_client.get("/v1/batches", params={"limit": 2})).json()
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = (await batch_client.get("/v1/batches", params={"after": page["last_id"]})).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]


CREATE_ERRORS = [
    ({"input_file_id": "file-none", "endpoint": CHAT_URL, "completion_window": "24h"}, 404, "input_file_id"),
    ({"input_file_id": "x", "endpoint": "/v1/audio/transcriptions", "completion_window": "24h"}, 400, "endpoint"),
    ({"input_file_id": "x", "endpoint": CHAT_URL, "completion_window": "1h"}, 400, "completion_window"),
    ({"input_file_id": "x", "endpoint": CHAT_URL}, 400, "completion_window"),
    ({"input_file_id": "x", "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400, "model"),
    ({"input_file_id": "x", "endpoint": CHAT_URL, "completion_window": "24h", "extra": 1}, 400, "extra"),
]


async def test_batch_create_errors(batch_client: httpx.AsyncClient) -> None:
    for body, status, param in CREATE_ERRORS:
        response = await batch_client.post("/v1/batches", json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, body


async def test_file_errors(
    batch_client: httpx.AsyncClient, fake: FakeEngine, hf_tokenizer: Any, tmp_path: Path
) -> None:
    other = await batch_client.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "fine-tune"})
    assert other.status_code == 400 and other.json()["error"]["param"] == "purpose"
    missing = await batch_client.post("/v1/files", data={"purpose": "batch"})
    assert missing.status_code == 400
    not_jsonl = await batch_client.post("/v1/files", files={"file": ("a.txt", b"{}")}, data={"purpose": "batch"})
    assert not_jsonl.status_code == 400
    for path in ("/v1/files/file-none/content", "/v1/batches/batch_none"):
        assert (await batch_client.get(path)).status_code == 404
    assert (await batch_client.post("/v1/batches/batch_none/cancel")).status_code == 404
    assert (await batch_client.get("/v1/batches", params={"limit": 0})).status_code == 400
    small = make_app(fake, hf_tokenizer, data_dir=tmp_path / "small", max_batch_file_bytes=1024, max_batch_files=1)
    async with running(small) as client:
        big = await client.post("/v1/files", files={"file": ("a.jsonl", b"x" * 2000)}, data={"purpose": "batch"})
        assert big.status_code == 413 and set(big.json()["error"]) == ERROR_KEYS
        await upload(client, [chat_line("a")])
        full = await client.post("/v1/files", files={"file": ("b.jsonl", b"{}")}, data={"purpose": "batch"})
        assert full.status_code == 400 and full.json()["error"]["code"] == "file_limit_reached"


async def test_files_and_batches_belong_to_their_api_key(fake: FakeEngine, hf_tokenizer: Any, tmp_path: Path) -> None:
    app = make_app(fake, hf_tokenizer, data_dir=tmp_path, api_keys=["k1", "k2"])
    async with running(app) as client:
        client.headers["Authorization"] = "Bearer k1"
        file = await upload(client, [chat_line("a")])
        client.headers["Authorization"] = "Bearer k2"
        assert (await client.get(f"/v1/files/{file['id']}")).status_code == 404
        assert (await client.get("/v1/files")).json()["data"] == []
        del client.headers["Authorization"]
        assert (await client.get("/v1/files")).status_code == 401


async def test_interactive_priority_reaches_the_engine(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "priority": -3}
    assert (await client.post(CHAT_URL, json=body)).status_code == 200
    assert fake.submitted[-1].priority == -3
    for bad in (2**31, "1", 1.5, None):
        response = await client.post(CHAT_URL, json={**body, "priority": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


class RefusingEngine(FakeEngine):
    """Answers its first `refusals` submissions as an engine at capacity does (a 429), then as the fake."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        if self.refusals:
            self.refusals -= 1
            raise EngineOverloaded("server is at capacity; retry later", retry_after_s=1)
        return super().submit(requests)


async def test_lines_the_engine_cannot_take_now_are_retried_not_failed(
    hf_tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = RefusingEngine(refusals=2)
    app = make_app(fake, hf_tokenizer, data_dir=tmp_path, batch_concurrency=2)
    async with running(app) as client:
        caplog.set_level(logging.INFO, logger="transformers_openai.serving.batch.runner")
        batch = await run_batch(client, [chat_line(f"req-{i}") for i in range(4)])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
        output = await lines_of(client, batch["output_file_id"])
        assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(4)]
    assert caplog.text.count("waits: server is at capacity") == 2
