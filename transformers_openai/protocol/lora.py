"""The wire protocol of /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes)."""

from __future__ import annotations

from pydantic import Field

from transformers_openai.protocol.base import Strict, Text


class LoadLoraAdapterRequest(Strict):
    lora_name: Text = Field(min_length=1, max_length=256, description="The name requests give as `model`.")
    lora_path: Text = Field(
        min_length=1, max_length=4096, description="The adapter's PEFT directory, under a --lora-dir directory."
    )


class UnloadLoraAdapterRequest(Strict):
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(None, description="Accepted for vLLM's clients; adapters go by name.")
