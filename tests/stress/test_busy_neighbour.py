"""The busy-neighbour benchmark's own parts: the neighbour spins on the core it is given and is stopped, and the
phases' rates and the recovery time come from the tokens' arrival times (not its figures: those are the tool's)."""

from __future__ import annotations

import argparse
import os
import time

import pytest
from loadtest.busy_neighbour import Episode, busy_neighbour, rate_phases, target_url


def test_the_neighbour_spins_pinned_to_its_core_and_stops() -> None:
    core = max(os.sched_getaffinity(0))
    with busy_neighbour(core) as process:
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(process.pid) != {core} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(process.pid) == {core}
        assert process.poll() is None
    assert process.poll() is not None


def test_rates_per_phase_and_the_time_to_recover() -> None:
    # 20 tokens/s free (from 0 to 10 s), 2/s beside the neighbour (10-20 s), then 5/s for 3 s and 20/s again.
    free = [i / 20 for i in range(200)]
    busy = [10 + i / 2 for i in range(20)]
    after = [20 + i / 5 for i in range(15)] + [23 + i / 20 for i in range(140)]
    result = Episode("new", 1, 1)
    rate_phases(result, free + busy + after, counted_from=2.0, stopped=20.0, phase_s=10.0, recovered=0.8)
    assert result.free_tps == pytest.approx(20.0)
    assert result.busy_tps == pytest.approx(2.0)
    assert result.busy_ratio == pytest.approx(0.1)
    assert result.after_per_s[:4] == pytest.approx([5.0, 5.0, 5.0, 20.0])
    assert result.recovery_s == 3.0


def test_never_recovering_within_the_phase() -> None:
    result = Episode("old", 1, 1)
    rate_phases(result, [i / 20 for i in range(200)], counted_from=0.0, stopped=20.0, phase_s=10.0, recovered=0.8)
    assert result.busy_tps == 0.0 and result.recovery_s is None


def test_only_loopback_servers() -> None:
    assert target_url("new=http://127.0.0.1:7412/") == ("new", "http://127.0.0.1:7412")
    for bad in ("http://127.0.0.1:7412", "x=http://example.com:80"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=URL"):
            target_url(bad)
