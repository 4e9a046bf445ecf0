"""Word times from cross-attention: DTW, median filter, word split, punctuation, clamps, and synthetic alignments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from transformers_openai.serving.speech.word_timing import (
    SegmentSpan,
    WordTime,
    alignment_rows,
    clamp_after_pause,
    clamp_sentence_ends,
    dtw,
    fit_segment_bounds,
    median_duration,
    median_filter,
    merge_punctuation,
    split_words,
    token_start_times,
    word_timestamps,
)


class Vocab:
    """A byte-level fake tokenizer: token id i is the i-th byte string; decoding replaces broken UTF-8 like BPE."""

    def __init__(self, pieces: Sequence[str | bytes]) -> None:
        self.pieces = [p.encode() if isinstance(p, str) else p for p in pieces]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def ids(self, *pieces: str | bytes) -> list[int]:
        wanted = [p.encode() if isinstance(p, str) else p for p in pieces]
        return [self.pieces.index(p) for p in wanted]


def words_of(vocab: Vocab, ids: list[int], **kwargs: bool) -> list[str]:
    return [text for _, text in split_words(ids, vocab.decode, **kwargs)]


def timed(*words: tuple[str, float, float]) -> list[WordTime]:
    return [WordTime(text, start, end) for text, start, end in words]


# --- DTW ---------------------------------------------------------------------------------------------------------


def path_cost(cost: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    return float(cost[rows, cols].sum())


def brute_force_cheapest(cost: np.ndarray) -> float:
    """Every monotone path from the first cell to the last, one step (right, down or both) at a time."""
    n, m = cost.shape
    best = np.inf
    steps = [(0, 1), (1, 0), (1, 1)]
    stack: list[tuple[int, int, float]] = [(0, 0, float(cost[0, 0]))]
    while stack:
        i, j, total = stack.pop()
        if (i, j) == (n - 1, m - 1):
            best = min(best, total)
            continue
        for di, dj in steps:
            if i + di < n and j + dj < m:
                stack.append((i + di, j + dj, total + float(cost[i + di, j + dj])))
    return best


def test_dtw_follows_the_cheap_cells() -> None:
    cost = np.array(
        [
            [0, 0, 9, 9, 9],
            [9, 9, 0, 0, 9],
            [9, 9, 9, 9, 0],
        ],
        dtype=float,
    )
    rows, cols = dtw(cost)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4)]


def test_dtw_steps_rows_when_tokens_outnumber_frames() -> None:
    cost = np.array([[0, 9], [0, 9], [9, 0], [9, 0]], dtype=float)
    rows, cols = dtw(cost)
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_dtw_ties_prefer_the_diagonal_then_the_column_walking_back_from_the_end() -> None:
    rows, cols = dtw(np.zeros((3, 5)))
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(0, 0), (0, 1), (0, 2), (1, 3), (2, 4)]
    rows, cols = dtw(np.zeros((4, 2)))
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [(0, 0), (1, 0), (2, 0), (3, 1)]


@pytest.mark.parametrize("seed", range(6))
def test_dtw_finds_the_cheapest_monotone_path(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cost = rng.normal(size=(rng.integers(1, 5), rng.integers(1, 6)))
    rows, cols = dtw(cost)
    assert (rows[0], cols[0]) == (0, 0) and (rows[-1], cols[-1]) == (cost.shape[0] - 1, cost.shape[1] - 1)
    steps = set(zip(np.diff(rows).tolist(), np.diff(cols).tolist(), strict=True))
    assert steps <= {(0, 1), (1, 0), (1, 1)}
    assert path_cost(cost, rows, cols) == pytest.approx(brute_force_cheapest(cost))


def test_dtw_of_an_empty_matrix_is_empty() -> None:
    rows, cols = dtw(np.zeros((0, 4)))
    assert rows.size == 0 and cols.size == 0


# --- median filter -----------------------------------------------------------------------------------------------


def numpy_median(x: np.ndarray, width: int) -> np.ndarray:
    half = width // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.median(windows, axis=-1)


@pytest.mark.parametrize("width", [1, 3, 7])
def test_median_filter_matches_a_direct_computation(width: int) -> None:
    x = np.random.default_rng(width).normal(size=(2, 4, 23)).astype(np.float32)
    got = median_filter(torch.from_numpy(x), width).numpy()
    np.testing.assert_allclose(got, numpy_median(x, width), rtol=0, atol=0)


def test_median_filter_leaves_too_short_inputs_and_refuses_even_widths() -> None:
    x = torch.arange(3.0).reshape(1, 3)
    assert torch.equal(median_filter(x, 7), x)
    with pytest.raises(ValueError):
        median_filter(x, 4)


# --- rows ----------------------------------------------------------------------------------------------------------


def test_alignment_rows_are_the_positions_predicting_text_and_eot() -> None:
    # Sequence: sot, lang, task, notimestamps, t0, t1, t2, eot; row value = its position.
    full = torch.arange(8.0).reshape(1, 8, 1).expand(2, 8, 5)
    rows = alignment_rows(full, 3)
    assert rows.shape == (2, 4, 5)
    assert rows[0, :, 0].tolist() == [3.0, 4.0, 5.0, 6.0]
    with pytest.raises(ValueError):
        alignment_rows(full, 7)


# --- word split ----------------------------------------------------------------------------------------------------


def test_multi_token_words_group_at_leading_spaces() -> None:
    vocab = Vocab([" The", " qu", "ick", " brown", " fox", " jump", "s", ".", "ed"])
    ids = vocab.ids(" The", " qu", "ick", " brown", " fox", " jump", "ed", ".")
    assert words_of(vocab, ids) == [" The", " quick", " brown", " fox", " jumped", "."]
    groups = split_words(ids, vocab.decode)
    assert [positions for positions, _ in groups] == [[0], [1, 2], [3], [4], [5, 6], [7]]


def test_bytes_of_one_character_stay_together() -> None:
    e_acute = "é".encode()
    vocab = Vocab([" caf", e_acute[:1], e_acute[1:], " au", " lait"])
    ids = vocab.ids(" caf", e_acute[:1], e_acute[1:], " au", " lait")
    assert words_of(vocab, ids) == [" café", " au", " lait"]


def test_languages_without_spaces_get_a_word_per_character() -> None:
    ni = "你".encode()
    vocab = Vocab([ni[:2], ni[2:], "好", "。"])
    ids = vocab.ids(ni[:2], ni[2:], "好", "。")
    assert words_of(vocab, ids, by_character=True) == ["你", "好", "。"]


# --- punctuation ---------------------------------------------------------------------------------------------------


def merged_words(vocab: Vocab, *pieces: str) -> list[str]:
    words = [WordTime(text, 0.0, 0.0) for _, text in split_words(vocab.ids(*pieces), vocab.decode)]
    return [word.word for word in merge_punctuation(words)]


def test_quoted_speech_merges_into_its_neighbours() -> None:
    vocab = Vocab([' "', "Hello", ",", '"', " she", " said", "."])
    assert merged_words(vocab, ' "', "Hello", ",", '"', " she", " said", ".") == [' "Hello,"', " she", " said."]


def test_opening_marks_join_the_next_word_and_closing_marks_the_previous() -> None:
    vocab = Vocab([" (", " laughs", ")", " “", " well", "”", " ¿", " qué", "?", " he", " said", ":", " ok", "!"])
    assert merged_words(vocab, " (", " laughs", ")") == [" ( laughs)"]
    assert merged_words(vocab, " “", " well", "”") == [" “ well”"]
    assert merged_words(vocab, " ¿", " qué", "?") == [" ¿ qué?"]
    assert merged_words(vocab, " he", " said", ":", " ok", "!") == [" he", " said:", " ok!"]


def test_merged_words_keep_the_times_and_collect_the_tokens_of_their_letters() -> None:
    words = [WordTime(' "', 0.0, 0.2, 0, [1]), WordTime(" Hi", 0.2, 0.6, 0, [2]), WordTime('."', 0.6, 0.7, 0, [3])]
    (merged,) = merge_punctuation(words)
    assert (merged.word, merged.start, merged.end, merged.tokens) == (' " Hi."', 0.2, 0.6, [1, 2, 3])
    assert words[1].word == " Hi"  # the input is not modified


def test_a_lone_opening_mark_at_the_end_stays() -> None:
    assert [w.word for w in merge_punctuation(timed((" Hi", 0, 1), (" (", 1, 2)))] == [" Hi", " ("]


# --- clamps --------------------------------------------------------------------------------------------------------


def test_median_duration_ignores_zero_lengths_and_is_capped() -> None:
    assert median_duration(timed(("a", 0, 0.2), ("b", 0.2, 0.2), ("c", 0.2, 0.6))) == pytest.approx(0.3)
    assert median_duration(timed(("a", 0, 2), ("b", 2, 4))) == 0.7
    assert median_duration(timed(("a", 1, 1))) == 0.0


def test_long_sentence_end_marks_and_the_words_after_them_are_clamped() -> None:
    words = timed((" Yes", 0.0, 0.3), (".", 0.3, 3.0), (" Then", 3.0, 6.0), (" go", 6.0, 6.3))
    clamp_sentence_ends(words, 0.6)
    assert [(w.start, w.end) for w in words] == [(0.0, 0.3), (0.3, pytest.approx(0.9)), (5.4, 6.0), (6.0, 6.3)]


def test_long_words_elsewhere_are_left_alone() -> None:
    words = timed((" Yes", 0.0, 0.3), (" well", 0.3, 3.0), (" go", 3.0, 3.3))
    clamp_sentence_ends(words, 0.6)
    assert (words[1].start, words[1].end) == (0.3, 3.0)


def test_words_after_a_long_pause_last_at_most_two_medians() -> None:
    words = timed((" After", 10.0, 14.0), (" a", 14.0, 14.2))
    clamp_after_pause(words, last_speech_time=5.0, median=0.3, floor=10.0)
    assert words[0].start == pytest.approx(13.4) and words[0].end == 14.0

    words = timed((" After", 10.0, 11.0), (" that", 11.0, 14.0))
    clamp_after_pause(words, last_speech_time=5.0, median=0.3, floor=10.0)
    assert words[0].end == words[1].start == pytest.approx(13.4)
    assert words[0].start == pytest.approx(12.8)


def test_no_pause_no_clamp() -> None:
    words = timed((" After", 10.0, 14.0), (" a", 14.0, 14.2))
    clamp_after_pause(words, last_speech_time=13.5, median=0.3, floor=10.0)
    assert (words[0].start, words[0].end) == (10.0, 14.0)


def test_segment_bounds_trim_words_that_stick_out_or_follow_them() -> None:
    words = timed((" So", 1.0, 3.0), (" it", 3.0, 3.2), (" goes", 3.2, 6.0))
    start, end = fit_segment_bounds(words, SegmentSpan(2.0, 4.0, 0, 3), median=0.3, floor=0.0)
    assert (start, end) == (2.0, 4.0)
    assert words[0].start == 2.0 and words[-1].end == 4.0

    words = timed((" So", 2.2, 3.0), (" it", 3.0, 3.8))
    assert fit_segment_bounds(words, SegmentSpan(2.0, 4.0, 0, 2), median=0.3, floor=0.0) == (2.2, 3.8)


# --- the whole window ----------------------------------------------------------------------------------------------

SENTENCE = [" The", " qu", "ick", " brown", " fox", " jump", "s", ".", " It", " ran", "."]
# Start of each token's band in encoder positions; the end of text starts at END.
STARTS = [0, 12, 20, 31, 50, 64, 80, 88, 93, 110, 128]
END = 134


def synthetic_weights(
    starts: list[int], end: int, num_frames: int, total_frames: int, *, heads: int = 3, seed: int = 0
) -> torch.Tensor:
    """Each row attends to its token's band of positions (the last row to the silence after the text), with noise;
    padding positions carry a strong decoy that would pull the first token to the end if they were kept."""
    rng = np.random.default_rng(seed)
    bounds = [*starts, end, num_frames]
    logits = rng.normal(0.0, 0.5, size=(heads, len(bounds) - 1, total_frames))
    for row in range(len(bounds) - 1):
        logits[:, row, bounds[row] : bounds[row + 1]] += 4.0
    logits[:, 0, num_frames:] += 12.0
    return torch.from_numpy(logits).softmax(dim=-1).float()


def word_truth(vocab_words: list[str], starts: list[int], end: int) -> list[tuple[float, float]]:
    first_tokens = [k for k, piece in enumerate(vocab_words) if piece.startswith(" ") or piece == "."]
    bounds = [starts[k] for k in first_tokens] + [end]
    return [(bounds[k] * 0.02, bounds[k + 1] * 0.02) for k in range(len(first_tokens))]


@pytest.mark.parametrize("seed", range(4))
def test_synthetic_alignment_recovers_the_word_times(seed: int) -> None:
    vocab = Vocab(SENTENCE)
    weights = synthetic_weights(STARTS, END, num_frames=150, total_frames=1500, seed=seed)
    result = word_timestamps(
        weights, num_frames=150, text_tokens=list(range(len(SENTENCE))), decode=vocab.decode, window_start=30.0
    )
    assert [w.word for w in result.words] == [" The", " quick", " brown", " fox", " jumps.", " It", " ran."]
    truth = word_truth(SENTENCE, STARTS, END)
    # Appended marks keep their word's times: " jumps." ends where "." starts (truth index 5 is the ".").
    expected = [truth[0], truth[1], truth[2], truth[3], truth[4], truth[6], (truth[7][0], truth[8][0])]
    for word, (start, end) in zip(result.words, expected, strict=True):
        assert word.start == pytest.approx(30.0 + start, abs=0.045), word
        assert word.end == pytest.approx(30.0 + end, abs=0.045), word
    assert_ordered_inside(result.words, 30.0, 33.0)
    assert result.last_speech_time == result.words[-1].end


def assert_ordered_inside(words: list[WordTime], start: float, end: float) -> None:
    times = [t for word in words for t in (word.start, word.end)]
    assert times == sorted(times)
    assert all(start <= t <= end for t in times)


def test_padding_positions_are_ignored() -> None:
    vocab = Vocab(SENTENCE)
    ids = list(range(len(SENTENCE)))
    weights = synthetic_weights(STARTS, END, num_frames=150, total_frames=1500)
    other = weights.clone()
    other[:, :, 150:] = torch.rand(other[:, :, 150:].shape)
    first = word_timestamps(weights, num_frames=150, text_tokens=ids, decode=vocab.decode, window_start=0.0)
    second = word_timestamps(other, num_frames=150, text_tokens=ids, decode=vocab.decode, window_start=0.0)
    assert first == second
    as_numpy = word_timestamps(weights.numpy(), num_frames=150, text_tokens=ids, decode=vocab.decode, window_start=0.0)
    assert as_numpy == first
    assert first.words[-1].end <= 3.0


def test_segments_get_their_own_words_and_bounds() -> None:
    vocab = Vocab(SENTENCE)
    weights = synthetic_weights(STARTS, END, num_frames=150, total_frames=1500)
    spans = [SegmentSpan(0.0, 1.86, 0, 8), SegmentSpan(1.86, 2.7, 8, 11)]
    result = word_timestamps(
        weights, num_frames=150, text_tokens=list(range(11)), decode=vocab.decode, window_start=0.0, segments=spans
    )
    assert [(w.word, w.segment) for w in result.words] == [
        (" The", 0), (" quick", 0), (" brown", 0), (" fox", 0), (" jumps.", 0), (" It", 1), (" ran.", 1),
    ]  # fmt: skip
    assert [w.tokens for w in result.words][-1] == [9, 10]
    for index, (start, end) in enumerate(result.segments):
        mine = [w for w in result.words if w.segment == index]
        assert start <= mine[0].start and mine[-1].end <= end


def test_punctuation_does_not_cross_a_segment_boundary() -> None:
    vocab = Vocab([" Hi", ' "', " there", "."])
    weights = synthetic_weights([0, 10, 20, 30], 35, num_frames=50, total_frames=60)
    spans = [SegmentSpan(0.0, 0.4, 0, 2), SegmentSpan(0.4, 0.7, 2, 4)]
    result = word_timestamps(
        weights, num_frames=50, text_tokens=[0, 1, 2, 3], decode=vocab.decode, window_start=0.0, segments=spans
    )
    assert [(w.word, w.segment) for w in result.words] == [(" Hi", 0), (' "', 0), (" there.", 1)]


def test_a_long_first_word_after_silence_is_clamped() -> None:
    # Four seconds of silence, then speech; the first token attends to the silence too, as Whisper's often does.
    pieces = [" After", " the", " rain", " we", " left", "."]
    starts = [0, 215, 228, 243, 256, 270]
    vocab = Vocab(pieces)
    weights = synthetic_weights(starts, 275, num_frames=400, total_frames=1500)
    result = word_timestamps(
        weights, num_frames=400, text_tokens=list(range(6)), decode=vocab.decode, window_start=60.0,
        last_speech_time=52.0,
    )  # fmt: skip
    first = result.words[0]
    median = median_duration(timed(*[(w.word, w.start, w.end) for w in result.words[1:]]))
    assert first.end == pytest.approx(60.0 + 215 * 0.02, abs=0.045)
    assert first.end - first.start <= 2 * 0.7 + 1e-9
    assert first.start > 60.0 + 150 * 0.02 and median > 0
    assert_ordered_inside(result.words, 60.0, 68.0)


@pytest.mark.parametrize("seed", range(5))
def test_noise_still_gives_ordered_words_inside_the_window_and_segments(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pieces = [" a", " b", "c", ".", " d", " (", " e", ")", " f", "!"]
    vocab = Vocab(pieces)
    n, frames = len(pieces), int(rng.integers(5, 120))
    weights = torch.from_numpy(rng.random((2, n + 1, 200))).softmax(dim=-1)
    cut = int(rng.integers(0, n + 1))
    spans = [
        SegmentSpan(5.0, 5.0 + frames * 0.01, 0, cut),
        SegmentSpan(5.0 + frames * 0.01, 5.0 + frames * 0.02, cut, n),
    ]
    result = word_timestamps(
        weights, num_frames=frames, text_tokens=list(range(n)), decode=vocab.decode, window_start=5.0, segments=spans,
        last_speech_time=float(rng.uniform(0, 5)),
    )  # fmt: skip
    assert_ordered_inside(result.words, 5.0, round(5.0 + frames * 0.02, 2))
    assert "".join(w.word for w in result.words) == vocab.decode(list(range(n)))
    for index, (start, end) in enumerate(result.segments):
        for word in (w for w in result.words if w.segment == index):
            assert start <= word.start <= word.end <= end


def test_no_text_gives_no_words() -> None:
    result = word_timestamps(
        torch.rand(2, 1, 10), num_frames=10, text_tokens=[], decode=lambda ids: "", window_start=1.0,
        last_speech_time=0.5,
    )  # fmt: skip
    assert result.words == [] and result.last_speech_time == 0.5 and result.segments == [(1.0, 1.2)]


@pytest.mark.parametrize(
    ("shape", "num_frames"),
    [((2, 3, 10), 10), ((2, 4, 10), 11), ((2, 4, 10), 0), ((4, 10), 10)],
)
def test_bad_shapes_are_refused(shape: tuple[int, ...], num_frames: int) -> None:
    with pytest.raises(ValueError):
        word_timestamps(
            torch.rand(shape), num_frames=num_frames, text_tokens=[0, 1, 2], decode=lambda ids: "x", window_start=0.0
        )


def test_segments_must_cover_the_tokens() -> None:
    spans = [SegmentSpan(0.0, 1.0, 0, 1), SegmentSpan(1.0, 2.0, 2, 3)]
    with pytest.raises(ValueError):
        word_timestamps(
            torch.rand(1, 4, 10), num_frames=10, text_tokens=[0, 1, 2], decode=lambda ids: "x", window_start=0.0,
            segments=spans,
        )  # fmt: skip


def test_token_starts_on_a_full_window_follow_the_bands() -> None:
    # 120 tokens, each strongest on its own 12 positions of a 1500-position window. With negative costs a row step
    # onto a noisy cell can pay, so a token may start one position early.
    matrix = np.random.default_rng(0).normal(0.0, 0.3, size=(120, 1500))
    for row in range(120):
        matrix[row, row * 12 : (row + 1) * 12] += 3.0
    np.testing.assert_allclose(token_start_times(matrix), np.arange(120) * 12 * 0.02, rtol=0, atol=0.02 + 1e-9)
