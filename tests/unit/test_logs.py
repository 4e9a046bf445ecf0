"""Log records go through a queue to a writer thread: same lines, request ids and exceptions, nothing lost."""

from __future__ import annotations

import json
import logging

import pytest

from transformers_openai.logs import Enqueue, request_id_var, setup_logging


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
