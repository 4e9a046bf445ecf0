"""A Qwen3-style `<think>` chat template for the reasoning tests: it opens the thought in the generation prompt
(or writes an empty one when `enable_thinking` is false), shows `reasoning_effort`, the tools, and the thought of a
final assistant message only (earlier thoughts are dropped, as Qwen3's template drops them)."""

from __future__ import annotations

THINK_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% if reasoning_effort is defined and reasoning_effort %}"
    "{{ '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.role == 'assistant' and loop.last and message.reasoning_content %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

# A response_template of the kind transformers reads (`tokenizer.response_template`), with markers of its own so
# that a test can tell it was used rather than the `<think>` default.
THOUGHT_START, THOUGHT_END = "[THINK]", "[/THINK]"
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": THOUGHT_START, "close": THOUGHT_END, "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}
