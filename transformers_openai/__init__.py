"""transformers-openai-api: HuggingFace Transformers models behind the OpenAI API, continuously batched."""

__version__ = "0.1.0"
