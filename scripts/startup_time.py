"""Times a serve script from launch until GET /health answers 200 and until its first chat is answered, then stops
it: how long a (re)start takes. With `--until-compiled`, also how long until the compiled decode step is swapped in
(`/metrics`: decode_step_compiled) and a greedy answer's output tokens/s before and after the swap; with
`--against-eager`, then the compiled server's speed against an eager one's (`--no-cpu-compile`, started beside it),
their chats interleaved.

    python scripts/startup_time.py                              # bash scripts/serve-smollm2.sh, twice
    python scripts/startup_time.py --fresh-store --until-compiled   # a first start with an empty compile store
    python scripts/startup_time.py --runs 3 -- bash scripts/serve-whisper-tiny-en.sh

The first run may set up .venv and convert the model; the runs after it are the restarts a user waits for.
`--fresh-store` gives the runs a new, empty compile store (`--compile-cache-dir`, shared by the runs: the first
compiles, the later ones load). Needs the `loadtest` package (stress-test/, installed into .venv by
`EXTRAS=test scripts/env.sh` or `pip install -e stress-test --no-deps`): its spawner starts the script in a session
of its own, on a free port passed as `--port`, and stops it and everything it started.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from loadtest.server import ServerProcess, free_port, spawn

ROOT = Path(__file__).resolve().parent.parent
GAUGE = "transformers_openai:decode_step_compiled"


def chat(server: ServerProcess, max_tokens: int) -> float:
    """One greedy chat of `max_tokens` tokens; its output tokens/s."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    began = time.monotonic()
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300, trust_env=False)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"]) / (time.monotonic() - began)


def compiled(server: ServerProcess) -> bool:
    text = httpx.get(f"{server.root_url}/metrics", timeout=10, trust_env=False).text
    return any(line.startswith(GAUGE + "{") and float(line.split()[-1]) == 1 for line in text.splitlines())


def speed(server: ServerProcess, repeats: int) -> float:
    """The median output tokens/s of `repeats` greedy 64-token chats, one at a time."""
    return statistics.median(chat(server, 64) for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per start (default: %(default)s)")
    parser.add_argument("--log", type=Path, default=Path("/tmp/startup_time.log"))
    parser.add_argument("--fresh-store", action="store_true", help="the runs share a new, empty compile store")
    parser.add_argument("--until-compiled", action="store_true", help="wait for the compiled step; speed around it")
    parser.add_argument("--repeats", type=int, default=3, help="chats per speed figure (default: %(default)s)")
    parser.add_argument("--against-eager", action="store_true", help="compiled against eager, interleaved")
    parser.add_argument("command", nargs="*", default=["bash", "scripts/serve-smollm2.sh"])
    args = parser.parse_args()
    extra = ["--compile-cache-dir", tempfile.mkdtemp(prefix="startup-time-store-")] if args.fresh_store else []
    for run in range(1, args.runs + 1):
        port = free_port()
        launched = time.monotonic()
        command = [*args.command, "--port", str(port), *extra]
        with spawn(command, port, args.log, cwd=ROOT, timeout_s=args.timeout) as server:
            health = server.startup_s
            chat(server, 16)
            first = time.monotonic() - launched
            print(f"start {run}: /health 200 after {health:.1f} s, first chat answered after {first:.1f} s", flush=True)
            if not args.until_compiled:
                continue
            if compiled(server):  # a stored step, swapped in before the first chat
                print(f"start {run}: compiled step in use at the first chat", flush=True)
                if args.against_eager:
                    against_eager(server, [*args.command, *extra], args)
                continue
            before = speed(server, args.repeats)
            while not compiled(server):
                if time.monotonic() - launched > args.timeout:
                    print(f"start {run}: no compiled step after {args.timeout:.0f} s", flush=True)
                    break
                chat(server, 2)  # the swap happens between two engine steps
                time.sleep(2)
            else:
                swapped = time.monotonic() - launched
                after = speed(server, args.repeats)
                print(
                    f"start {run}: compiled step in use after {swapped:.1f} s; output tok/s at one stream "
                    f"{before:.1f} before the swap, {after:.1f} after ({after / before:.2f}x)",
                    flush=True,
                )
                if args.against_eager:
                    against_eager(server, [*args.command, *extra], args)
    return 0


def against_eager(compiled_server: ServerProcess, command: list[str], args: argparse.Namespace) -> None:
    """The compiled server's output tokens/s at one stream against an eager server's, chats interleaved."""
    port = free_port()
    eager_command = [*command, "--port", str(port), "--no-cpu-compile"]
    with spawn(eager_command, port, args.log, cwd=ROOT, timeout_s=args.timeout) as eager:
        chat(eager, 16)
        speeds: dict[str, list[float]] = {"compiled": [], "eager": []}
        for _ in range(args.repeats):
            speeds["eager"].append(chat(eager, 64))
            speeds["compiled"].append(chat(compiled_server, 64))
    both = {name: statistics.median(values) for name, values in speeds.items()}
    print(
        f"interleaved, output tok/s at one stream: compiled {both['compiled']:.1f}, eager {both['eager']:.1f} "
        f"({both['compiled'] / both['eager']:.2f}x; each {speeds})",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
