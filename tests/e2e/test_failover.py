"""Failover behind the real HAProxy with deploy/haproxy.cfg as it is (only its addresses and check intervals set
through the environment): two replicas of the tiny model, 20 streaming clients for 16 s, one replica signalled
after 6. SIGTERM: no client sees an error, the drained replica exits 0 and takes no new request. SIGKILL: only the
streams running on it fail. With hashing on, one X-Session-ID stays on one replica."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import REPO, ServerProcess, free_port, replicas_of, wait_for

HAPROXY = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin"))
pytestmark = [
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (scripts/test.sh installs Debian's package)"),
]

CONFIG = REPO / "deploy" / "haproxy.cfg"
NAMES = ("replica1", "replica2")  # the config's server names; each replica reports the same as X-Replica-Id
CLIENTS = 20
# Hundreds of streams before the signal and 10 s of load after it: with the config's default checks (every 2 s, then
# 500 ms, two failures) HAProxy takes a draining replica out within about 3 s of its signal.
LOAD_S = 16.0
SIGNAL_AT_S = 6.0
BODY = {"model": "test-model", "prompt": "go", "max_tokens": 24, "ignore_eos": True, "stream": True}
# Faster checks than the config's defaults (2s, 500ms, 5s), so a killed replica is out within a second (fall 2: two
# failed checks). The SIGTERM test keeps the defaults: the draining replica then refuses requests with 503 for half a
# second or more before HAProxy takes it out, and those must be retried on the other one.
FAST_CHECKS = {"CHECK_INTER": "500ms", "CHECK_FASTINTER": "200ms", "CHECK_DOWNINTER": "1s"}


@dataclass
class Balancer:
    process: subprocess.Popen[bytes]
    port: int
    stats_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def servers(self) -> dict[str, dict[str, str]]:
        """The backend's rows of HAProxy's CSV stats, by server name (status, stot, hrsp_5xx, wretr, wredis...)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "replicas"}

    def status(self, name: str) -> str:
        return self.servers()[name]["status"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def start_balancer(replicas: dict[str, ServerProcess], log_dir: Path, balance: str, checks: dict[str, str]) -> Balancer:
    port, stats_port = free_port(), free_port()
    env = {
        **os.environ,
        **checks,
        "REPLICA_1": f"127.0.0.1:{replicas[NAMES[0]].port}",
        "REPLICA_2": f"127.0.0.1:{replicas[NAMES[1]].port}",
        "LB_BIND": f"127.0.0.1:{port}",
        "STATS_BIND": f"127.0.0.1:{stats_port}",
        "LB_BALANCE": balance,
    }
    log_path = log_dir / f"haproxy-{port}.log"
    assert HAPROXY is not None
    with log_path.open("wb") as log:
        process = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], stdout=log, stderr=subprocess.STDOUT, env=env)
    balancer = Balancer(process, port, stats_port, log_path)

    def both_up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"haproxy exited with {process.returncode}:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            return all(balancer.status(name) == "UP" for name in NAMES)
        return False

    if not wait_for(both_up, 30):
        balancer.stop()
        raise RuntimeError(f"haproxy did not see both replicas up:\n{log_path.read_text()}")
    return balancer


@contextlib.contextmanager
def cluster(
    model: Path, log_dir: Path, balance: str = "leastconn", checks: dict[str, str] = FAST_CHECKS
) -> Iterator[tuple[dict[str, ServerProcess], Balancer]]:
    with replicas_of(model, log_dir, NAMES, "--max-batch-size", "16", "--max-queue", "64") as replicas:
        balancer = start_balancer(replicas, log_dir, balance, checks)
        try:
            yield replicas, balancer
        finally:
            balancer.stop()


# ----------------------------------------------------------------------------------------------------- clients


@dataclass
class Outcome:
    started: float
    ended: float
    replica: str | None
    error: str | None


async def stream_once(client: httpx.AsyncClient) -> Outcome:
    """One streaming completion; an error unless it ran to `finish_reason: length` and `data: [DONE]`."""
    started, replica, error = time.monotonic(), None, None
    try:
        async with client.stream("POST", "/v1/completions", json=BODY) as response:
            replica = response.headers.get("x-replica-id")
            if response.status_code != 200:
                error = f"status {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                finish, done = None, False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
                if not done or finish != "length":
                    error = f"incomplete stream (finish_reason {finish}, [DONE] {done})"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Outcome(started, time.monotonic(), replica, error)


@dataclass
class Load:
    """CLIENTS clients, each sending one streaming request after another for LOAD_S seconds, in a thread."""

    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))
        self.thread.start()

    def join(self) -> list[Outcome]:
        assert self.thread is not None
        self.thread.join(timeout=LOAD_S + 120)
        assert not self.thread.is_alive(), "the clients did not finish"
        return self.outcomes

    async def _run(self) -> None:
        deadline = time.monotonic() + LOAD_S
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as client:

            async def loop() -> None:
                while time.monotonic() < deadline:
                    self.outcomes.append(await stream_once(client))

            await asyncio.gather(*(loop() for _ in range(CLIENTS)))


def per_replica(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter(outcome.replica or "none" for outcome in outcomes))


def wait_down(balancer: Balancer, name: str) -> float:
    assert wait_for(lambda: balancer.status(name).startswith("DOWN"), 30), balancer.servers()[name]
    return time.monotonic()


# ------------------------------------------------------------------------------------------------------- tests


def test_sigterm_drains_one_replica_without_a_client_error(tiny_llama_dir: Path, server_logs: Path) -> None:
    with cluster(tiny_llama_dir, server_logs, checks={}) as (replicas, balancer):
        victim = replicas[NAMES[0]]
        load = Load(balancer.url)
        load.start()
        time.sleep(SIGNAL_AT_S)
        signalled = time.monotonic()
        victim.process.send_signal(signal.SIGTERM)
        down = wait_down(balancer, NAMES[0])
        sessions_when_down = balancer.servers()[NAMES[0]]["stot"]
        exit_code = victim.process.wait(timeout=60)
        exited = time.monotonic()
        outcomes = load.join()
        final = balancer.servers()

    errors = [outcome for outcome in outcomes if outcome.error]
    on_victim = [outcome for outcome in outcomes if outcome.replica == NAMES[0]]
    drained = [outcome for outcome in on_victim if outcome.started < signalled < outcome.ended]
    print(
        f"\nSIGTERM: {len(outcomes)} streams, {len(errors)} errors, per replica {per_replica(outcomes)}; "
        f"{len(drained)} streams finished on {NAMES[0]} after its signal; out of the balancer "
        f"{down - signalled:.2f}s after the signal, exit {exit_code} {exited - signalled:.2f}s after it; "
        f"HAProxy retried {final['BACKEND']['wretr']} requests and redispatched {final['BACKEND']['wredis']} "
        f"(503 from the draining replica before its check failed)"
    )
    assert not errors, errors[:5]
    assert exit_code == 0, victim.log()[-2000:]
    assert drained, "no stream was running on the replica when it was signalled"
    # It answered no request that began after its signal (it refused them with 503; HAProxy sent them elsewhere),
    # and once HAProxy had taken it out, HAProxy sent it nothing at all.
    assert not [outcome for outcome in on_victim if outcome.started > signalled]
    assert final[NAMES[0]]["stot"] == sessions_when_down
    # HAProxy counts a retry that goes to another replica (`option redispatch`) as a redispatch, not a retry.
    met_503 = int(final["BACKEND"]["wretr"]) + int(final["BACKEND"]["wredis"])
    assert met_503 > 0, "no request met the draining replica's 503 (nothing was retried or redispatched)"
    assert final[NAMES[1]]["status"] == "UP"


def test_sigkill_fails_only_the_streams_running_on_the_killed_replica(tiny_llama_dir: Path, server_logs: Path) -> None:
    with cluster(tiny_llama_dir, server_logs) as (replicas, balancer):
        victim = replicas[NAMES[0]]
        load = Load(balancer.url)
        load.start()
        time.sleep(SIGNAL_AT_S)
        killed = time.monotonic()
        victim.process.kill()
        down = wait_down(balancer, NAMES[0])
        outcomes = load.join()

    errors = [outcome for outcome in outcomes if outcome.error]
    before_down = [outcome for outcome in outcomes if killed <= outcome.started < down]
    after_down = [outcome for outcome in outcomes if outcome.started >= down]
    print(
        f"\nSIGKILL: {len(outcomes)} streams, per replica {per_replica(outcomes)}; {len(errors)} failed, all cut "
        f"on {NAMES[0]}; out of the balancer {down - killed:.2f}s after the kill; sent in between: "
        f"{len(before_down)} ({sum(1 for o in before_down if o.error)} failed); sent after: {len(after_down)} "
        f"({sum(1 for o in after_down if o.error)} failed)"
    )
    stray = [outcome for outcome in errors if outcome.replica != NAMES[0] or outcome.started >= killed]
    assert not stray, stray[:5]
    assert not [outcome for outcome in after_down if outcome.error]
    assert len(after_down) >= CLIENTS, "the load went on after the replica was out"


def replica_of(client: httpx.Client, headers: dict[str, str]) -> str:
    """Which replica answered a short non-streaming completion."""
    response = client.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 2}, headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-replica-id"]


def test_session_header_keeps_a_session_on_one_replica(tiny_llama_dir: Path, server_logs: Path) -> None:
    with (
        cluster(tiny_llama_dir, server_logs, balance="hdr(X-Session-ID)") as (_, balancer),
        httpx.Client(base_url=balancer.url, timeout=60) as client,
    ):
        ids = [f"session-{n}" for n in range(16)]
        sessions = {id_: {replica_of(client, {"X-Session-ID": id_}) for _ in range(5)} for id_ in ids}
        without = Counter(replica_of(client, {}) for _ in range(8))
    print(f"\nhashing: replica per session {sessions}; without the header {dict(without)}")
    assert all(len(replicas) == 1 for replicas in sessions.values()), sessions
    assert set().union(*sessions.values()) == set(NAMES), "16 sessions all hashed onto one replica"
    assert set(without) == set(NAMES), "without the header, requests go round robin"
