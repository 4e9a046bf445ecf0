"""The store a self-launched tensor-parallel server meets at listens on 127.0.0.1 alone, on the port its ranks are
told, and serves them (`parallel/rendezvous.py`)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import PrefixStore, TCPStore

from tests.listening_sockets import ANY_ADDRESS, listening
from transformers_openai.parallel.leader import Leader
from transformers_openai.parallel.rendezvous import ENV_STORE_PREFIX, LOOPBACK, LoopbackRendezvous

WAIT = timedelta(seconds=20)  # a key looked for under another name fails the test, rather than hanging it
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads /proc (Linux)")


def test_the_ranks_are_sent_to_loopback() -> None:
    rendezvous = LoopbackRendezvous()
    env = rendezvous.env(3)
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous.port), "WORLD_SIZE": "3"}
    # Reserved from the start: bound and listening before any rank is started, on loopback only.
    assert (LOOPBACK, rendezvous.port) in listening(os.getpid())
    rendezvous.store(1)


def test_the_store_listens_on_loopback_alone_and_serves_the_other_ranks() -> None:
    rendezvous = LoopbackRendezvous()
    before = listening(os.getpid())
    got: list[bytes] = []

    def other_rank() -> None:  # connects and keys its store as init_process_group's env:// does in ranks 1..N-1
        client = PrefixStore(ENV_STORE_PREFIX, TCPStore(LOOPBACK, rendezvous.port, 2, False, WAIT))
        got.append(client.get("hello"))

    thread = threading.Thread(target=other_rank, daemon=True)
    thread.start()
    store = rendezvous.store(2, WAIT)  # waits for the other rank to connect
    store.set("hello", "rank 0")
    thread.join(timeout=2 * WAIT.total_seconds())
    assert got == [b"rank 0"]
    opened = listening(os.getpid()) - before
    assert not {address for address, _ in opened} & ANY_ADDRESS, opened
    assert (LOOPBACK, rendezvous.port) in listening(os.getpid())
    assert not [port for address, port in listening(os.getpid()) if port == rendezvous.port and address != LOOPBACK]
    with pytest.raises(RuntimeError, match="made already"):
        rendezvous.store(2)


def test_under_torchrun_the_leader_has_no_rendezvous_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # torchrun started the ranks: they meet at its store (env://)
    assert Leader.start(2, []).rendezvous is None
