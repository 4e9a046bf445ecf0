"""The stress-test tools: statistics on synthetic records, SSE parsing, and a short real run on the tiny Llama."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from loadtest import compare, loadclient, loadgen, loadlevels, loadstats, plot, server
from loadtest.loadstats import RequestRecord

LEVEL_KEYS = {
    "mode", "load", "requests", "ok", "failed", "rejected_429", "errors", "wall_s", "output_tokens",
    "output_tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "stopped_by",
}  # fmt: skip


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert loadstats.percentile(values, 0) == 1.0
    assert loadstats.percentile(values, 50) == 3.0
    assert loadstats.percentile(values, 100) == 5.0
    assert loadstats.percentile(values, 90) == pytest.approx(4.6)
    assert loadstats.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert loadstats.percentile([7.0], 99) == 7.0
    assert loadstats.percentile([], 50) is None
    with pytest.raises(ValueError):
        loadstats.percentile([1.0], 101)


def test_distribution_is_in_milliseconds() -> None:
    dist = loadstats.distribution_ms([0.1, 0.2, 0.3])
    assert dist == {"p50": 200.0, "p90": 280.0, "p99": 298.0, "mean": 200.0, "max": 300.0, "n": 3}
    assert loadstats.distribution_ms([])["p50"] is None


def synthetic_level() -> list[RequestRecord]:
    ok = [
        RequestRecord("ok", start_s=i, e2e_s=1.0, ttft_s=0.1 * (i + 1), itl_s=[0.05] * 9, output_tokens=10)
        for i in range(4)
    ]
    failed = [
        RequestRecord("http_429", start_s=1.5, e2e_s=0.01, detail="busy", retry_after_s=1.0),
        RequestRecord("http_429", start_s=2.5, e2e_s=0.01, retry_after_s=2.0),
        RequestRecord("timeout", start_s=3.0, e2e_s=2.0),
    ]
    return ok + failed


def test_summarize_level_counts_throughput_and_errors() -> None:
    summary = loadstats.summarize_level("concurrency", 4, synthetic_level(), stopped_by="duration")
    assert summary.keys() >= LEVEL_KEYS
    assert (summary["requests"], summary["ok"], summary["failed"]) == (7, 4, 3)
    assert summary["errors"] == {"http_429": 2, "timeout": 1}
    assert summary["rejected_429"] == 2 and summary["retry_after_s_max"] == 2.0
    assert summary["first_error"] == "http_429: busy"
    assert summary["wall_s"] == 5.0  # the timeout started at 3 s and lasted 2 s
    assert summary["output_tokens"] == 40
    assert summary["output_tokens_per_s"] == 8.0 and summary["requests_per_s"] == 0.8
    assert summary["ttft_ms"]["p50"] == 250.0 and summary["ttft_ms"]["n"] == 4  # failures are left out
    assert summary["itl_ms"]["p99"] == 50.0 and summary["itl_ms"]["n"] == 36
    assert summary["tpot_ms"]["max"] == pytest.approx(100.0)  # (1.0 - 0.1) / 9
    assert summary["e2e_ms"]["p90"] == 1000.0


def test_summarize_empty_level() -> None:
    summary = loadstats.summarize_level("rate", 0.5, [])
    assert summary["requests"] == 0 and summary["output_tokens_per_s"] is None and summary["e2e_ms"]["n"] == 0
    assert "| 0.5 | 0 | 0 | - |" in loadstats.markdown_table([summary])


def test_compare_ratios_name_only_what_the_rows_allow() -> None:
    rows = [
        compare.Row("server", 16, output_tok_s=120.0, ttft_max_ms=900.0),
        compare.Row("baseline", 16, output_tok_s=80.0, ttft_max_ms=3000.0),
        compare.Row("transformers-serve", 16, note="unavailable"),
    ]
    # One level: no level against itself; the baseline is compared, a target without figures is not.
    assert compare.ratios(rows, [16]) == {
        "server c16 / baseline c16": 1.5,
        "server c16 slowest first token / baseline's": 0.3,
    }
    rows += [compare.Row("server", 1, output_tok_s=20.0), compare.Row("generate-loop", 1, output_tok_s=16.0)]
    assert compare.ratios(rows, [1, 16]) == {
        "server c16 / server c1": 6.0,
        "server c16 / generate-loop": 7.5,
        "baseline c16 / generate-loop": 5.0,
        "server c16 / baseline c16": 1.5,
        "server c16 slowest first token / baseline's": 0.3,
    }


def test_stream_timer_parses_sse() -> None:
    timer = loadclient.StreamTimer(start=0.0, chat=True)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    lines = [f"data: {json.dumps(role)}", ""]
    lines += [f"data: {json.dumps({'choices': [{'delta': {'content': w}}]})}" for w in ("a", "b", "c")]
    lines += ['data: {"choices": [], "usage": {"completion_tokens": 4}}', ": keep-alive comment", "data: [DONE]"]
    fed = [timer.feed(line) for line in lines]
    assert fed.index(False) == len(lines) - 1  # the stream ends at [DONE]
    record = timer.record(end=timer.stamps[-1] + 0.5)
    assert record.ok and record.output_tokens == 4 and len(record.itl_s) == 2 and record.ttft_s is not None
    error = loadclient.StreamTimer(start=0.0, chat=False)
    assert error.feed('data: {"error": {"message": "boom"}}') is False
    assert error.record(end=1.0).status == "stream_error"
    assert loadclient.StreamTimer(start=0.0, chat=False).record(end=1.0).status == "empty"


def test_request_bodies_per_workload() -> None:
    chat = loadclient.request_body(loadclient.RequestSpec("chat-stream", "m", 8), "hi")
    assert chat["stream"] and chat["messages"][0]["content"] == "hi" and chat["ignore_eos"] is True
    plain = loadclient.RequestSpec("chat", "m", 8, ignore_eos=False)
    assert "stream" not in loadclient.request_body(plain, "hi") and plain.path == "/v1/chat/completions"
    comp = loadclient.RequestSpec("completions", "m", 8)
    assert loadclient.request_body(comp, "hi")["prompt"] == "hi" and comp.path == "/v1/completions"


async def test_models_go_round_robin_over_the_requests() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["model"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 1}})

    spec = loadclient.RequestSpec("chat", "base", 1, models=("a", "b", "c"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        run = loadlevels.LevelRun(client, "http://fake", spec, 5.0, time.perf_counter() + 30, 5)
        for _ in range(5):
            await run.issue()
    assert seen == ["a", "b", "c", "a", "b"]
    assert loadgen.parse_args(["--concurrency", "1", "--url", "http://127.0.0.1:1", "--models", "a,b"]).models == [
        "a",
        "b",
    ]


def fake_server(reject_every: int = 0) -> httpx.MockTransport:
    """Streams three words and a usage chunk; every `reject_every`-th request gets a 429 instead."""
    counter = itertools.count(1)

    def handle(request: httpx.Request) -> httpx.Response:
        if reject_every and next(counter) % reject_every == 0:
            return httpx.Response(429, headers={"Retry-After": "0.01"}, json={"error": {"message": "busy"}})
        chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"content": w}}]} for w in ("one", " two", " three")]
        chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def level_run(client: httpx.AsyncClient, seconds: float, max_requests: int) -> loadlevels.LevelRun:
    spec = loadclient.RequestSpec("chat-stream", "m", 3)
    return loadlevels.LevelRun(client, "http://fake", spec, 5.0, time.perf_counter() + seconds, max_requests)


async def test_open_loop_stops_at_max_requests_and_counts_429s() -> None:
    async with httpx.AsyncClient(transport=fake_server(reject_every=4)) as client:
        run = level_run(client, seconds=5.0, max_requests=20)
        await loadlevels.open_loop(run, rate=500.0, rng=random.Random(1), max_in_flight=100)
    summary = loadstats.summarize_level("rate", 500.0, run.records, run.issue_window_s(), run.stopped_by(1e18))
    assert summary["requests"] == 20 and summary["stopped_by"] == "max_requests"
    assert summary["rejected_429"] == 5 and summary["ok"] == 15 and summary["retry_after_s_max"] == 0.01
    assert summary["output_tokens"] == 45 and summary["itl_ms"]["n"] == 30


async def test_closed_loop_stops_after_duration() -> None:
    async with httpx.AsyncClient(transport=fake_server()) as client:
        run = level_run(client, seconds=0.3, max_requests=10_000)
        started = time.perf_counter()
        await loadlevels.closed_loop(run, concurrency=3, backoff_cap_s=1.0)
    assert time.perf_counter() - started < 2.0
    assert run.records and all(r.ok for r in run.records) and run.stopped_by(1e18) == "duration"
    assert run.in_flight == 0 and run.issued == len(run.records)


def test_only_loopback_urls_without_allow_remote(capsys: pytest.CaptureFixture[str]) -> None:
    assert server.is_loopback("http://127.0.0.1:7088") and server.is_loopback("http://localhost:1")
    assert server.is_loopback("http://[::1]:7088") and not server.is_loopback("http://10.0.0.1:7088")
    with pytest.raises(SystemExit):
        loadgen.parse_args(["--rate", "1", "--url", "http://gpu-host:7088"])
    assert "--allow-remote" in capsys.readouterr().err
    args = loadgen.parse_args(["--rates", "1,2", "--url", "http://gpu-host:7088/v1", "--allow-remote"])
    assert (args.mode, args.levels, args.url) == ("rate", [1.0, 2.0], "http://gpu-host:7088")


@pytest.mark.e2e
def test_short_real_run_and_plots(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "loadtest", "run", "--model", str(tiny_llama_dir), "--concurrencies", "1,3"]
    cmd += ["--duration", "3", "--max-tokens", "8", "--torch-threads", "1", "--time-limit", "60"]
    cmd += ["--request-timeout", "20", "--out", str(out), "--raw-out", str(tmp_path / "raw.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["mode"] == "concurrency" and summary["server"]["version"].endswith("0.1.0")
    assert summary["machine"]["cpu_count"] and summary["machine"]["server_torch_threads"] == 1
    assert summary["config"]["max_tokens"] == 8
    assert [level["load"] for level in summary["levels"]] == [1, 3]
    for level in summary["levels"]:
        assert level.keys() >= LEVEL_KEYS
        assert level["failed"] == 0 and level["errors"] == {} and level["ok"] >= 3
        assert level["output_tokens_per_request_mean"] == 8  # ignore_eos: exactly max_tokens
        assert level["ttft_ms"]["p50"] > 0 and level["e2e_ms"]["p99"] >= level["e2e_ms"]["p50"]
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert len(raw["levels"][1]["requests"]) == summary["levels"][1]["requests"]
    pngs = plot.main([str(out), "--out-dir", str(tmp_path / "png")])
    assert pngs == 0
    written = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert written == ["latency-concurrency.png", "throughput-concurrency.png"]
    assert all((tmp_path / "png" / name).stat().st_size > 10_000 for name in written)


async def test_transcription_workload_uploads_each_clip_and_counts_audio_seconds() -> None:
    """The transcription workload sends multipart uploads in turn and reads OpenAI's transcript events."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = request.read()
        assert request.url.path == "/v1/audio/transcriptions"
        assert request.headers["content-type"].startswith("multipart/form-data") and b'name="stream"' in body
        seen.append(next(name for name in ("a.wav", "b.mp3") if name.encode() in body))
        events = [
            {"type": "transcript.text.delta", "delta": "Hello"},
            {"type": "transcript.text.delta", "delta": " you"},
            {"type": "transcript.text.done", "text": "Hello you", "usage": {"type": "duration", "seconds": 3}},
        ]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    clips = (loadclient.Clip("a.wav", b"RIFF", 2.5), loadclient.Clip("b.mp3", b"ID3", 30.0))
    spec = loadclient.RequestSpec("transcription", "m", 0, clips=clips)
    assert spec.prompts == ("a.wav", "b.mp3")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        run = loadlevels.LevelRun(client, "http://fake", spec, 5.0, time.perf_counter() + 5.0, 4)
        await loadlevels.closed_loop(run, concurrency=1, backoff_cap_s=1.0)
    assert sorted(seen) == ["a.wav", "a.wav", "b.mp3", "b.mp3"]
    summary = loadstats.summarize_level("concurrency", 1.0, run.records, run.issue_window_s(), run.stopped_by(1e18))
    assert summary["ok"] == 4 and summary["ttft_ms"]["n"] == 4 and summary["itl_ms"]["n"] == 4
    assert summary["audio_seconds_per_s"] == round(65.0 / loadstats.level_wall_s(run.records), 3)


async def test_embeddings_workload_sends_one_text_and_counts_vectors() -> None:
    sent: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append({"path": request.url.path, **body})
        data = [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}]
        return httpx.Response(200, json={"object": "list", "data": data, "usage": {"prompt_tokens": 3}})

    spec = loadclient.RequestSpec("embeddings", "m", max_tokens=0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        record = await loadclient.send(client, "http://test", spec, spec.prompts[3], 5.0)
    assert record.ok and record.output_tokens == 1
    assert sent == [{"path": "/v1/embeddings", "model": "m", "input": loadclient.EMBEDDING_TEXTS[3]}]
    assert len({len(text.split()) for text in spec.prompts}) > 8  # lengths from a few words to a paragraph


def test_embeddings_bench_short_run(tiny_bert_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "embeddings.json"
    cmd = [sys.executable, "-m", "loadtest", "embeddings", "--model", str(tiny_bert_dir), "--threads", "1"]
    cmd += ["--rounds", "1", "--requests-c1", "4", "--requests-c16", "32", "--out", str(out)]
    cmd += ["--log", str(tmp_path / "server.log")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    targets = {"server_c1", "server_c16", "st_encode_batched", "st_encode_one_by_one"}
    assert report["rounds"][0].keys() == targets and all(report["median"][key] > 0 for key in targets)
    assert report["machine"]["server_torch_threads"] == 1
