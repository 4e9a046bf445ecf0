"""A chat request's variables for its chat template: the server's defaults, the request's own, its reasoning effort."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

from transformers_openai.protocol import ReasoningEffort
from transformers_openai.serving.errors import BadRequestError

# apply_chat_template's own arguments (and the names it renders with): a variable of that name would replace them.
RENDERING_ARGUMENTS = frozenset(
    {
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)
# Thinking switches templates read (Qwen3 and SmolLM3: enable_thinking; DeepSeek-V3.1 and Granite: thinking).
BOOLEAN_VARIABLES = ("enable_thinking", "thinking")
PARAM = "chat_template_kwargs"


def template_variables(
    defaults: Mapping[str, Any], own: Mapping[str, Any] | None, reasoning_effort: str | None = None
) -> dict[str, Any]:
    """The variables a request's chat template renders with: the server's `defaults` under the request's `own`
    (its chat_template_kwargs); a 400 naming the key for one it may not set or one of the wrong type.
    `reasoning_effort` (a request field, checked by its model) reaches the template under its name."""
    variables = {**defaults, **(own or {})}
    for key in own or {}:
        if key in RENDERING_ARGUMENTS:
            raise BadRequestError(
                f"{PARAM} cannot set '{key}': it is an argument of the template's rendering, not a template variable"
                + (
                    " (use the request field of that name)"
                    if key in ("add_generation_prompt", "continue_final_message")
                    else ""
                ),
                param=f"{PARAM}.{key}",
            )
    for key in BOOLEAN_VARIABLES:
        if key in variables and not isinstance(variables[key], bool):
            raise BadRequestError(f"{PARAM}.{key} must be a boolean", param=f"{PARAM}.{key}")
    effort = variables.get("reasoning_effort")
    if effort is not None and effort not in get_args(ReasoningEffort):
        allowed = ", ".join(repr(value) for value in get_args(ReasoningEffort))
        raise BadRequestError(f"{PARAM}.reasoning_effort must be one of {allowed}", param=f"{PARAM}.reasoning_effort")
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
    return variables
