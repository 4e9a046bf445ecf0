"""What tensor parallelism needs of a model and of the settings, checked from the config before any weight loads."""

from __future__ import annotations

from transformers import PretrainedConfig


def tensor_parallel_problem(
    config: PretrainedConfig, kind: str, size: int, quantization: str, gguf_file: str | None, device_map: str | None
) -> str | None:
    """Why `--tensor-parallel-size size` cannot serve this model with these settings; None when it can."""
    if size == 1:
        return None
    flag = f"--tensor-parallel-size {size}"
    if kind != "causal-lm":
        return f"{flag} serves decoder-only language models; this model is served as {kind}"
    if device_map:
        return f"{flag} and --device-map both split the model: use one of them"
    if quantization != "none" or gguf_file:
        return f"{flag} serves unquantized checkpoints only (no --quantization, no GGUF file)"
    text = config.get_text_config(decoder=True)
    if not getattr(text, "base_model_tp_plan", None):
        return f"{flag}: transformers has no tensor-parallel plan for {config.model_type} models"
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        return (
            f"{flag} must divide the model's attention heads ({heads}) and K/V heads ({kv_heads}): each rank holds "
            "an equal share of them"
        )
    return None
