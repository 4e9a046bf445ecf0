"""Chats with images on the FakeEngine through a tiny VLM's real processor: what the engine receives, each bad image's
400 while a good stream goes on, the model card and /tokenize."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, MODEL, assert_error, make_app, make_context, running, sse_chunks, wait_until
from tests.vision_models import FAMILIES, tiny_vlm
from transformers_openai.engine.request import EngineRequest, RequestOutput
from transformers_openai.protocol import ChatMessage
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.vision.limits import ImageLimits
from transformers_openai.serving.vision.prompts import ProcessorPrompts


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), fmt: str = "PNG", **options: Any) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


RED, BLUE = png((220, 20, 20)), png((20, 20, 220), (64, 48))


def image_chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": list(messages), "max_tokens": 8, **fields}


def two_images() -> dict[str, Any]:
    return image_chat(user(text("Compare"), image_part(data_url(RED)), text("with"), image_part(data_url(BLUE))))


def reference(processor: Any, images: list[Image.Image]) -> Any:
    """transformers' own rendering of `two_images()`'s chat, images passed as pictures."""
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image", "image": images[0]},
                {"type": "text", "text": "with"},
                {"type": "image", "image": images[1]},
            ],
        }
    ]
    return processor.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


class _Images(BaseHTTPRequestHandler):
    """/red.png: RED; /slow.png: RED after 2 s."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(2)
        body = RED if self.path in ("/red.png", "/slow.png") else b"missing"
        try:
            self.send_response(200 if body is RED else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the slow image's fetch gave up first, as it should

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def processors() -> dict[str, Any]:
    return {family: AutoProcessor.from_pretrained(tiny_vlm(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def processor(processors: dict[str, Any]) -> Any:
    return processors["llava"]


# The bounds the bad-input tests run into; localhost's URLs allowed (and refused, for pointing at loopback).
STRICT = ImageLimits(
    max_images=2, max_pixels=1_000_000, max_bytes=64 * 1024, allowed_domains=frozenset({"localhost"}), fetch_timeout=1
)


@pytest.fixture(scope="module")
def strict_prompts(processor: Any) -> Iterator[ProcessorPrompts]:
    prompts = ProcessorPrompts(processor, STRICT)
    yield prompts
    prompts.close()


@pytest.fixture(scope="module")
def trusting_prompts(processor: Any) -> Iterator[ProcessorPrompts]:
    """Fetches from the test's own server on 127.0.0.1, with a short timeout."""
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), allow_private=True, fetch_timeout=0.5)
    prompts = ProcessorPrompts(processor, limits)
    yield prompts
    prompts.close()


@pytest.fixture
async def vision_client(
    fake: FakeEngine, processor: Any, strict_prompts: ProcessorPrompts
) -> AsyncIterator[httpx.AsyncClient]:
    loader = lambda: make_context(fake, processor.tokenizer, vision=strict_prompts)  # noqa: E731
    async with running(make_app(fake, processor.tokenizer, loader=loader)) as ready:
        yield ready


@pytest.mark.parametrize("family", FAMILIES)
async def test_engine_gets_the_processors_tokens_and_pixels(
    fake: FakeEngine, processors: dict[str, Any], family: str
) -> None:
    processor = processors[family]
    prompts = ProcessorPrompts(processor, ImageLimits())
    loader = lambda: make_context(fake, processor.tokenizer, vision=prompts)  # noqa: E731
    try:
        async with running(make_app(fake, processor.tokenizer, loader=loader)) as client:
            response = await client.post(CHAT, json=two_images())
    finally:
        prompts.close()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello, world"
    [request] = fake.submitted
    expected = reference(processor, [Image.open(io.BytesIO(RED)), Image.open(io.BytesIO(BLUE))])
    assert request.prompt_token_ids == expected["input_ids"][0].tolist()
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert request.prompt_token_ids.count(image_token) > 2  # each image stands as its many tokens
    inputs = request.encoder_inputs
    assert set(inputs) == (set(expected) - {"input_ids", "attention_mask"}) | {"image_digest", "images"}
    for key in set(expected) - {"input_ids", "attention_mask"}:
        assert isinstance(inputs[key], torch.Tensor) and inputs[key].device.type == "cpu"
        assert torch.equal(inputs[key], expected[key]), key
    assert inputs["images"] == 2 and len(inputs["image_digest"]) == 64
    assert response.json()["usage"]["prompt_tokens"] == len(request.prompt_token_ids)


async def test_digest_follows_the_pictures(vision_client: httpx.AsyncClient, fake: FakeEngine) -> None:
    same_as_webp = png((220, 20, 20), fmt="WEBP", lossless=True)
    for url in (data_url(RED), data_url(same_as_webp, "image/webp"), data_url(BLUE)):
        body = image_chat(user(image_part(url, detail="low"), text("What colour?")))
        assert (await vision_client.post(CHAT, json=body)).status_code == 200
    digests = [request.encoder_inputs["image_digest"] for request in fake.submitted]
    assert digests[0] == digests[1] != digests[2]


async def test_an_allowed_url_is_fetched(
    fake: FakeEngine, processor: Any, trusting_prompts: ProcessorPrompts, image_server: str
) -> None:
    loader = lambda: make_context(fake, processor.tokenizer, vision=trusting_prompts)  # noqa: E731
    async with running(make_app(fake, processor.tokenizer, loader=loader)) as client:
        by_url = await client.post(CHAT, json=image_chat(user(image_part(f"{image_server}/red.png"))))
        inline = await client.post(CHAT, json=image_chat(user(image_part(data_url(RED)))))
        slow = await client.post(CHAT, json=image_chat(user(text("a"), image_part(f"{image_server}/slow.png"))))
        missing = await client.post(CHAT, json=image_chat(user(image_part(f"{image_server}/none.png"))))
    assert by_url.status_code == inline.status_code == 200, by_url.text
    first, second = fake.submitted
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.encoder_inputs["image_digest"] == second.encoder_inputs["image_digest"]
    assert "timed out" in assert_error(slow, 400, param="messages.0.content.1")["message"]
    assert "HTTP 404" in assert_error(missing, 400, param="messages.0.content.0")["message"]


async def test_a_failed_fetch_ends_the_request_without_waiting_for_the_others(
    processor: Any, image_server: str
) -> None:
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), allow_private=True, fetch_timeout=10)
    prompts = ProcessorPrompts(processor, limits)
    chat = image_chat(user(image_part(f"{image_server}/slow.png"), image_part(f"{image_server}/none.png")))
    started = time.monotonic()
    try:
        with pytest.raises(BadRequestError) as caught:
            await prompts.encode_chat([ChatMessage.model_validate(m) for m in chat["messages"]], None, True, False)
    finally:
        prompts.close()
    assert caught.value.param == "messages.0.content.1" and "HTTP 404" in caught.value.message
    assert time.monotonic() - started < 1.5  # the slow image (2 s) was not waited for


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims another size (CRC fixed)."""
    data = png((0, 0, 0), (1, 1))
    start = data.index(b"IHDR")
    chunk = b"IHDR" + struct.pack(">II", width, height) + data[start + 12 : start + 17]
    return data[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[start + 21 :]


# Each bad input, the part it must name, and a word its message must hold.
BAD_INPUTS = {
    "undecodable": (
        image_chat(user(text("x"), image_part(data_url(b"GIF89a garbage")))),
        "messages.0.content.1",
        "could not be",
    ),
    "not-base64": (image_chat(user(image_part("data:image/png;base64,@@@@"))), "messages.0.content.0", "base64"),
    "too-many-images": (
        image_chat(
            user(image_part(data_url(RED)), image_part(data_url(RED))), user(text("and"), image_part(data_url(BLUE)))
        ),
        "messages.1.content.1",
        "--limit-mm-per-prompt",
    ),
    "too-many-pixels": (
        image_chat(user(image_part(data_url(_png_claiming(2000, 1000))))),
        "messages.0.content.0",
        "--max-image-pixels",
    ),
    "too-many-bytes": (
        image_chat(user(image_part(data_url(b"\0" * 70_000)))),
        "messages.0.content.0",
        "--max-image-bytes",
    ),
    "host-not-allowed": (
        image_chat(user(image_part("https://example.com/cat.png"))),
        "messages.0.content.0",
        "not allowed",
    ),
    "loopback": (
        image_chat(user(image_part("http://localhost:9/cat.png"))),
        "messages.0.content.0",
        "--allow-private-media-urls",
    ),
    "other-scheme": (image_chat(user(image_part("file:///etc/passwd"))), "messages.0.content.0", "not supported"),
}


class GatedEngine(FakeEngine):
    """Holds every request's last output until `gate` opens: a stream stays in flight while the test goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def _outputs(self, request: EngineRequest, script: Any) -> AsyncIterator[RequestOutput]:
        async for output in super()._outputs(request, script):
            if output.finish_reason is not None:
                await self.gate.wait()
            yield output


async def test_each_bad_image_gets_its_400_while_a_good_stream_finishes(
    processor: Any, strict_prompts: ProcessorPrompts
) -> None:
    engine = GatedEngine()
    loader = lambda: make_context(engine, processor.tokenizer, vision=strict_prompts)  # noqa: E731
    async with running(make_app(engine, processor.tokenizer, loader=loader)) as client:
        good_body = two_images() | {"stream": True, "stream_options": {"include_usage": True}}
        good = asyncio.create_task(client.post(CHAT, json=good_body))
        await wait_until(lambda: bool(engine.submitted) or good.done(), timeout=30)
        assert not good.done(), good.result().text
        names = list(BAD_INPUTS)
        answers = await asyncio.gather(*(client.post(CHAT, json=BAD_INPUTS[name][0]) for name in names))
        assert not good.done() and len(engine.submitted) == 1  # no bad image reached the engine
        engine.gate.set()
        streamed = await good
    for name, answer in zip(names, answers, strict=True):
        _, param, words = BAD_INPUTS[name]
        assert words in assert_error(answer, 400, param=param)["message"], name
    chunks = sse_chunks(streamed.text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hello, world"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)


async def test_a_text_model_refuses_images(client: httpx.AsyncClient) -> None:
    body = image_chat(user(image_part(data_url(RED))))
    assert "does not read images" in assert_error(await client.post(CHAT, json=body), 400, param="messages")["message"]
    tokenize = {"model": MODEL, "messages": body["messages"]}
    assert (
        "does not read images"
        in assert_error(await client.post("/tokenize", json=tokenize), 400, param="messages")["message"]
    )


async def test_model_card_says_images_are_read(vision_client: httpx.AsyncClient, client: httpx.AsyncClient) -> None:
    for path in ("/v1/models", f"/v1/models/{MODEL}"):
        card = (await vision_client.get(path)).json()
        card = card["data"][0] if "data" in card else card
        assert card["input_modalities"] == ["text", "image"]
    assert (await client.get("/v1/models")).json()["data"][0]["input_modalities"] == ["text"]


async def test_tokenize_counts_image_tokens(vision_client: httpx.AsyncClient, fake: FakeEngine, processor: Any) -> None:
    body = two_images()
    counted = await vision_client.post("/tokenize", json={"model": MODEL, "messages": body["messages"]})
    assert counted.status_code == 200, counted.text
    assert (await vision_client.post(CHAT, json=body)).status_code == 200
    tokens = counted.json()["tokens"]
    assert tokens == fake.submitted[-1].prompt_token_ids and counted.json()["count"] == len(tokens)
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert tokens.count(image_token) == 2 * 25  # LLaVA's 30 px image, 6 px patches: 25 tokens each
    too_many = {"model": MODEL, "messages": BAD_INPUTS["too-many-images"][0]["messages"]}
    assert_error(await vision_client.post("/tokenize", json=too_many), 400, param="messages.1.content.1")
