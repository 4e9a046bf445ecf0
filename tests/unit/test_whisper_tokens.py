"""The forced prefix of a Whisper window: previous text, start of transcript, language, task, timestamps."""

from __future__ import annotations

from transformers_openai.serving.speech.whisper_tokens import WhisperTokens, language_name

# tiny.en's layout: English-only, no language or task in the prefix.
ENGLISH = WhisperTokens(
    sot=50257,
    eot=50256,
    sot_prev=50360,
    no_timestamps=50362,
    no_speech=50361,
    transcribe=50358,
    translate=50357,
    languages={},
)
# A multilingual layout (large-v3 style ids; only the layout matters).
MULTI = WhisperTokens(
    sot=50258,
    eot=50257,
    sot_prev=50362,
    no_timestamps=50364,
    no_speech=50363,
    transcribe=50360,
    translate=50359,
    languages={"en": 50259, "de": 50261},
)


def test_english_only_prefix_has_no_language_or_task() -> None:
    assert ENGLISH.prefix(language=None, task="transcribe", timestamps=True, previous=[]) == [50257]
    assert ENGLISH.prefix(language=None, task="transcribe", timestamps=False, previous=[]) == [50257, 50362]
    assert ENGLISH.timestamp_begin == 50363 and not ENGLISH.multilingual


def test_multilingual_prefix_names_language_and_task() -> None:
    assert MULTI.prefix(language="de", task="translate", timestamps=False, previous=[]) == [50258, 50261, 50359, 50364]
    assert MULTI.prefix(language=None, task="transcribe", timestamps=True, previous=[]) == [50258, 50360]


def test_previous_text_is_carried_up_to_223_tokens() -> None:
    previous = list(range(1000, 1300))
    prefix = ENGLISH.prefix(language=None, task="transcribe", timestamps=True, previous=previous)
    assert prefix[0] == ENGLISH.sot_prev and prefix[-1] == ENGLISH.sot
    assert prefix[1:-1] == previous[-223:]


def test_language_names_are_full_lower_case_english() -> None:
    assert language_name("en") == "english" and language_name("de") == "german"
