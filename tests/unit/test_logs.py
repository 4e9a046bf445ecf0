"""Log records go through a queue to a writer thread: same lines, request ids and exceptions, nothing lost."""

from __future__ import annotations

import json
import logging

import pytest

from transformers_openai.logs import Enqueue, request_id_var, setup_logging
from transformers_openai.protocol.base import LOGGED_KEY_CHARS
from transformers_openai.protocol.text import ChatMessage


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if isinstance(handler, Enqueue):
            handler.stop()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_keep_request_id_extras_and_exception_after_the_queue(restore_root, capsys) -> None:
    setup_logging("info", "json")
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler, Enqueue)
    token = request_id_var.set("req-7")
    try:
        logging.getLogger("t").info("finished %d tokens", 12, extra={"request": {"tokens": 12}})
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("t").exception("step failed")
    finally:
        request_id_var.reset(token)
    handler.close()  # what uvicorn's logging set-up does to existing handlers: records still get through
    logging.getLogger("t").info("after close")
    handler.stop()  # at exit: flushes the queue
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["message"] for line in lines] == ["finished 12 tokens", "step failed", "after close"]
    assert all(line["request_id"] == "req-7" for line in lines[:2])
    assert lines[0]["request"] == {"tokens": 12}
    assert "ValueError: boom" in lines[1]["exception"]


def test_unknown_message_keys_are_logged_as_a_count_and_a_few_short_escaped_names(caplog) -> None:
    huge, forged = "k" * 1_000_000, "x\n2026-01-01 ERROR forged line"
    keys = {huge: 1, forged: 2, **{f"extra{i}": i for i in range(10)}}
    with caplog.at_level(logging.WARNING, logger="transformers_openai.protocol.base"):
        message = ChatMessage.model_validate({"role": "user", "content": "hi", **keys})
    assert message.model_extra == {}
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and len(line) < 500, line
    assert line.startswith("ignored 12 unknown keys in a ChatMessage: ")
    assert repr("k" * LOGGED_KEY_CHARS) + "..." in line  # cut short
    assert repr(forged) in line  # the newline escaped: no forged line
    assert line.endswith(" and 7 more")
