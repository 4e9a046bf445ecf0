"""Text streamed token by token never runs past the transcript: a window's live text is always a prefix of what its
kept segments say (OpenAI's seek and silence rules, longform.split_window), and the stream's deltas join to the
transcript's text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from transformers_openai.engine.detokenizer import Decoder
from transformers_openai.serving.speech.live_text import SentText, WindowPlace, WindowText
from transformers_openai.serving.speech.longform import WINDOW_FRAMES, split_window
from transformers_openai.serving.speech.whisper_tokens import WhisperTokens
from transformers_openai.serving.tokenizer import engine_decoder

SENTENCE = " Without going to any such extreme as this, we can easily see how vast an influence café 🎉 has."


@pytest.fixture(scope="module")
def tokenizer(whisper_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(whisper_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer: Any) -> WhisperTokens:
    return WhisperTokens.from_tokenizer(tokenizer, False)


@pytest.fixture(scope="module")
def decoder(tokenizer: Any) -> Decoder:
    return engine_decoder(tokenizer)


def live(decoder: Decoder, tokens: WhisperTokens, start: float = 0.0, duration: float = 30.0) -> WindowText:
    place = WindowPlace(start=start, duration=duration)
    return WindowText(decoder, tokens.eot, tokens.timestamp_begin, place)


def kept_text(tokenizer: Any, tokens: WhisperTokens, window: list[int], start: float, duration: float) -> str:
    """What the transcript keeps of a window, as the handler builds it."""
    sampled = window[:-1] if window and window[-1] == tokens.eot else window
    frames = min(WINDOW_FRAMES, round((duration - start) * 100))
    split = split_window(sampled, tokens.eot, tokens.timestamp_begin, frames)
    parts = [p for p in split.segments if min(start + p.end, duration) > start + p.start]
    return "".join(tokenizer.decode(p.text_tokens) for p in parts)


def words(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_the_first_segment_streams_token_by_token(tokenizer: Any, decoder: Decoder, tokens: WhisperTokens) -> None:
    text = words(tokenizer, SENTENCE)
    stamp = tokens.timestamp_begin
    window = live(decoder, tokens)
    pieces = [window.push([stamp], no_speech_prob=0.01)]
    pieces += [window.push([token]) for token in text]
    pieces += [window.push([stamp + 200]), window.push([tokens.eot])]
    assert "".join(pieces) == tokenizer.decode(text) == SENTENCE
    sent = [piece for piece in pieces if piece]
    assert len(sent) >= len(SENTENCE.split()) and sent[0] == " Without"
    assert not any("\ufffd" in piece for piece in pieces)  # the emoji's and é's bytes wait for their character


def test_a_later_segment_waits_for_its_closing_timestamp_and_an_open_one_is_never_sent(
    tokenizer: Any, decoder: Decoder, tokens: WhisperTokens
) -> None:
    first, second, third = (words(tokenizer, s) for s in (" One two.", " Three four.", " Five six"))
    stamp = tokens.timestamp_begin
    window = live(decoder, tokens)
    assert window.push([stamp, *first[:1]]) == " One"
    assert window.push([*first[1:], stamp + 50, stamp + 50]) == " two."
    assert window.push(second) == ""  # may still be cut by the seek
    assert window.push([stamp + 100]) == " Three four."
    assert window.push([stamp + 100, *third, tokens.eot]) == ""  # never closed: the next window decodes it again
    full = [stamp, *first, stamp + 50, stamp + 50, *second, stamp + 100, stamp + 100, *third, tokens.eot]
    assert kept_text(tokenizer, tokens, full, 0.0, 30.0) == " One two. Three four."


def test_likely_silence_and_text_past_the_audio_are_held(
    tokenizer: Any, decoder: Decoder, tokens: WhisperTokens
) -> None:
    text = words(tokenizer, " you")
    stamp = tokens.timestamp_begin
    silent = live(decoder, tokens)
    assert silent.push([stamp, *text, stamp + 50, tokens.eot], no_speech_prob=0.9) == ""
    past_the_end = live(decoder, tokens, start=58.0, duration=58.5)
    assert past_the_end.push([stamp + 40, *text, stamp + 45, tokens.eot]) == ""  # starts at 58.8 s: dropped


def random_window(rng: random.Random, tokens: WhisperTokens, vocabulary: list[int]) -> list[int]:
    """Tokens as Whisper's timestamp rules let them come: a first timestamp, then segments of text each closed by
    a timestamp, pairs between them, timestamps never going down; ending closed, open, or cut at the token limit."""
    stamp, at = tokens.timestamp_begin, rng.randint(0, 50)
    window = [stamp + at]
    while len(window) < 60:
        window += rng.choices(vocabulary, k=rng.randint(1, 6))
        if rng.random() < 0.2:
            return window + [tokens.eot]  # ends inside a segment
        at += rng.randint(1, 200)  # strictly up after text
        window.append(stamp + at)
        if rng.random() < 0.25:
            return window + [tokens.eot]  # ends on a single timestamp
        window.append(stamp + at + rng.randint(0, 3))
        at = window[-1] - stamp
    return window  # the token limit


def test_live_text_is_always_a_prefix_of_what_the_window_keeps(
    tokenizer: Any, decoder: Decoder, tokens: WhisperTokens
) -> None:
    rng = random.Random(46)
    vocabulary = words(tokenizer, SENTENCE)
    for _ in range(300):
        window = random_window(rng, tokens, vocabulary)
        start = rng.choice([0.0, 30.0])
        duration = start + rng.choice([0.5, 5.0, 30.0])
        silence = rng.choice([0.0, 0.0, 0.9])
        text = live(decoder, tokens, start, duration)
        cuts = sorted(rng.sample(range(1, len(window)), k=min(3, len(window) - 1)))
        pieces = [
            text.push(window[a:b], silence if a == 0 else 0.0) for a, b in zip([0, *cuts], [*cuts, None], strict=True)
        ]
        kept = kept_text(tokenizer, tokens, window, start, duration)
        assert kept.startswith("".join(pieces)), (window, pieces, kept)


def test_sent_text_joins_live_text_and_finished_segments() -> None:
    sent = SentText("t")
    deltas = [sent.add_live(" Hello"), sent.add_live(" there."), sent.add_segment(" Hello there.")]
    deltas += [sent.add_live(" More"), sent.add_segment(" More to come."), sent.add_segment(" ")]
    assert deltas == ["Hello", " there.", "", " More", " to come.", ""]
    assert "".join(deltas) == (" Hello there. More to come. ").strip()
