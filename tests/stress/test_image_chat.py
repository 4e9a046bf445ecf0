"""`loadtest compare --endpoint image-chat`: its pictures, request bodies and rows."""

from __future__ import annotations

import json

from loadtest import compare, image_chat

from transformers_openai.serving.vision.images import data_url_bytes, decode_image
from transformers_openai.serving.vision.limits import ImageLimits


def test_every_request_has_a_picture_of_its_own() -> None:
    items = image_chat.pick(8, seed=3)
    urls = [url for _, url in items]
    assert len(set(urls)) == 8  # no two alike: no server can reuse another request's image prefix
    assert image_chat.pick(8, seed=3) == items  # the same seed, the same level
    limits = ImageLimits()
    sizes = [decode_image(data_url_bytes(url, limits, "p"), limits, "p").size for url in urls]
    assert sizes == [image_chat.SIDES[i % len(image_chat.SIDES)] for i in range(8)]
    assert all(question in image_chat.QUESTIONS for question, _ in items)


def test_image_chat_bodies_for_ours_and_transformers_serve() -> None:
    args = compare.parse_args(["--endpoint", "image-chat", "--max-tokens", "5", "--target", "server"])
    item = image_chat.pick(1, seed=0)[0]
    ours = compare.request_body(args, "server", "m", item)
    [message] = ours["messages"]
    assert message["content"][0] == {"type": "image_url", "image_url": {"url": item[1]}}
    assert message["content"][1] == {"type": "text", "text": item[0]}
    assert ours["ignore_eos"] is True and ours["stream"] is True and ours["max_tokens"] == 5
    theirs = compare.request_body(args, "transformers-serve", "m", item)
    assert "ignore_eos" not in theirs
    assert json.loads(theirs["generation_config"])["min_new_tokens"] == 5
    assert compare.PATHS["image-chat"] == "/v1/chat/completions"
    # transformers serve has no continuous batching for image-text-to-text models: it is started without it.
    assert "--continuous-batching" not in compare.target_command(args, "transformers-serve", 1234)


def test_rows_count_requests_per_second() -> None:
    results = [
        compare.Result(True, 0.5, 5, ttft=0.1),
        compare.Result(True, 0.5, 5, ttft=0.3),
        compare.Result(False, 0.1),
    ]
    row = compare.summarize("server", 2, results, wall=2.0)
    assert row.requests_per_s == 1.0 and row.output_tok_s == 5.0 and row.errors == 1
    assert row.ttft_p50_ms == 200.0
