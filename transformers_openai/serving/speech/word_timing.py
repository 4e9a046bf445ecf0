"""Word times for one Whisper window from its alignment heads' cross-attention (DTW, OpenAI's rules)."""

from __future__ import annotations

import itertools
import string
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

SECONDS_PER_POSITION = 0.02  # one encoder position = two 10 ms mel frames
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"
MAX_MEDIAN_DURATION = 0.7
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
_REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class SegmentSpan:
    """A segment of the window: its times (absolute seconds) and its half-open range of indices into the text tokens."""

    start: float
    end: float
    token_start: int
    token_end: int


@dataclass
class WordTime:
    """One word: its text (Whisper's leading space kept), times in seconds, its segment and its token ids."""

    word: str
    start: float
    end: float
    segment: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WindowWords:
    """The words of one window, each segment's (start, end) fitted to its words, and the end of the last word."""

    words: list[WordTime]
    segments: list[tuple[float, float]]
    last_speech_time: float


def alignment_rows(attention: torch.Tensor, num_text_tokens: int) -> torch.Tensor:
    """The rows `word_timestamps` expects, cut from the attention over the whole teacher-forced sequence.

    Args:
        attention: `[heads, sequence, frames]` for `[prefix..., <|notimestamps|>, text tokens..., <|endoftext|>]`.
        num_text_tokens: how many text tokens the sequence holds.

    Returns:
        `[heads, num_text_tokens + 1, frames]`: the rows of the positions that *predict* each text token and the
        end of text, i.e. the positions of `<|notimestamps|>` and of every text token (not the one of `<|endoftext|>`).
    """
    if attention.ndim != 3 or attention.shape[1] < num_text_tokens + 2:
        raise ValueError(f"attention of shape {tuple(attention.shape)} cannot hold {num_text_tokens} text tokens")
    return attention[:, -(num_text_tokens + 2) : -1]


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over a sliding window of odd `width` along the last axis, edges padded by reflection.

    Inputs shorter than `width // 2 + 1` along that axis cannot be reflected and come back unchanged.
    """
    if width < 1 or width % 2 == 0:
        raise ValueError(f"median filter width must be a positive odd number, got {width}")
    half = width // 2
    length = x.shape[-1]
    if length <= half:
        return x
    rows = x.reshape(1, -1, length)
    padded = F.pad(rows, (half, half), mode="reflect")
    return padded.unfold(-1, width, 1).median(dim=-1).values.reshape(x.shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest monotone path through a `[rows, columns]` cost matrix from its first cell to its last.

    Each step moves to the next row, the next column, or both. On equal costs, walking back from the last cell, the
    path prefers the diagonal, then the column step, then the row step.
    Anti-diagonals depend only on the two before them, so each one is computed as one vector.

    Returns:
        The row and the column index of every cell on the path, in order.
    """
    rows, cols = cost.shape
    if rows == 0 or cols == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if not np.isfinite(cost).all():
        raise ValueError("DTW costs must be finite")
    total = np.full((rows + 1, cols + 1), np.inf)
    total[0, 0] = 0.0
    move = np.zeros((rows + 1, cols + 1), dtype=np.int8)  # 0 diagonal, 1 from the left, 2 from above
    for diagonal in range(2, rows + cols + 1):
        i = np.arange(max(1, diagonal - cols), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        options = np.stack([total[i - 1, j - 1], total[i, j - 1], total[i - 1, j]])
        best = options.argmin(axis=0)
        total[i, j] = cost[i - 1, j - 1] + options[best, np.arange(len(i))]
        move[i, j] = best
    return _backtrace(move)


def _backtrace(move: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i, j = move.shape[0] - 1, move.shape[1] - 1
    path: list[tuple[int, int]] = []
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        step = move[i, j]
        i -= int(step != 1)
        j -= int(step != 2)
    path.reverse()
    cells = np.array(path, dtype=np.int64).reshape(-1, 2)
    return cells[:, 0], cells[:, 1]


def alignment_matrix(
    weights: torch.Tensor | np.ndarray, num_frames: int, width: int = MEDIAN_FILTER_WIDTH
) -> np.ndarray:
    """`[tokens, num_frames]` evidence that each token is spoken at each position (higher is likelier).

    Drops the padding positions and renormalises each row over the real ones (the same as OpenAI's softmax over the
    real positions only), standardises each head over tokens, median-filters it along time and averages the heads.
    """
    w = torch.as_tensor(weights).float()[:, :, :num_frames]
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, correction=0)
    # A position where every token weighs the same says nothing; keep it at 0 rather than 0/0.
    z = torch.where(std > 0, (w - mean) / std, torch.zeros_like(w))
    total = torch.zeros_like(z[0])
    for head in z:  # one head at a time: the filter's windows take `width` times the head's memory
        total += median_filter(head, width)
    return (total / z.shape[0]).double().cpu().numpy()


def token_start_times(matrix: np.ndarray) -> np.ndarray:
    """Seconds from the window's start at which each row's token starts: where the DTW path first reaches it."""
    rows, cols = dtw(-matrix)
    first = np.concatenate([[True], np.diff(rows) > 0])
    times: np.ndarray = cols[first] * SECONDS_PER_POSITION
    return times


def _is_punctuation(text: str) -> bool:
    return all(ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in text)


def _made_of(text: str, chars: str) -> bool:
    return bool(text) and all(ch in chars for ch in text)


def _character_groups(token_ids: Sequence[int], decode: Decode) -> list[tuple[list[int], str]]:
    """Runs of token positions that decode to whole characters (a character's UTF-8 bytes may span tokens)."""
    full = decode(list(token_ids))
    groups: list[tuple[list[int], str]] = []
    current: list[int] = []
    offset = 0
    for position in range(len(token_ids)):
        current.append(position)
        text = decode([token_ids[k] for k in current])
        # A replacement character the full text lacks is an unfinished character: wait for its other bytes.
        unfinished = any(ch == _REPLACEMENT and full[offset + k : offset + k + 1] != ch for k, ch in enumerate(text))
        if not unfinished:
            groups.append((current, text))
            offset += len(text)
            current = []
    if current:
        groups.append((current, decode([token_ids[k] for k in current])))
    return groups


def split_words(token_ids: Sequence[int], decode: Decode, *, by_character: bool = False) -> list[tuple[list[int], str]]:
    """Group token positions into words, with each word's text.

    A word starts at a token whose text starts with a space or is punctuation; the tokens after it join it. With
    `by_character` (languages written without spaces) every whole character is its own word.
    """
    groups = _character_groups(token_ids, decode)
    if by_character:
        return groups
    words: list[tuple[list[int], str]] = []
    for positions, text in groups:
        if not words or text.startswith(" ") or _is_punctuation(text.strip()):
            words.append((list(positions), text))
        else:
            words[-1] = (words[-1][0] + positions, words[-1][1] + text)
    return words


def merge_punctuation(
    words: Sequence[WordTime], prepend: str = PREPEND_PUNCTUATION, append: str = APPEND_PUNCTUATION
) -> list[WordTime]:
    """Fold opening marks (a word of `prepend` characters after a space) into the next word and closing marks
    (a word of `append` characters) into the previous one; the word keeps the times of its letters."""
    backwards: list[WordTime] = []
    for word in reversed(words):
        if backwards and word.word.startswith(" ") and _made_of(word.word.strip(), prepend):
            following = backwards[-1]
            backwards[-1] = replace(following, word=word.word + following.word, tokens=word.tokens + following.tokens)
        else:
            backwards.append(replace(word))
    merged: list[WordTime] = []
    for word in reversed(backwards):
        if merged and not merged[-1].word.endswith(" ") and _made_of(word.word, append):
            previous = merged[-1]
            merged[-1] = replace(previous, word=previous.word + word.word, tokens=previous.tokens + word.tokens)
        else:
            merged.append(word)
    return merged


def median_duration(words: Sequence[WordTime]) -> float:
    """The median of the words' non-zero durations, at most 0.7 s (0 when there are none)."""
    durations = [word.end - word.start for word in words if word.end != word.start]
    return min(MAX_MEDIAN_DURATION, float(np.median(durations))) if durations else 0.0


def clamp_sentence_ends(words: Sequence[WordTime], max_duration: float) -> None:
    """A sentence-end mark longer than `max_duration` keeps its start; a long word after one keeps its end."""
    for previous, word in itertools.pairwise(words):
        if word.end - word.start <= max_duration:
            continue
        if _made_of(word.word, SENTENCE_END_MARKS):
            word.end = word.start + max_duration
        elif _made_of(previous.word, SENTENCE_END_MARKS):
            word.start = word.end - max_duration


def clamp_after_pause(words: Sequence[WordTime], last_speech_time: float, median: float, floor: float) -> None:
    """After a pause of over 4 medians, the segment's first (and a long second) word last at most 2 medians."""
    max_duration = 2 * median
    first = words[0]
    second = words[1] if len(words) > 1 else None
    if first.end - last_speech_time <= 4 * median:
        return
    if first.end - first.start <= max_duration and (second is None or second.end - first.start <= 2 * max_duration):
        return
    if second is not None and second.end - second.start > max_duration:
        # OpenAI's rule as it stands: it halves the absolute time, so that term only counts near the file's start.
        boundary = max(second.end / 2, second.end - max_duration)
        first.end = second.start = boundary
    first.start = max(floor, first.end - max_duration)


def fit_segment_bounds(
    words: Sequence[WordTime], span: SegmentSpan, median: float, floor: float
) -> tuple[float, float]:
    """Trim a first or last word that sticks out of its segment by over 0.5 s; otherwise the segment takes the
    words' bounds. Returns the segment's (start, end)."""
    start, end = span.start, span.end
    first, last = words[0], words[-1]
    if first.start < start - 0.5 and start < first.end:
        first.start = max(floor, min(first.end - median, start))
    else:
        start = first.start
    if last.end > end + 0.5 and end > last.start:
        last.end = max(last.start + median, end)
    else:
        end = last.end
    return start, end


def _timed_words(
    text_tokens: Sequence[int], decode: Decode, spans: Sequence[SegmentSpan], times: np.ndarray, by_character: bool
) -> list[WordTime]:
    """Each segment's words, timed from their first token's start to the next token's start."""
    words: list[WordTime] = []
    for index, span in enumerate(spans):
        ids = list(text_tokens[span.token_start : span.token_end])
        for positions, text in split_words(ids, decode, by_character=by_character):
            first, after = span.token_start + positions[0], span.token_start + positions[-1] + 1
            tokens = [ids[k] for k in positions]
            words.append(WordTime(text, float(times[first]), float(times[after]), index, tokens))
    return words


def _check_inputs(shape: Sequence[int], num_text_tokens: int, num_frames: int, spans: Sequence[SegmentSpan]) -> None:
    if len(shape) != 3 or shape[1] != num_text_tokens + 1:
        raise ValueError(f"weights must be [heads, {num_text_tokens + 1}, frames], got {tuple(shape)}")
    if not 1 <= num_frames <= shape[2]:
        raise ValueError(f"num_frames must be in 1..{shape[2]} encoder positions, got {num_frames}")
    expected = 0
    for span in spans:
        if span.token_start != expected or span.token_end < span.token_start:
            raise ValueError("segments must cover the text tokens in order, without gaps or overlaps")
        expected = span.token_end
    if expected != num_text_tokens:
        raise ValueError("segments must cover the text tokens in order, without gaps or overlaps")


def _tidy(
    words: list[WordTime], bounds: list[tuple[float, float]], window_start: float, window_end: float
) -> list[tuple[float, float]]:
    """Round to 0.01 s, keep words in order inside the window, widen each segment to hold its words."""
    floor, ceiling = round(window_start, 2), round(window_end, 2)
    for word in words:
        word.start = round(min(max(word.start, floor), ceiling), 2)
        word.end = round(min(max(word.end, word.start), ceiling), 2)
        floor = word.end
    fitted: list[tuple[float, float]] = []
    for index, (start, end) in enumerate(bounds):
        mine = [word for word in words if word.segment == index]
        if mine:
            start, end = min(start, mine[0].start), max(end, mine[-1].end)
        fitted.append((round(start, 2), round(end, 2)))
    return fitted


def word_timestamps(
    weights: torch.Tensor | np.ndarray,
    *,
    num_frames: int,
    text_tokens: Sequence[int],
    decode: Decode,
    window_start: float,
    segments: Sequence[SegmentSpan] | None = None,
    last_speech_time: float = 0.0,
    language: str | None = None,
    filter_width: int = MEDIAN_FILTER_WIDTH,
) -> WindowWords:
    """Word times of one window, by OpenAI whisper's method.

    Args:
        weights: `[alignment heads, len(text_tokens) + 1, frames]` cross-attention probabilities (softmaxed over
            encoder positions) of the teacher-forced pass over `[prefix..., <|notimestamps|>, text tokens...,
            <|endoftext|>]`. Row k is the position that predicts text token k; the last row predicts `<|endoftext|>`.
            These are the positions of `<|notimestamps|>` and the text tokens (`alignment_rows` cuts them out).
        num_frames: the window's real audio in encoder positions (mel frames // 2); later positions are padding.
        text_tokens: the window's text token ids, without timestamps or special tokens.
        decode: the tokenizer's decode of a list of ids.
        window_start: the window's start in seconds from the start of the audio.
        segments: the window's segments covering `text_tokens` in order; None takes them as one segment.
        last_speech_time: the end of the last word of the previous window (0 for the first).
        language: ISO-639-1 code; languages written without spaces get one word per character.
        filter_width: the median filter's width in encoder positions.

    Returns:
        Words in order with absolute times, non-decreasing and inside the window and their segment; segment bounds
        fitted to their words; the last word's end as `last_speech_time` for the next window.
    """
    window_end = window_start + num_frames * SECONDS_PER_POSITION
    n = len(text_tokens)
    spans = list(segments) if segments is not None else [SegmentSpan(window_start, window_end, 0, n)]
    _check_inputs(tuple(weights.shape), n, num_frames, spans)
    if n == 0:
        return WindowWords([], [(span.start, span.end) for span in spans], last_speech_time)
    times = window_start + token_start_times(alignment_matrix(weights, num_frames, filter_width))
    words = _timed_words(text_tokens, decode, spans, times, by_character=language in NO_SPACE_LANGUAGES)
    median = median_duration(words)
    clamp_sentence_ends(words, 2 * median)
    result: list[WordTime] = []
    bounds: list[tuple[float, float]] = []
    last_speech = last_speech_time
    for index, span in enumerate(spans):
        # Marks merge within their segment: OpenAI merges across the window, which can move a word to the wrong one.
        merged = merge_punctuation([word for word in words if word.segment == index])
        if not merged:
            bounds.append((span.start, span.end))
            continue
        clamp_after_pause(merged, last_speech, median, window_start)
        bounds.append(fit_segment_bounds(merged, span, median, window_start))
        last_speech = bounds[-1][1]
        result.extend(merged)
    fitted = _tidy(result, bounds, window_start, window_end)
    return WindowWords(result, fitted, result[-1].end if result else last_speech_time)
