"""StopMatcher: stop strings are found however the text is split, cut the output there, and are never shown."""

from __future__ import annotations

import random

import pytest

from transformers_openai.engine.stop_matcher import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Feeds every delta, then flushes; returns the emitted text and whether a stop was hit."""
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(d) for d in deltas) + matcher.flush()
    return out, matcher.stopped


def test_no_stops_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == "abc"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_arriving_whole() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("Hello STOP world") == "Hello "
    assert matcher.stopped


def test_stop_split_char_by_char() -> None:
    text = "one two</end>three"
    matcher = StopMatcher(["</end>"])
    emitted = [matcher.push(c) for c in text]
    assert "".join(emitted) == "one two"
    assert matcher.stopped
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo"], ["Hello world"]) == ("Hel", True)
    assert run(["xyz", "wor", "d"], ["Hel", "lo w", "orld"]) == ("Hello ", True)


def test_partial_match_that_is_not_a_stop_is_released() -> None:
    matcher = StopMatcher(["\n\nUser:"])
    assert matcher.push("Hi\n") == "Hi"  # "\n" could start the stop string
    assert matcher.push("\nUs") == ""
    assert matcher.push("e") == ""
    assert matcher.push("d to") == "\n\nUsed to"
    assert not matcher.stopped


def test_flush_releases_held_text() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("answer #") == "answer "
    assert matcher.push("#") == ""
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_nothing_after_a_stop_is_emitted() -> None:
    matcher = StopMatcher(["."])
    assert matcher.push("First. Second") == "First"
    assert matcher.push(" more text") == ""
    assert matcher.push(".") == ""
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    assert run(["", "x"], ["abc", "dx"]) == ("abcd", True)
    assert run([""], ["abc"]) == ("abc", False)


def test_overlapping_prefix_stop() -> None:
    # "aab" inside "aaab": the held "aa" must slide by one, not be dropped or emitted whole.
    assert run(["aab"], list("aaab")) == ("a", True)


def test_a_stop_inside_a_longer_one_gives_the_same_cut_however_split() -> None:
    stops = ["b", "\nba\n"]
    assert run(stops, ["\nba\n"]) == ("", True)
    assert run(stops, list("\nba\n")) == ("", True)
    assert run(stops, list("\nbx")) == ("\n", True)  # the longer one fails: cut at the inner one
    assert run(stops, ["\nb"]) == ("\n", True)  # the sequence ends with the longer one still open


def random_splits(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("seed", range(40))
def test_random_splits_cut_at_first_stop(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab \n<>"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    expected = text if first < 0 else text[:first]
    for _ in range(5):
        out, stopped = run(stops, random_splits(rng, text))
        assert out == expected
        assert stopped == (first >= 0)
        assert not any(s in out for s in stops)
