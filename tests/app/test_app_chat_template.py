"""--chat-template overrides the tokenizer's template; a model without any template gets a clear 400 for chat."""

from __future__ import annotations

import copy
from typing import Any

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, MAX_MODEL_LEN, MODEL, assert_error, chat_body, completion_body, running
from transformers_openai.api.app import create_app
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.tokenizer import TokenizerService
from transformers_openai.settings import Settings

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
)


def _app(fake: FakeEngine, tokenizer: Any, template: str | None) -> Any:
    context = ServingContext(
        engine=fake,
        tokenizer=TokenizerService(tokenizer, template),
        model_name=MODEL,
        model_aliases=frozenset({MODEL}),
        max_model_len=MAX_MODEL_LEN,
        model_kind="causal-lm",
    )
    return create_app(Settings(model=MODEL), loader=lambda: context)


async def test_template_file_overrides_the_tokenizer_template(fake: FakeEngine, hf_tokenizer: Any) -> None:
    async with running(_app(fake, copy.deepcopy(hf_tokenizer), TEMPLATE)) as client:
        response = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": "Hi there"}]))
        assert response.status_code == 200
    expected = hf_tokenizer.encode("[user] Hi there\n[bot]", add_special_tokens=False)
    assert fake.submitted[-1].prompt_token_ids == expected


async def test_no_chat_template_is_a_clear_400_but_completions_work(fake: FakeEngine, hf_tokenizer: Any) -> None:
    bare = copy.deepcopy(hf_tokenizer)
    bare.chat_template = None
    async with running(_app(fake, bare, None)) as client:
        error = assert_error(await client.post(CHAT, json=chat_body()), 400, param="messages")
        assert "chat template" in error["message"]
        assert (await client.post(COMPLETIONS, json=completion_body())).status_code == 200
