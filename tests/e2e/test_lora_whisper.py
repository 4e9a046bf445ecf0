"""LoRA adapters on Whisper tiny.en: a transcription naming an adapter equals its `PeftModel.generate` greedy
transcription of the clip alone (the adapter on the encoder's, decoder's and cross-attention's query and value
projections), also when windows with adapter A, adapter B and none share batches; an adapter loaded at run time
serves the next request, and unloaded it is a 404; a realtime session naming an adapter transcribes with it."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from loadtest.realtime_bench import pcm24k
from openai import NotFoundError

from tests.e2e.conftest import async_client, sync_client
from tests.e2e.server import ServerProcess, start_server
from tests.e2e.speech_reference import generate_text, peft_generate_text
from tests.e2e.test_realtime import uploaded_text

pytestmark = pytest.mark.slow

MODEL = "test-model"
CLIPS = ["flite-s2.wav", "flite-s4.wav"]


@pytest.fixture(scope="module")
def lora_server(whisper_dir: Path, whisper_loras: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """Whisper tiny.en with the adapter `whisper-a` from the start and others loadable from `whisper_loras`. Its own
    server: serving adapters changes the model's layers (an adapter's update goes before the GELU that packing
    fuses into `fc1`), and the shared `lora_server` keeps the path a server without adapters runs."""
    lora = [
        "--lora-modules",
        f"whisper-a={whisper_loras / 'a'}",
        "--allow-runtime-lora",
        "--lora-dir",
        str(whisper_loras),
    ]
    server = start_server(whisper_dir, server_logs, "--max-batch-size", "16", *lora)
    yield server
    server.stop()


async def _transcribe_all(server: ServerProcess, jobs: list[tuple[str, Path]]) -> list[str]:
    """Every (model, clip) at once, greedy without fallback; the texts in order."""
    client = async_client(server)

    async def one(model: str, clip: Path) -> str:
        with clip.open("rb") as f:
            return (await client.audio.transcriptions.create(model=model, file=f, temperature=0)).text

    try:
        return list(await asyncio.gather(*(one(model, clip) for model, clip in jobs)))
    finally:
        await client.close()


def test_a_whisper_lora_transcribes_as_its_peft_model_alone_and_beside_the_base(
    lora_server: ServerProcess, whisper_dir: Path, whisper_loras: Path, audio_dir: Path
) -> None:
    expected = {
        (model, name): generate_text(whisper_dir, audio_dir / name)
        if model == MODEL
        else peft_generate_text(whisper_dir, whisper_loras / "a", audio_dir / name)
        for model in ("whisper-a", MODEL)
        for name in CLIPS
    }
    for name in CLIPS:  # the adapter really changes the text, so equal texts show it applied
        assert expected[("whisper-a", name)] != expected[(MODEL, name)]
    alone = asyncio.run(_transcribe_all(lora_server, [("whisper-a", audio_dir / CLIPS[0])]))
    assert alone == [expected[("whisper-a", CLIPS[0])]]
    jobs = [(model, name) for name in reversed(CLIPS) for model in ("whisper-a", MODEL)]
    texts = asyncio.run(_transcribe_all(lora_server, [(model, audio_dir / name) for model, name in jobs]))
    assert texts == [expected[job] for job in jobs]
    listed = {card.id: card for card in sync_client(lora_server).models.list().data}
    assert listed["whisper-a"].parent == MODEL  # type: ignore[attr-defined]


def test_a_whisper_lora_loaded_at_run_time_batches_with_another_then_unloaded_is_a_404(
    lora_server: ServerProcess, whisper_dir: Path, whisper_loras: Path, audio_dir: Path
) -> None:
    url, clip = lora_server.base_url, audio_dir / CLIPS[0]
    loaded = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "whisper-b", "lora_path": str(whisper_loras / "b")}
    )
    assert loaded.status_code == 200, loaded.text
    try:
        jobs = ["whisper-b", "whisper-a", MODEL]
        texts = asyncio.run(_transcribe_all(lora_server, [(model, clip) for model in jobs]))
    finally:
        unloaded = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "whisper-b"})
    assert unloaded.status_code == 200, unloaded.text
    a_text = peft_generate_text(whisper_dir, whisper_loras / "a", clip)
    assert texts == [
        peft_generate_text(whisper_dir, whisper_loras / "b", clip),
        a_text,
        generate_text(whisper_dir, clip),
    ]
    assert len(set(texts)) == 3
    with pytest.raises(NotFoundError) as caught, clip.open("rb") as f:
        sync_client(lora_server).audio.transcriptions.create(model="whisper-b", file=f)
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_a_realtime_session_naming_a_whisper_lora_transcribes_with_it(
    lora_server: ServerProcess, audio_dir: Path
) -> None:
    pcm = pcm24k(audio_dir / CLIPS[0])

    async def session() -> str:
        client = async_client(lora_server)
        async with client.realtime.connect(model="whisper-a", extra_query={"intent": "transcription"}) as connection:
            update = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
            await connection.session.update(session=update)  # type: ignore[arg-type]
            await connection.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
            await connection.input_audio_buffer.commit()
            async for event in connection:
                if event.type == "conversation.item.input_audio_transcription.completed":
                    return event.transcript
        raise AssertionError("the connection closed before the transcript")

    transcript = asyncio.run(session())
    assert transcript == asyncio.run(uploaded_text(lora_server, pcm, "whisper-a"))
    assert transcript != asyncio.run(uploaded_text(lora_server, pcm))
