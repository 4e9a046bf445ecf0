"""The repo's SmolLM2 tool template: without tools it renders exactly as the model's own template does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "chat-templates" / "smollm2-tools.jinja"
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "?"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)  # SmolLM2's tokenizer and template


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_it_renders_as_the_models_own(
    tokenizer: Any, conversation: list[dict[str, Any]], generation_prompt: bool
) -> None:
    own = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    ours = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=generation_prompt, chat_template=TEMPLATE.read_text()
    )
    assert ours == own


def test_with_tools_it_lists_them_in_the_system_message(tokenizer: Any) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(
        conversation, tools=[tool], tokenize=False, add_generation_prompt=True, chat_template=TEMPLATE.read_text()
    )
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.") and '"name": "get_weather"' in system
    assert "<tool_call>" in system and text.endswith("<|im_start|>assistant\n")
