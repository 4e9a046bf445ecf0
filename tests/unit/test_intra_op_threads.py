"""Steps of a token or two run on one torch thread, larger ones on all of them (the engine thread's setting)."""

from __future__ import annotations

import torch

from transformers_openai.engine.intra_op_threads import IntraOpThreads


def test_threads_follow_the_size_of_the_step() -> None:
    before = torch.get_num_threads()
    threads = IntraOpThreads(most=2)
    try:
        threads.fit(1)
        assert torch.get_num_threads() == 1
        threads.fit(2)
        assert torch.get_num_threads() == 1
        threads.fit(16)
        assert torch.get_num_threads() == 2
        threads.fit(300)  # a prefill chunk
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
