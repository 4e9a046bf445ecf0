"""StopMatcher: stop strings are found however the text is split, cut the output there, and are never shown."""

from __future__ import annotations

import random
import time

import pytest

from transformers_openai.engine.stop_matcher import StopAutomata, StopMatcher


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


class SlicingStopMatcher:
    """The matcher this project had before the automaton (O(L²) per token in the held-back length L), kept here only
    as the reference that the automaton must agree with, push by push."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        text = self._held + delta
        cut = self._first_match(text)
        pending = len(text) - self._partial_tail(text)
        if cut >= 0 and pending >= cut:
            self.stopped = True
            self._held = ""
            return text[:cut]
        self._held = text[pending:]
        return text[:pending]

    def flush(self) -> str:
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        cut = self._first_match(held)
        if cut >= 0:
            self.stopped = True
            return held[:cut]
        return held

    def _first_match(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)

    def _partial_tail(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def random_pieces(rng: random.Random, text: str) -> list[str]:
    """Any split, empty pieces included."""
    pieces: list[str] = []
    at = 0
    while at < len(text):
        size = rng.choice([0, 1, 1, 1, 2, 3, rng.randint(1, 12)])
        pieces.append(text[at : at + size])
        at += size
    return pieces


@pytest.mark.parametrize("seed", range(300))
def test_the_automaton_agrees_with_the_slicing_matcher_push_by_push(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "a\n", "xy<>/", "aé€😀"])
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.2:
        stops.append(stops[0] + stops[-1])  # one stop string inside, or at the start of, another
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
    pieces = random_pieces(rng, text)
    if rng.random() < 0.3:
        pieces.insert(rng.randint(0, len(pieces)), "")
    ours, reference = StopMatcher(stops), SlicingStopMatcher(stops)
    for piece in pieces:
        assert ours.push(piece) == reference.push(piece), (stops, pieces)
        assert ours.stopped == reference.stopped
    assert ours.flush() == reference.flush()
    assert ours.stopped == reference.stopped
    assert ours.flush() == reference.flush() == ""
    if not ours.stopped:  # a flushed matcher starts over, with nothing held
        more = "".join(rng.choice(alphabet) for _ in range(10))
        assert ours.push(more) + ours.flush() == reference.push(more) + reference.flush()


def push_all(matcher: StopMatcher | SlicingStopMatcher, tokens: list[str]) -> float:
    start = time.perf_counter()
    for token in tokens:
        matcher.push(token)
    return time.perf_counter() - start


def long_stops() -> list[str]:
    """64 stop strings of about 8K characters. The text "abab..." keeps the last one's prefix open, so the held-back
    tail stays 8K long; the others never match a suffix, so the slicing matcher tried every length of each."""
    body = "ab" * 4096
    return [f"c{body}{i}" for i in range(63)] + [f"{body}!"]


def test_64_long_stops_with_an_8k_tail_cost_about_what_one_short_stop_costs() -> None:
    tokens = ["ab"] * 2000
    timings: dict[str, float] = {}
    for name, stops in (("long", long_stops()), ("short", ["!"])):
        best = float("inf")
        for _ in range(5):  # the fastest of several runs: the least disturbed by other work on the machine
            matcher = StopMatcher(stops)
            matcher.push("ab" * 4096)  # the held-back tail is 8K characters from the first timed token on
            best = min(best, push_all(matcher, tokens))
            assert not matcher.stopped
        timings[name] = best
    long_matcher = StopMatcher(long_stops())
    held = long_matcher.push("ab" * 4096 + "abab")
    assert held == "abab"  # all but the 8K characters that could still begin the last stop string
    # The slicing matcher took about 0.2 s a token here (tens of thousands of times one short stop).
    assert timings["long"] < 20 * timings["short"], timings


def test_matchers_with_the_same_stops_share_one_automaton_and_keep_their_own_state() -> None:
    stops = ["</a>", "</b>"]
    automata = StopAutomata()
    first, second = StopMatcher(stops, automata), StopMatcher(("</a>", "", "</b>"), automata)
    assert first._automaton is second._automaton  # built once for a request's n choices
    assert first.push("x</") == "x"
    assert second.push("y</b") == "y"
    assert first.push("a>z") == "" and first.stopped
    assert not second.stopped and second.push("!") == "</b!"


@pytest.mark.parametrize(
    ("stops", "deltas", "matched"),
    [
        (["STOP"], ["Hello STOP world"], "STOP"),
        (["</end>", "x"], list("one two</end>three"), "</end>"),
        (["b", "ab"], ["a", "b"], "ab"),  # the one that starts earlier wins, and is the one named
        (["END", "ND!"], ["E", "N", "D"], "END"),  # completed in the held-back tail, found at the flush
        (["zz"], ["no stop here"], None),
    ],
)
def test_the_stop_string_that_matched_is_named(stops: list[str], deltas: list[str], matched: str | None) -> None:
    matcher = StopMatcher(stops)
    for delta in deltas:
        matcher.push(delta)
    matcher.flush()
    assert matcher.matched == matched and matcher.stopped is (matched is not None)
