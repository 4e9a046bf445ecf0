"""Run-time LoRA loads and unloads (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from transformers_openai.engine.lora_adapters import AdapterError, LoraAdapters, RuntimeLoadingOff, UnknownAdapter
from transformers_openai.protocol.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from transformers_openai.serving.context import ServingContext
from transformers_openai.serving.errors import BadRequestError, ModelNotFoundError, NotFoundError

_OFF = "LoRA adapters are not loaded at run time on this server (start it with --allow-runtime-lora)"


class LoraHandler:
    """Loads (in a worker thread: the weights are read from disk) and unloads the served model's adapters."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def load(self, request: LoadLoraAdapterRequest) -> str:
        adapters = self._adapters()
        if self.ctx.serves(request.lora_name):
            raise BadRequestError(f"the model or adapter '{request.lora_name}' is already served", param="lora_name")
        try:
            await asyncio.to_thread(adapters.load, request.lora_name, Path(request.lora_path), True)
        except RuntimeLoadingOff as exc:
            raise NotFoundError(str(exc)) from exc
        except AdapterError as exc:
            raise BadRequestError(str(exc), param="lora_path") from exc
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, request: UnloadLoraAdapterRequest) -> str:
        try:
            self._adapters().unload(request.lora_name)
        except RuntimeLoadingOff as exc:
            raise NotFoundError(str(exc)) from exc
        except UnknownAdapter as exc:
            raise ModelNotFoundError(str(exc), param="lora_name") from exc
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _adapters(self) -> LoraAdapters:
        adapters = self.ctx.adapters
        if adapters is None or adapters.limits.dirs is None:
            raise NotFoundError(_OFF)
        return adapters
