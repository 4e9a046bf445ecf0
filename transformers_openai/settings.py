"""The one typed configuration: every field is a CLI flag (kebab-case) and an environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ModelKind = Literal["auto", "causal-lm", "seq2seq", "whisper"]


class Settings(BaseSettings):
    """Precedence: command-line flag, then environment variable (upper-case field name), then default."""

    model_config = SettingsConfigDict(
        case_sensitive=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m transformers_openai.main",
        populate_by_name=True,
        extra="ignore",
    )

    model: str = Field(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        validation_alias=AliasChoices("model", "hf_model"),
        description="Hub id or local directory of the model (alias: --hf-model / HF_MODEL).",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside --model to load (dequantized on load).")
    served_model_name: str | None = Field(None, description="Model id clients use; defaults to --model.")
    model_kind: ModelKind = Field("auto", description="Model kind; auto detects it from the model's config.")
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(7088, ge=1, le=65535, description="Port to bind.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        validation_alias=AliasChoices("dtype", "torch_dtype"),
        description="Weights dtype; auto is bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="Where the model runs; auto prefers CUDA.")
    attn_implementation: str = Field("sdpa", description="Attention kernel: sdpa, eager, flash_attention_2, ...")
    max_batch_size: int = Field(16, ge=1, le=1024, description="Most requests (rows) stepped together.")
    max_queue: int = Field(64, ge=0, description="Most requests waiting beyond the running batch; more get 429.")
    max_model_len: int | None = Field(
        None, ge=8, description="Context length (prompt + completion); defaults to the model's own limit."
    )
    chat_template: Path | None = Field(None, description="Jinja file overriding the tokenizer's chat template.")
    response_role: str = Field("assistant", description="Role of the generated chat message.")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="max_tokens when a request gives none; unset: rest of the context (chat), 16 (completions).",
    )
    max_request_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (default: torch's).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level.")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
