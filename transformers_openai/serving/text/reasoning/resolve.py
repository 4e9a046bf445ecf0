"""Which reasoning format a served model has: --reasoning-parser, or for `auto`, what its tokenizer says."""

from __future__ import annotations

import logging
from dataclasses import replace

from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.text.reasoning.format import ReasoningFormat
from transformers_openai.serving.text.reasoning.response_template import TemplateReasoning
from transformers_openai.serving.text.reasoning.think_markers import ThinkMarkers

logger = logging.getLogger(__name__)

START, END = "<think>", "</think>"


def reasoning_format(ctx: ServingContext) -> ReasoningFormat | None:
    """The served model's reasoning format; None: no split (the thought, if any, stays in the content).

    `auto`: the tokenizer's response_template where it has one with a thought field, else `<think>` markers when the
    chat template writes them (qwen3's reading: a thought is one the prompt opens or the text opens), else none.
    Call it once per served model (handlers keep it): it reads the template and the vocabulary.
    """
    name = ctx.reasoning_parser
    tokenizer = ctx.tokenizer
    if name == "none" or ctx.encoder_decoder:
        return None
    if name in ("auto", "response_schema"):
        template = tokenizer.response_template()
        if template is not None:
            found = TemplateReasoning.of(template, tokenizer.decode_now)
            if found is not None:
                markers = (tokenizer.added_token(found.start), tokenizer.added_token(found.end))
                return replace(found, keeps_markers=any(marker is not None and marker[1] for marker in markers))
        if name == "response_schema":
            logger.warning("--reasoning-parser response_schema: the tokenizer has no usable response_template")
            return None
    if name == "auto":
        source = tokenizer.template_source() + tokenizer.template_source(with_tools=True)
        if START not in source or END not in source:
            return None
    return _think_markers(ctx, implicit_start=name == "deepseek_r1", name="qwen3" if name == "auto" else name)


def _think_markers(ctx: ServingContext, implicit_start: bool, name: str) -> ThinkMarkers:
    start, end = ctx.tokenizer.added_token(START), ctx.tokenizer.added_token(END)
    ids = (start[0], end[0]) if start is not None and end is not None else None
    keeps = any(marker is not None and marker[1] for marker in (start, end))
    return ThinkMarkers(
        ctx.tokenizer.decode_now,
        START,
        END,
        implicit_start=implicit_start,
        marker_ids=ids,
        keeps_markers=keeps,
        name=name,
    )
