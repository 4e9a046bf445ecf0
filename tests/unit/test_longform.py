"""OpenAI whisper's long-form rules: segments from timestamp pairs, the seek, the scores and the fallback."""

from __future__ import annotations

import pytest

from transformers_openai.serving.speech.longform import Attempt, compression_ratio, split_window, temperatures

EOT, TB = 100, 200  # end of text, <|0.00|>


def ts(seconds: float) -> int:
    return TB + round(seconds / 0.02)


def test_pairs_close_segments_and_a_single_ending_consumes_the_window() -> None:
    tokens = [ts(0), 1, 2, ts(2.0), ts(2.0), 3, ts(4.5)]
    split = split_window(tokens, EOT, TB, 3000)
    assert [(s.start, s.end, s.text_tokens) for s in split.segments] == [(0.0, 2.0, [1, 2]), (2.0, 4.5, [3])]
    assert split.advance == 3000


def test_an_unfinished_last_segment_is_dropped_and_the_seek_moves_to_the_last_closing_timestamp() -> None:
    tokens = [ts(0), 1, ts(3.0), ts(3.2), 2, 3]  # the second segment never closes: the window was cut mid-word
    split = split_window(tokens, EOT, TB, 3000)
    assert [(s.start, s.end) for s in split.segments] == [(0.0, 3.0)]
    assert split.advance == 300  # 3.0 s = 300 mel frames


def test_without_a_pair_the_window_is_one_segment() -> None:
    split = split_window([ts(0), 1, 2, 3], EOT, TB, 1234)
    assert [(s.start, s.end, s.text_tokens) for s in split.segments] == [(0.0, 12.34, [1, 2, 3])]
    assert split.advance == 1234
    ending = split_window([ts(0), 1, 2, ts(5.0)], EOT, TB, 3000)
    assert [(s.start, s.end) for s in ending.segments] == [(0.0, 5.0)] and ending.advance == 3000


def test_empty_or_zero_length_segments_are_dropped() -> None:
    split = split_window([ts(1), ts(1), ts(1), 5, ts(2)], EOT, TB, 3000)
    assert [(s.start, s.end, s.text_tokens) for s in split.segments] == [(1.0, 2.0, [5])]
    assert split_window([], EOT, TB, 800).segments == [] and split_window([], EOT, TB, 800).advance == 800


def test_temperatures_step_up_to_one() -> None:
    assert temperatures(0.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert temperatures(0.5) == [0.5, 0.7, 0.9]
    assert temperatures(1.0) == [1.0]


def test_scores_and_decisions() -> None:
    repetitive = "the same words again " * 20
    assert compression_ratio(repetitive) > 2.4 > compression_ratio("A quick brown fox jumps over the lazy dog.")
    fluent = Attempt([1, 2, 3], logprob_sum=-0.8, temperature=0.0, no_speech_prob=0.1, text="Hello there.")
    assert fluent.avg_logprob == pytest.approx(-0.2) and not fluent.needs_fallback and not fluent.is_silence
    unlikely = Attempt([1, 2, 3], logprob_sum=-8.0, temperature=0.0, no_speech_prob=0.1, text="Hm.")
    assert unlikely.needs_fallback and not unlikely.is_silence
    looping = Attempt([1] * 40, logprob_sum=-1.0, temperature=0.0, no_speech_prob=0.1, text=repetitive)
    assert looping.needs_fallback
    silence = Attempt([1], logprob_sum=-4.0, temperature=0.0, no_speech_prob=0.9, text=" you")
    assert silence.is_silence and not silence.needs_fallback  # silence is skipped, never retried
