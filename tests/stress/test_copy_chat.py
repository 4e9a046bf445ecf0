"""`loadtest compare --endpoint copy-chat`: the copy-heavy chats speculative decoding is measured on."""

from __future__ import annotations

from loadtest import compare, copy_chat


def test_every_prompt_carries_what_its_answer_copies() -> None:
    every = copy_chat.prompts()
    assert len(every) == len(copy_chat.CODE) + len(copy_chat.PASSAGES)
    for old, new, source in copy_chat.CODE.values():
        assert old in source and new not in source  # the rename changes something, and only that
        assert any(source in prompt and f"`{old}` renamed to `{new}`" in prompt for prompt in every)
    level = copy_chat.pick(10, seed=1)
    assert set(level) == set(every) and copy_chat.pick(10, seed=1) == level


def test_copy_chats_are_greedy_and_end_where_the_model_ends_them() -> None:
    args = compare.parse_args(["--endpoint", "copy-chat", "--max-tokens", "400", "--target", "server"])
    prompt = copy_chat.pick(1, seed=0)[0]
    body = compare.request_body(args, "server", "m", prompt)
    assert body["messages"] == [{"role": "user", "content": prompt}]
    assert body["temperature"] == 0 and body["max_tokens"] == 400 and "ignore_eos" not in body
    assert compare.PATHS["copy-chat"] == "/v1/chat/completions"
    assert compare.inputs(args, 3, 0) == copy_chat.pick(3, 0)
