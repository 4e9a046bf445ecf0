"""Token texts for logprobs are read on the event loop: they never wait for the lock that encoding holds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from transformers_openai.serving.tokenizer import TokenizerService


def test_token_text_does_not_wait_while_a_prompt_is_being_encoded(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    service = TokenizerService(tokenizer)
    expected = tokenizer.decode([42], skip_special_tokens=False)
    held, release = threading.Event(), threading.Event()

    def slow_encode() -> None:
        with service._lock:  # what a long chat rendering holds
            held.set()
            release.wait(5)

    worker = threading.Thread(target=slow_encode)
    worker.start()
    try:
        assert held.wait(5)
        start = time.monotonic()
        assert service.token_text(42) == expected
        assert service.token_text(42) == expected  # the second time from the cache
        assert time.monotonic() - start < 1.0  # did not wait for the 5 s the lock is held
    finally:
        release.set()
        worker.join()
