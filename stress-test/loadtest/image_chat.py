"""The `image-chat` workload of `loadtest compare`: chats that each carry a picture of their own, for a
vision-language model, and the in-process `generate` loop it is compared with."""

from __future__ import annotations

import base64
import io
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# Sizes of the pictures sent, as a phone or a screenshot tool might send them scaled down.
SIDES = ((160, 120), (320, 240), (480, 360), (640, 480))
QUESTIONS = (
    "What is in this picture?",
    "Describe the colours you see.",
    "Is this a photograph or a drawing?",
    "Write a caption for this image.",
    "What stands out first in this image, and why?",
)


def picture(index: int, seed: int) -> str:
    """A JPEG data URL of smooth random colours, different for every index (no two requests share an image, so
    no server reuses one's prefix), of one of `SIDES`."""
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    width, height = SIDES[index % len(SIDES)]
    coarse = rng.integers(0, 256, (max(height // 40, 2), max(width // 40, 2), 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR).save(out, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def pick(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` requests' question and picture."""
    rng = random.Random(seed)
    return [(QUESTIONS[rng.randrange(len(QUESTIONS))], picture(i, seed)) for i in range(n)]


def messages(item: tuple[str, str]) -> list[dict[str, Any]]:
    question, url = item
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}],
        }
    ]


def generate_loop(model_dir: str, threads: int, max_tokens: int) -> Callable[[tuple[str, str]], tuple[float, int]]:
    """One request at a time through transformers' own `generate` (AutoModelForImageTextToText, its processor):
    returns a function of a request giving its seconds and output tokens, the image decoded and processed inside."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(threads)
    processor = AutoProcessor.from_pretrained(model_dir)
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(item: tuple[str, str]) -> tuple[float, int]:
        start = time.perf_counter()
        question, url = item
        image = Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))).convert("RGB")
        chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
        inputs = processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        return time.perf_counter() - start, int(out.shape[-1] - inputs["input_ids"].shape[-1])

    return run
