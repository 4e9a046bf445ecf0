"""`loadtest compare --target llama-server`: llama.cpp's server started per level with as many slots as the level's
concurrency, sent the same exact-length streamed requests, compared level by level; bad flags stop the run early."""

from __future__ import annotations

from pathlib import Path

import pytest
from loadtest import compare


@pytest.fixture
def peer_files(tmp_path: Path) -> tuple[Path, Path]:
    binary, gguf = tmp_path / "llama-server", tmp_path / "smollm2-f32.gguf"
    binary.write_text("")
    gguf.write_text("")
    return binary, gguf


def test_llama_server_gets_a_slot_per_request_of_the_level(peer_files: tuple[Path, Path]) -> None:
    binary, gguf = peer_files
    args = compare.parse_args(
        ["--target", "llama-server", "--endpoint", "chat", "--llama-server", str(binary), "--gguf", str(gguf)]
        + ["--threads", "2", "--llama-arg=--no-mmap", "--model", "/tmp/smollm2"]
    )
    command = compare.target_command(args, "llama-server", 8123, slots=16)
    assert command[:3] == [str(binary), "-m", str(gguf)]
    flags = {flag: command[i + 1] for i, flag in enumerate(command[:-1]) if flag.startswith("--")}
    assert flags["--parallel"] == "16" and flags["--ctx-size"] == str(16 * compare.LLAMA_SLOT_TOKENS)
    assert flags["--threads"] == flags["--threads-batch"] == "2" and flags["--port"] == "8123"
    assert flags["--host"] == "127.0.0.1" and flags["--alias"] == "smollm2"
    assert "--cont-batching" in command and command[-1] == "--no-mmap"
    body = compare.request_body(args, "llama-server", "smollm2", "Hello!")
    assert body["ignore_eos"] is True and body["max_tokens"] == 64 and body["stream"] is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "needs --llama-server and --gguf"),
        (["--llama-server", "/nonexistent/llama-server", "--gguf", "/nonexistent/x.gguf"], "is not a file"),
        (["--endpoint", "transcription", "--llama-server-url", "http://127.0.0.1:9"], "text endpoints only"),
        (["--llama-server-url", "http://10.0.0.1:8080"], "non-loopback"),
    ],
)
def test_llama_server_flags_are_checked_before_anything_runs(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        compare.parse_args(["--target", "llama-server", *extra])
    assert message in capsys.readouterr().err + str(stopped.value.code)


def test_every_level_is_compared_with_llama_server() -> None:
    rows = [
        compare.Row("server", 1, output_tok_s=30.0, ttft_p50_ms=60.0),
        compare.Row("llama-server", 1, output_tok_s=24.0, ttft_p50_ms=80.0),
        compare.Row("server", 16, output_tok_s=200.0, ttft_p50_ms=500.0),
        compare.Row("llama-server", 16, output_tok_s=160.0, ttft_p50_ms=400.0),
    ]
    ratios = compare.ratios(rows, [1, 16])
    assert ratios["server c1 / llama-server c1"] == 1.25 and ratios["server c16 / llama-server c16"] == 1.25
    assert ratios["server c1 TTFT p50 / llama-server's"] == 0.75
    assert ratios["server c16 TTFT p50 / llama-server's"] == 1.25
