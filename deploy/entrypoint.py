"""Container entry point: runs `python -m transformers_openai.main` after filling in two defaults from the environment.

- No model named (neither MODEL / HF_MODEL nor --model / --hf-model): the README's quick-start model, under the
  name its examples use and with the tools chat template `scripts/serve-smollm2.sh` gives it, so those examples
  work against `docker compose up` unchanged. Naming any model drops all three: another model gets its own
  name (its id) and its own template.
- GPU_REPLICAS=N (the compose `replica` service sets it to REPLICAS) and no KV_CACHE_MEMORY: each replica's K/V
  cache takes 0.85 / N of the GPU memory free after loading, so N replicas on one GPU share the 0.85 that one
  server would take instead of each taking 0.85 of it.

Standard library only. Settings reads environment variables case-insensitively, and so does this.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

SERVER_COMMAND = ["-m", "transformers_openai.main"]
QUICK_START = {
    "HF_MODEL": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "SERVED_MODEL_NAME": "SmolLM2-135M-Instruct",
    "CHAT_TEMPLATE": str(Path(__file__).resolve().parent / "chat-templates" / "smollm2-tools.jinja"),
}
MODEL_VARIABLES = ("model", "hf_model")
MODEL_FLAGS = ("--model", "--hf-model")
# The server's own K/V default on CUDA (a fraction of the free memory), split among the replicas of one GPU.
KV_FRACTION_ONE_GPU = 0.85


def _lower(env: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in env.items()}


def names_a_model(env: Mapping[str, str], args: Sequence[str]) -> bool:
    lowered = _lower(env)
    if any(lowered.get(name, "").strip() for name in MODEL_VARIABLES):
        return True
    return any(arg == flag or arg.startswith(flag + "=") for arg in args for flag in MODEL_FLAGS)


def server_environment(env: Mapping[str, str], args: Sequence[str]) -> dict[str, str]:
    """The environment the server starts with: `env` plus the defaults above; a variable already set is kept."""
    result = dict(env)
    lowered = _lower(env)
    if not names_a_model(env, args):
        for name, value in QUICK_START.items():
            if not lowered.get(name.lower(), "").strip():
                result[name] = value
    replicas = lowered.get("gpu_replicas", "").strip()
    if replicas and not lowered.get("kv_cache_memory", "").strip():
        count = int(replicas)
        if count < 1:
            raise SystemExit(f"GPU_REPLICAS must be at least 1, not {count}")
        result["KV_CACHE_MEMORY"] = f"{KV_FRACTION_ONE_GPU / count:.4f}"
    return result


def main() -> None:
    args = sys.argv[1:]
    os.execve(sys.executable, [sys.executable, *SERVER_COMMAND, *args], server_environment(os.environ, args))


if __name__ == "__main__":
    main()
