"""The model's thought told from its answer: formats, which one a model has, and a streaming splitter."""

from transformers_openai.serving.text.reasoning.format import ReasoningFormat
from transformers_openai.serving.text.reasoning.resolve import reasoning_format
from transformers_openai.serving.text.reasoning.response_template import TemplateReasoning
from transformers_openai.serving.text.reasoning.splitter import ReasoningSplitter
from transformers_openai.serving.text.reasoning.think_markers import MarkerSplitter, ThinkMarkers

__all__ = [
    "MarkerSplitter",
    "ReasoningFormat",
    "ReasoningSplitter",
    "TemplateReasoning",
    "ThinkMarkers",
    "reasoning_format",
]
