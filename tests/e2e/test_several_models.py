"""One server, three kinds of model (a decoder, an embedding model, Whisper), each loaded on the first request naming
it: chat, embeddings and transcriptions by model name; a load past the memory budget unloads the idle models; an
idle model is unloaded after 5 s and the process's resident memory drops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, start_server, wait_for
from transformers_openai.model_list import weights_bytes

LIBRISPEECH = "librispeech-7021-79759-0004.wav"
IDLE_S = 5


@pytest.fixture(scope="module")
def several(
    tiny_llama_dir: Path,
    minilm_dir: Path,
    whisper_dir: Path,
    server_logs: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """tiny-llama (test-model, --model), MiniLM (minilm, --models) and Whisper tiny.en (whisper, --models-config), none
    loaded at start; the budget holds the decoder beside either of the others, never MiniLM and Whisper together."""
    budget = weights_bytes(str(minilm_dir)) + weights_bytes(str(whisper_dir)) - 1
    assert weights_bytes(str(tiny_llama_dir)) < weights_bytes(str(minilm_dir))
    config = tmp_path_factory.mktemp("models") / "models.yaml"
    config.write_text(f"- model: {whisper_dir}\n  served_model_name: whisper\n  max_batch_size: 2\n")
    server = start_server(
        tiny_llama_dir,
        server_logs,
        *("--models", f"minilm={minilm_dir}", "--models-config", str(config)),
        *("--load-on-demand", "--idle-unload-seconds", str(IDLE_S), "--models-memory-budget", str(budget)),
        *("--no-cpu-compile", "--max-batch-size", "4"),
    )
    yield server
    server.stop()


def _states(server: ServerProcess) -> dict[str, str]:
    cards = httpx.get(f"{server.root_url}/v1/models").json()["data"]
    return {card["id"]: card["state"] for card in cards}


def _resident_bytes(pid: int) -> int:
    """Resident memory from the page tables (smaps_rollup): VmRSS is a counter each thread updates in batches, and
    read from outside it once lagged a whole model behind."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Rss in smaps_rollup")


def test_three_kinds_by_name_loaded_on_demand_evicted_and_unloaded(
    several: ServerProcess, whisper_dir: Path, audio_dir: Path
) -> None:
    base = f"{several.root_url}/v1"
    assert _states(several) == {"test-model": "unloaded", "minilm": "unloaded", "whisper": "unloaded"}
    with httpx.Client(timeout=120) as client:
        chat = client.post(
            f"{base}/chat/completions",
            json={"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "test-model" and chat.json()["usage"]["completion_tokens"] > 0
        embedding = client.post(f"{base}/embeddings", json={"model": "minilm", "input": "a cat"})
        assert embedding.status_code == 200, embedding.text
        assert len(embedding.json()["data"][0]["embedding"]) == 384
        assert _states(several) == {"test-model": "loaded", "minilm": "loaded", "whisper": "unloaded"}

        with (audio_dir / LIBRISPEECH).open("rb") as clip:
            text = client.post(f"{base}/audio/transcriptions", data={"model": "whisper"}, files={"file": clip})
        loaded_rss = _resident_bytes(several.process.pid)  # at once: whisper stays loaded for 5 s more
        assert text.status_code == 200, text.text
        assert len(text.json()["text"].split()) > 3
        states = _states(several)  # MiniLM made room (the decoder, idle and used longer ago, went first)
        assert states["whisper"] == "loaded" and states["minilm"] == "unloaded"

        unknown = client.post(f"{base}/embeddings", json={"model": "nobody", "input": "a cat"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    assert wait_for(lambda: set(_states(several).values()) == {"unloaded"}, timeout_s=IDLE_S + 10)
    dropped = loaded_rss - _resident_bytes(several.process.pid)
    assert dropped > weights_bytes(str(whisper_dir)) // 2, f"RSS dropped by {dropped / 2**20:.0f} MiB only"
