"""Whisper tiny.en served end to end: the openai client, batching equal to `generate`, long-form, times, streaming."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import srt
import webvtt
from openai.types.audio import (
    Transcription,
    TranscriptionSegment,
    TranscriptionTextDeltaEvent,
    TranscriptionTextDoneEvent,
    TranscriptionVerbose,
)
from openai.types.audio.transcription import UsageDuration

from tests.audio_encoding import low_rate_matroska, low_rate_wav, silent_flac
from tests.e2e.conftest import async_client, sync_client
from tests.e2e.server import ServerProcess, wait_for
from tests.e2e.speech_reference import generate_text, samples, silences, word_error_rate, words
from tests.e2e.test_transcription_stream import stream_counting_steps

pytestmark = pytest.mark.slow

MODEL = "test-model"
SHORT = ["flite-s1.wav", "flite-s2.wav", "flite-s3.wav", "flite-s4.wav", "librispeech-7021-79759-0004.wav"]
LIBRISPEECH = "librispeech-7021-79759-0004.wav"
LONG = "flite-longform.wav"


def transcribe(server: ServerProcess, clip: Path) -> Transcription:
    with clip.open("rb") as f:
        return sync_client(server).audio.transcriptions.create(model=MODEL, file=f)


def transcribe_as(server: ServerProcess, clip: Path, response_format: Literal["text", "srt", "vtt"]) -> str:
    with clip.open("rb") as f:
        return sync_client(server).audio.transcriptions.create(model=MODEL, file=f, response_format=response_format)


def transcribe_verbose(
    server: ServerProcess, clip: Path, *granularities: Literal["word", "segment"]
) -> tuple[TranscriptionVerbose, list[TranscriptionSegment]]:
    """The verbose_json transcription and its segments (always there)."""
    with clip.open("rb") as f:
        client = sync_client(server)
        if granularities:
            verbose = client.audio.transcriptions.create(
                model=MODEL, file=f, response_format="verbose_json", timestamp_granularities=list(granularities)
            )
        else:
            verbose = client.audio.transcriptions.create(model=MODEL, file=f, response_format="verbose_json")
    assert verbose.segments is not None
    return verbose, verbose.segments


def seconds(clock: str) -> float:
    hours, minutes, rest = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def test_every_format_through_the_openai_client(whisper_server: ServerProcess, audio_dir: Path) -> None:
    clip = audio_dir / LIBRISPEECH
    expected = "Without going to any such extreme as this, we can easily see on reflection how vast"
    plain = transcribe(whisper_server, clip)
    assert plain.text.startswith(expected) and plain.text.endswith("upon the mind.")
    assert isinstance(plain.usage, UsageDuration) and plain.usage.seconds == 25  # 24.47 s, rounded up
    assert transcribe_as(whisper_server, clip, "text") == plain.text + "\n"
    verbose, segments = transcribe_verbose(whisper_server, clip)
    assert verbose.text == plain.text and verbose.language == "english" and verbose.duration == pytest.approx(24.47)
    assert "".join(s.text for s in segments).strip() == plain.text
    assert segments[0].text.startswith(" ") and verbose.words is None
    subtitles = list(srt.parse(transcribe_as(whisper_server, clip, "srt")))
    captions = webvtt.from_buffer(io.StringIO(transcribe_as(whisper_server, clip, "vtt"))).captions
    assert [c.content for c in subtitles] == [c.text for c in captions] == [s.text.strip() for s in segments]
    assert [c.start.total_seconds() for c in subtitles] == [s.start for s in segments]
    assert [seconds(c.end) for c in captions] == pytest.approx([s.end for s in segments], abs=0.0005)
    with clip.open("rb") as f:
        events = list(sync_client(whisper_server).audio.transcriptions.create(model=MODEL, file=f, stream=True))
    *deltas, done = events
    texts = [e.delta for e in deltas if isinstance(e, TranscriptionTextDeltaEvent)]
    assert len(texts) == len(deltas) and len(events) > 2
    assert isinstance(done, TranscriptionTextDoneEvent) and "".join(texts) == done.text == plain.text
    # The server reports the seconds billed, as the non-streamed usage does; the client's type knows only tokens.
    assert done.usage is not None and done.usage.to_dict()["seconds"] == 25


@pytest.mark.parametrize("name", SHORT)
def test_one_window_equals_generate_alone(
    whisper_server: ServerProcess, whisper_dir: Path, audio_dir: Path, name: str
) -> None:
    served = transcribe(whisper_server, audio_dir / name).text
    assert served == generate_text(whisper_dir, audio_dir / name)


def test_concurrent_transcriptions_of_mixed_lengths_equal_each_alone(
    whisper_server: ServerProcess, audio_dir: Path
) -> None:
    clips = [*SHORT, LONG, "flite-longform.mp3", LONG, "flite-s2.wav", LIBRISPEECH]
    alone = {name: transcribe(whisper_server, audio_dir / name).text for name in set(clips)}

    async def together() -> list[str]:
        client = async_client(whisper_server)

        async def one(name: str) -> str:
            with (audio_dir / name).open("rb") as f:
                return (await client.audio.transcriptions.create(model=MODEL, file=f)).text

        return await asyncio.gather(*(one(name) for name in clips))

    assert len(clips) >= 10
    for name, text in zip(clips, asyncio.run(together()), strict=True):
        assert text == alone[name], name
    assert whisper_server.engine_state()["rows_in_use"] == 0


def test_long_form_text_and_times(whisper_server: ServerProcess, whisper_dir: Path, audio_dir: Path) -> None:
    clip = audio_dir / LONG
    reference = (audio_dir / "longform.txt").read_text()
    result, segments = transcribe_verbose(whisper_server, clip, "segment", "word")
    ours, theirs = word_error_rate(reference, result.text), word_error_rate(reference, generate_text(whisper_dir, clip))
    assert ours <= 0.05 and ours <= theirs, (ours, theirs)
    duration = samples(clip).size / 16000
    assert result.duration == pytest.approx(duration, abs=0.01)
    assert len(segments) >= 10 and {s.seek for s in segments} >= {0}
    assert len({s.seek for s in segments}) >= 3  # three windows, each starting where the last segment closed
    for before, after in zip(segments, segments[1:], strict=False):
        assert before.end <= after.start + 1e-6
    assert all(0 <= s.start < s.end <= duration for s in segments)
    assert all(s.avg_logprob < 0 and s.compression_ratio > 0 and 0 <= s.no_speech_prob <= 1 for s in segments)
    # Words: in order, inside the audio and inside their segment; together they are the text.
    found = result.words
    assert found is not None
    assert words(" ".join(w.word for w in found)) == words(result.text)
    assert all(a.start <= a.end <= b.start + 1e-6 for a, b in zip(found, found[1:], strict=False))
    assert found[0].start >= 0 and found[-1].end <= duration
    spans = [(s.start, s.end) for s in segments]
    assert all(any(lo - 1e-6 <= w.start and w.end <= hi + 1e-6 for lo, hi in spans) for w in found)
    # The pause after the first sentence falls between "nothing." and "When".
    pause = silences(samples(clip))[0]
    index = next(i for i, w in enumerate(found) if w.word.startswith("nothing"))
    assert found[index + 1].word == "When"
    assert found[index].end <= pause[1] and found[index + 1].start >= pause[0], (found[index], found[index + 1], pause)


def test_streamed_deltas_and_cues_join_to_the_response(whisper_server: ServerProcess, audio_dir: Path) -> None:
    """Long audio streamed token by token (temperature given: no fallback): the first window's first sentence word
    by word, the rest as each segment becomes final (the later windows' first steps find likely silence, so each
    is held to its end), cues as segments finish, joined to exactly the non-streamed text."""
    clip = audio_dir / LONG
    with clip.open("rb") as f:
        full = sync_client(whisper_server).audio.transcriptions.create(
            model=MODEL, file=f, temperature=0, response_format="verbose_json"
        )
    segments = full.segments or []
    events, to_first, total = stream_counting_steps(whisper_server, clip, response_format="srt")
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    cues = [e for e in events if e["type"] == "transcript.text.segment"]
    assert "".join(deltas) == events[-1]["text"] == full.text and events[-1]["type"] == "transcript.text.done"
    expected = [(s.start, s.end, s.text.strip()) for s in segments]
    assert [(c["start"], c["end"], c["text"]) for c in cues] == expected
    assert [c["id"] for c in cues] == [f"seg_{s.id}" for s in segments]
    assert len({s.seek for s in segments}) >= 3 and 0 < to_first <= total / 10, (to_first, total)
    joined, ends = "", set()
    for delta in deltas:
        joined += delta
        ends.add(len(joined))
    bounds = [len("".join(s.text for s in segments[: i + 1]).lstrip()) for i in range(len(segments))]
    assert set(bounds) <= ends  # never one delta across two segments
    assert len([end for end in ends if end <= bounds[0]]) >= len(segments[0].text.split())  # word by word


def test_mp3_and_wav_give_the_same_text(whisper_server: ServerProcess, whisper_dir: Path, audio_dir: Path) -> None:
    def apart(wav: str, mp3: str) -> int:
        return round(word_error_rate(wav, mp3) * len(words(wav)))

    wav, mp3 = audio_dir / LONG, audio_dir / "flite-longform.mp3"
    ours = apart(transcribe(whisper_server, wav).text, transcribe(whisper_server, mp3).text)
    # On this clip the mp3's coding noise flips "muddle" to "model" twice (the mp3 is right both times);
    # transformers' own long-form generate moves 4 words between the two files.
    theirs = apart(generate_text(whisper_dir, wav), generate_text(whisper_dir, mp3))
    assert ours <= 2 and ours <= theirs, (ours, theirs)


def test_a_disconnect_mid_long_form_frees_its_rows(whisper_server: ServerProcess, audio_dir: Path) -> None:
    clip = (audio_dir / LONG).read_bytes()
    for stream in (False, True):
        try:
            httpx.post(
                f"{whisper_server.base_url}/audio/transcriptions",
                timeout=1.5,
                files={"file": ("long.wav", clip)},
                data={"model": MODEL, "stream": str(stream).lower()},
            )
        except httpx.ReadTimeout:
            pass
        else:
            pytest.fail("the transcription should take longer than the client waits")

        def idle() -> bool:  # the request leaves in_flight first; its rows come free at the engine's next step
            state = whisper_server.engine_state()
            return bool(state["rows_in_use"] == 0 and state["in_flight"] == 0 and state["waiting"] == 0)

        assert wait_for(idle, 10), whisper_server.engine_state()
    assert "client disconnected" in whisper_server.log()


BAD_FIELDS = [
    ({"model": MODEL}, None, 400, "file"),
    ({"model": MODEL, "response_format": "xml"}, b"x", 400, "response_format"),
    ({"model": MODEL, "temperature": "2"}, b"x", 400, "temperature"),
    ({"model": MODEL, "temperature": "nan", "stream": "true"}, b"x", 400, "temperature"),
    ({"model": MODEL, "timestamp_granularities[]": "word"}, b"x", 400, "timestamp_granularities"),
    (
        {"model": MODEL, "timestamp_granularities[]": "char", "response_format": "verbose_json"},
        b"x",
        400,
        "timestamp_granularities[]",
    ),
    ({"model": MODEL, "language": "de"}, b"x", 400, "language"),
    ({"model": "whisper-large"}, b"x", 404, "model"),
    ({"model": MODEL}, b"", 400, "file"),
    ({"model": MODEL}, b"not audio at all" * 100, 400, "file"),
    ({"model": MODEL}, low_rate_wav(), 400, "file"),  # 40 KB at 1 Hz: 1.3 GB once resampled
    ({"model": MODEL}, low_rate_matroska(), 400, "file"),  # 1 MB at 2 Hz: 16 GB once resampled
    ({"model": MODEL}, b"\0" * 3_100_000, 413, None),
]


@pytest.mark.parametrize(("fields", "content", "status", "param"), BAD_FIELDS)
def test_bad_files_and_fields_get_their_4xx(
    whisper_server: ServerProcess, fields: dict[str, Any], content: bytes | None, status: int, param: str | None
) -> None:
    files = None if content is None else {"file": ("clip.wav", content)}
    response = httpx.post(f"{whisper_server.base_url}/audio/transcriptions", data=fields, files=files, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_kinds_refuse_each_others_endpoints(
    whisper_server: ServerProcess, tiny_server: ServerProcess, audio_dir: Path
) -> None:
    with pytest.raises(openai.BadRequestError, match="speech recognition model"):
        sync_client(whisper_server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="cannot translate"), (audio_dir / "flite-s1.wav").open("rb") as f:
        sync_client(whisper_server).audio.translations.create(model=MODEL, file=f)
    with pytest.raises(openai.BadRequestError, match="text model"):
        transcribe(tiny_server, audio_dir / "flite-s1.wav")
    models = sync_client(whisper_server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_count_audio(whisper_server: ServerProcess, audio_dir: Path) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{whisper_server.root_url}/metrics", timeout=10).text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("transformers_openai:") and " " in line
        }

    before = scrape()
    transcribe(whisper_server, audio_dir / "flite-s1.wav")
    after = scrape()

    def value(metrics: dict[str, float], name: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(f"transformers_openai:{name}"))

    assert value(after, "audio_seconds_total") - value(before, "audio_seconds_total") == pytest.approx(2.965, abs=0.01)
    assert value(after, "audio_real_time_factor_count") == value(before, "audio_real_time_factor_count") + 1
    assert value(after, 'requests_total{endpoint="transcriptions"') >= 1 + value(
        before, 'requests_total{endpoint="transcriptions"'
    )


def test_a_full_server_answers_429_and_a_running_long_form_is_never_refused(
    whisper_dir: Path, server_logs: Path, audio_dir: Path
) -> None:
    """One row, no queue: short requests sent while a long-form transcription runs get 429 (with Retry-After) or
    their answer; the long-form one's later windows are admitted even when a short one holds the row."""
    import threading

    from tests.e2e.server import start_server

    server = start_server(whisper_dir, server_logs, "--max-batch-size", "1", "--max-queue", "0")
    try:
        url = f"{server.base_url}/audio/transcriptions"
        events: list[dict[str, Any]] = []
        started = threading.Event()

        def long_form() -> None:
            files = {"file": ("long.wav", (audio_dir / LONG).read_bytes())}
            try:
                with httpx.stream("POST", url, files=files, data={"model": MODEL, "stream": "true"}, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            started.set()  # its first window is done: the short requests start now
            finally:
                started.set()

        runner = threading.Thread(target=long_form)
        runner.start()
        assert started.wait(timeout=120)
        short = {"file": ("s1.wav", (audio_dir / "flite-s1.wav").read_bytes())}
        answers: list[httpx.Response] = []
        while runner.is_alive() and len(answers) < 200:
            answers.append(httpx.post(url, files=short, data={"model": MODEL}, timeout=60))
        runner.join(timeout=300)
        assert events and events[-1]["type"] == "transcript.text.done"
        assert word_error_rate((audio_dir / "longform.txt").read_text(), events[-1]["text"]) <= 0.05
        statuses = {a.status_code for a in answers}
        assert statuses <= {200, 429} and 429 in statuses, statuses
        refused = [a for a in answers if a.status_code == 429]
        assert all(
            int(a.headers["retry-after"]) >= 1 and a.json()["error"]["code"] == "server_overloaded" for a in refused
        )
    finally:
        server.stop()


def test_two_clips_under_one_request_id_each_get_their_own_transcript(
    whisper_server: ServerProcess, audio_dir: Path
) -> None:
    """A client's X-Request-Id names nothing the server keeps: clip B sent with the id clip A was sent with gets
    B's transcript, one after the other or both at once."""
    names = ["flite-s1.wav", "flite-s2.wav"]
    alone = {name: transcribe(whisper_server, audio_dir / name).text for name in names}
    assert alone[names[0]] != alone[names[1]]

    def under_one_id(name: str) -> str:
        response = httpx.post(
            f"{whisper_server.base_url}/audio/transcriptions",
            files={"file": (name, (audio_dir / name).read_bytes())},
            data={"model": MODEL},
            headers={"X-Request-Id": "victim-42"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return str(response.json()["text"])

    assert [under_one_id(name) for name in names] == [alone[name] for name in names]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(under_one_id, names)) == [alone[name] for name in names]


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """Small files that decode or resample to gigabytes: 40 KB of WAV at 1 Hz, 1 MB of Matroska at 2 Hz, a
    two-hour FLAC of silence (180 KB)."""
    return {"1hz.wav": low_rate_wav(), "2hz.mkv": low_rate_matroska(), "two-hours.flac": silent_flac(2 * 3600)}


def _memory_kb(server: ServerProcess, field: str) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field + ":")).split()[1])


def _peak_growth_mb(server: ServerProcess, work: Callable[[], object]) -> float:
    """How far above its resident set the server's peak rose while `work` ran (the peak reset first)."""
    Path(f"/proc/{server.process.pid}/clear_refs").write_text("5")
    before = _memory_kb(server, "VmRSS")
    work()
    return (_memory_kb(server, "VmHWM") - before) / 1024


def _post_bomb(server: ServerProcess, name: str, data: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{server.base_url}/audio/transcriptions", files={"file": (name, data)}, data={"model": MODEL}, timeout=60
    )
    return response, time.monotonic() - started


@pytest.mark.parametrize("name", ["1hz.wav", "2hz.mkv", "two-hours.flac"])
def test_a_decode_bomb_gets_a_400_at_once_and_costs_the_server_no_memory(
    whisper_server: ServerProcess, bombs: dict[str, bytes], name: str
) -> None:
    answers: list[tuple[httpx.Response, float]] = []
    growth = _peak_growth_mb(whisper_server, lambda: answers.append(_post_bomb(whisper_server, name, bombs[name])))
    response, seconds = answers[0]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["code"] in {"invalid_audio", "audio_too_long"}, error
    assert seconds < 1.0 and growth < 50, (seconds, growth)


def test_six_decode_bombs_at_once_cost_the_server_no_memory(
    whisper_server: ServerProcess, bombs: dict[str, bytes]
) -> None:
    sent = list(bombs.items()) * 2
    with concurrent.futures.ThreadPoolExecutor(len(sent)) as pool:
        answers: list[tuple[httpx.Response, float]] = []
        growth = _peak_growth_mb(
            whisper_server, lambda: answers.extend(pool.map(lambda item: _post_bomb(whisper_server, *item), sent))
        )
    assert [response.status_code for response, _ in answers] == [400] * 6
    assert max(seconds for _, seconds in answers) < 1.0 and growth < 50, (answers, growth)
    assert whisper_server.health()["status"] == "ok"
