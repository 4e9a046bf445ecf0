"""Realtime transcription sessions: how many live microphones one server keeps up with.

Each session is a WebSocket to `/v1/realtime?intent=transcription` (server VAD, its defaults) that speaks the
recorded clips of `--audio-dir` one after another at real-time pace, in 100 ms chunks of PCM16 at 24 kHz, with a
second of silence after each; sessions start at staggered offsets so their turns end at different times, as real
speakers' do. A turn's latency is the time from the `speech_stopped` event (the server saw the turn end) to its
`.completed` transcript, and also from the moment the client sent the end of the clip's audio (which adds VAD's
`silence_duration_ms`). Levels of concurrency run one after another on one server; a level is sustained when the
95th percentile of its turns' latency (after `speech_stopped`) stays within `--budget` (1.5 s).

    OMP_NUM_THREADS=2 loadtest realtime --model .cache/models/whisper-tiny-en --levels 1,2,4,8,12,16 --seconds 30

The client runs on the same machine as the server (its share of the CPU is small: it only sends and receives).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import soxr

from loadtest.server import ServerOptions, local_server, runs_compiled, wait_compiled

RATE = 24000
CHUNK_MS = 100
GAP_S = 1.0


def pcm24k(path: Path) -> bytes:
    """A clip as the realtime API takes it by default: mono PCM16 at 24 kHz, little-endian."""
    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if rate != RATE:
        mono = soxr.resample(mono, rate, RATE, "HQ")
    return (np.clip(mono, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def silence(seconds: float) -> bytes:
    return bytes(2 * int(seconds * RATE))


@dataclass
class Turn:
    item_id: str
    start_ms: int | None = None  # where VAD heard speech start, in the session's audio
    end_ms: int | None = None  # and stop
    stopped_at: float | None = None  # when speech_stopped came
    deltas: list[str] = field(default_factory=list)
    first_delta_at: float | None = None
    completed_at: float | None = None
    transcript: str | None = None


@dataclass
class SessionLog:
    """What one session saw: its turns in order, every event, and when each clip's audio had all been sent."""

    turns: list[Turn] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    clip_ends: list[float] = field(default_factory=list)

    def turn(self, item_id: str) -> Turn:
        for turn in self.turns:
            if turn.item_id == item_id:
                return turn
        self.turns.append(Turn(item_id))
        return self.turns[-1]


async def speak(
    url: str,
    clips: Sequence[bytes],
    *,
    pace: float = 1.0,
    lead_s: float = 0.5,
    headers: dict[str, str] | None = None,
    log: SessionLog | None = None,
    expect_turns: int | None = None,
    timeout_s: float = 60.0,
) -> SessionLog:
    """Speaks `clips` into one session (`pace` 1: real time; 2: twice as fast), each followed by silence, and
    returns once `expect_turns` turns (default: one per clip) are completed or failed."""
    import websockets

    log = log or SessionLog()
    wanted = len(clips) if expect_turns is None else expect_turns
    async with websockets.connect(url, additional_headers=headers or {}, max_size=None) as ws:
        done = asyncio.Event()
        reader = asyncio.create_task(_read(ws, log, wanted, done))
        try:
            await _send_audio(ws, clips, pace, lead_s, log)
            await asyncio.wait_for(done.wait(), timeout_s)
        finally:
            reader.cancel()
    return log


async def _send_audio(ws: Any, clips: Sequence[bytes], pace: float, lead_s: float, log: SessionLog) -> None:
    chunk = 2 * RATE * CHUNK_MS // 1000
    started = time.monotonic()
    sent_s = 0.0
    for index, clip in enumerate(clips):
        audio = (silence(lead_s) if index == 0 else b"") + clip
        for part in (audio, silence(GAP_S)):
            for at in range(0, len(part), chunk):
                piece = part[at : at + chunk]
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()})
                )
                sent_s += len(piece) / 2 / RATE
                if pace > 0:
                    await asyncio.sleep(max(0.0, started + sent_s / pace - time.monotonic()))
            if part is audio:
                log.clip_ends.append(time.monotonic())


async def _read(ws: Any, log: SessionLog, wanted: int, done: asyncio.Event) -> None:
    finished = 0
    async for message in ws:
        event = json.loads(message)
        now = time.monotonic()
        log.events.append(event)
        kind = event["type"]
        if kind == "input_audio_buffer.speech_started":
            log.turn(event["item_id"]).start_ms = event["audio_start_ms"]
        elif kind == "input_audio_buffer.speech_stopped":
            turn = log.turn(event["item_id"])
            turn.stopped_at, turn.end_ms = now, event["audio_end_ms"]
        elif kind == "conversation.item.input_audio_transcription.delta":
            turn = log.turn(event["item_id"])
            turn.deltas.append(event["delta"])
            turn.first_delta_at = turn.first_delta_at or now
        elif kind.startswith("conversation.item.input_audio_transcription.") and kind.rsplit(".", 1)[1] in (
            "completed",
            "failed",
        ):
            turn = log.turn(event["item_id"])
            turn.completed_at = now
            turn.transcript = event.get("transcript")
            finished += 1
            if finished >= wanted:
                done.set()


@dataclass
class LevelResult:
    sessions: int
    turns: int
    failed: int
    after_stop: list[float]  # seconds from speech_stopped to completed, per turn
    after_audio: list[float]  # seconds from the clip's last audio sent to completed

    def summary(self, budget: float) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

        p95 = pct(self.after_stop, 0.95)
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "failed": self.failed,
            "after_stop_p50_s": pct(self.after_stop, 0.5),
            "after_stop_p95_s": p95,
            "after_stop_max_s": pct(self.after_stop, 1.0),
            "after_audio_p50_s": pct(self.after_audio, 0.5),
            "after_audio_p95_s": pct(self.after_audio, 0.95),
            "sustained": self.failed == 0 and p95 is not None and p95 <= budget,
        }


async def run_level(url: str, clips: list[bytes], sessions: int, seconds: float) -> LevelResult:
    """`sessions` sessions at once, each speaking clips in turn (a different first clip each) for `seconds`."""
    clip_s = [len(clip) / 2 / RATE for clip in clips]
    logs = [SessionLog() for _ in range(sessions)]
    plans = []
    for index in range(sessions):
        order: list[bytes] = []
        spoken = 0.0
        while spoken < seconds:
            pick = (index + len(order)) % len(clips)
            order.append(clips[pick])
            spoken += clip_s[pick] + GAP_S
        lead = 0.2 + (index / max(1, sessions)) * (statistics.mean(clip_s) + GAP_S)  # staggered turn ends
        plans.append(speak(url, order, lead_s=lead, log=logs[index], timeout_s=seconds + 60))
    await asyncio.gather(*plans)
    after_stop, after_audio, failed, turns = [], [], 0, 0
    for log in logs:
        for turn, clip_end in zip(log.turns, log.clip_ends, strict=False):
            turns += 1
            if turn.transcript is None or turn.completed_at is None:
                failed += 1
                continue
            if turn.stopped_at is not None:
                after_stop.append(turn.completed_at - turn.stopped_at)
            after_audio.append(turn.completed_at - clip_end)
    return LevelResult(sessions, turns, failed, after_stop, after_audio)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model to serve (spawns our server); or give --url")
    parser.add_argument("--url", help="a running server's root URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--audio-dir", type=Path, default=Path("tests/data/audio"))
    parser.add_argument("--clips", default="flite-s1.wav,flite-s2.wav,flite-s3.wav,flite-s4.wav")
    parser.add_argument("--levels", default="1,2,4,8,12,16", help="sessions at once, one level after another")
    parser.add_argument("--seconds", type=float, default=30.0, help="audio each session speaks per level")
    parser.add_argument("--budget", type=float, default=1.5, help="p95 latency after the turn ends, seconds")
    parser.add_argument(
        "--saturated", type=float, default=10.0, help="stop the sweep after a level whose p50 passes this (seconds)"
    )
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument(
        "--wait-compiled-s",
        type=float,
        default=1800,
        help="wait at most this long while the server compiles its decode step (default: %(default)s)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra server option (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    return parser.parse_args(argv)


async def _levels(root_url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    await asyncio.to_thread(wait_compiled, root_url, args.wait_compiled_s)
    url = root_url.replace("http://", "ws://", 1) + "/v1/realtime?intent=transcription"
    clips = [pcm24k(args.audio_dir / name) for name in args.clips.split(",")]
    await speak(url, clips[:1], pace=0)  # warm-up: the first turn loads decoders and the resampler
    compiled = runs_compiled(root_url)
    print(json.dumps({"decode_step_compiled": compiled}), flush=True)
    results: list[dict[str, Any]] = []
    for level in (int(value) for value in args.levels.split(",")):
        summary = (await run_level(url, clips, level, args.seconds)).summary(args.budget)
        print(json.dumps(summary), flush=True)
        results.append(summary)
        write_summary(args, results, compiled)
        if (summary["after_stop_p50_s"] or 0) > args.saturated:
            break  # a backlog: the turns of more sessions only wait longer
    return results


def write_summary(args: argparse.Namespace, results: list[dict[str, Any]], compiled: bool) -> dict[str, Any]:
    """The sweep so far, written to `--out` after each level (a long sweep stopped early keeps its levels)."""
    sustained = [r["sessions"] for r in results if r["sustained"]]
    summary = {
        "budget_s": args.budget,
        "decode_step_compiled": compiled,
        "levels": results,
        "most_sustained": max(sustained, default=0),
        "seconds_per_session": args.seconds,
        "clips": args.clips,
        "date": date.today().isoformat(),
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        results = asyncio.run(_levels(args.url.rstrip("/"), args))
    else:
        if args.model is None:
            raise SystemExit("loadtest realtime: give --model or --url")
        extra = ["--max-batch-size", "32", "--max-realtime-sessions", "64", *args.server_arg]
        opts = ServerOptions(args.model, Path("stress-test/results/realtime-server.log"), args.torch_threads, extra)
        with local_server(opts) as root_url:
            results = asyncio.run(_levels(root_url, args))
    sustained = [r["sessions"] for r in results if r["sustained"]]
    print(json.dumps({"most_sustained": max(sustained, default=0), "budget_s": args.budget}))
    return 0
