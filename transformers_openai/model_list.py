"""The models one server serves: --model, --models and --models-config expanded into one Settings each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import snapshot_download
from pydantic import ValidationError

from transformers_openai.settings import Settings

# What a --models-config entry may set for its model; the rest (ports, keys, limits of the HTTP side) is the server's.
PER_MODEL_SETTINGS = frozenset(
    {
        "model",
        "served_model_name",
        "model_kind",
        "gguf_file",
        "quantization",
        "int8_products",
        "int8_output_layer",
        "dtype",
        "device",
        "attn_implementation",
        "pack_cpu_weights",
        "enforce_eager",
        "cpu_compile",
        "device_map",
        "max_batch_size",
        "max_queue",
        "max_prefill_tokens",
        "max_model_len",
        "kv_cache_memory",
        "kv_block_size",
        "speculative_config",
        "chat_template",
        "tool_call_parser",
        "reasoning_parser",
        "default_chat_template_kwargs",
        "response_role",
        "default_max_tokens",
        "max_audio_seconds",
        "max_embedding_tokens",
        "torch_threads",
    }
)
_SERVER_WIDE = ("models", "models_config")


def read_models_config(path: Path) -> list[dict[str, Any]]:
    """The entries of a --models-config file (JSON, or YAML by its .yaml/.yml name); a ValueError says what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--models-config {path} cannot be read: {exc.strerror or exc}") from None
    try:
        entries = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"--models-config {path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}"
        ) from None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"--models-config {path} must hold a list of objects, one per model")
    for index, entry in enumerate(entries):
        if not isinstance(entry.get("model"), str) or not entry["model"]:
            raise ValueError(f"--models-config {path}: entry {index} has no `model` (a hub id or a local directory)")
        unknown = sorted(set(entry) - PER_MODEL_SETTINGS)
        if unknown:
            raise ValueError(
                f"--models-config {path}: entry {index} sets {', '.join(unknown)}, which are not per-model settings "
                f"(allowed: {', '.join(sorted(PER_MODEL_SETTINGS))})"
            )
    return entries


def _flag_entry(item: str) -> dict[str, Any]:
    """A --models item: PATH, or NAME=PATH."""
    name, sep, path = item.partition("=")
    return {"model": path, "served_model_name": name} if sep and name and path else {"model": item}


def served_models(settings: Settings) -> list[Settings]:
    """One Settings per served model, in order: --model (when given, or when nothing else is), then --models, then
    the --models-config entries; each entry's settings override the server's. Two models with one served name, or an
    entry whose settings do not validate, are a ValueError."""
    entries = [_flag_entry(item) for item in settings.models]
    if settings.models_config is not None:
        entries += read_models_config(settings.models_config)
    if not entries:
        return [settings]
    base = settings.model_dump(exclude={*_SERVER_WIDE, "served_model_name"})
    listed = [settings] if "model" in settings.model_fields_set else []
    for entry in entries:
        try:
            listed.append(Settings.model_validate({**base, **entry}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"the settings of model {entry['model']} are not valid: {problems}") from None
    if len(listed) > 1 and settings.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size serves one model: it does not apply with --models or --models-config")
    names = [model.model_name for model in listed]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"two models are served as {', '.join(repeated)}: give each its own served_model_name")
    return listed


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Without --models-memory-budget, several models may take this share of the machine's memory together.
DEFAULT_BUDGET_SHARE = 0.8


def weights_bytes(model: str) -> int:
    """The size of a model's weight files (a local directory, or a hub id already downloaded): what loading it is
    expected to take; 0 when they are not stored here (the load is then charged what it measured)."""
    folder = Path(model)
    if not folder.is_dir():
        try:  # a hub id already downloaded: its snapshot folder, found offline
            folder = Path(snapshot_download(model, local_files_only=True))
        except Exception:  # not stored here, or not a hub id
            return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))


def memory_budget(settings: Settings, listed: int) -> int | None:
    """--models-memory-budget in bytes; by default, with several models or --load-on-demand, a share of the machine's
    memory (one model loaded at start is not bounded, as before)."""
    if settings.models_memory_budget is not None:
        return int(settings.models_memory_budget)
    if listed < 2 and not settings.load_on_demand:
        return None
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(int(fields["MemTotal"].split()[0]) * 1024 * DEFAULT_BUDGET_SHARE)
    except (OSError, KeyError, ValueError):
        return None
