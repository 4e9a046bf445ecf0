"""WhisperRunner on a tiny random Whisper: windows batched under continuous batching give each window's own logits,
with sdpa's cross-attention and with the kernel that reads the rows' cross-attention K/V in place."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

from tests.runner_driver import RunnerDriver
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.runners.kernels import paged_decode_kernel
from transformers_openai.runners.steps.step_store import has_cxx_compiler
from transformers_openai.runners.whisper import WINDOW_FRAMES, WhisperRunner

torch.set_num_threads(1)

SOT, EOT, NO_CAPTIONS, NO_TIMESTAMPS, PREV = 50, 51, 59, 60, 49
STEPS = 8


@pytest.fixture(scope="module")
def model() -> WhisperForConditionalGeneration:
    config = WhisperConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=SOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        bos_token_id=EOT,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    model.set_attn_implementation("sdpa")  # as served; the alignment test compares against eager
    model.generation_config = GenerationConfig.from_model_config(config)
    model.generation_config.no_timestamps_token_id = NO_TIMESTAMPS
    return model


@pytest.fixture(scope="module")
def in_place_model(model) -> WhisperForConditionalGeneration:
    """A copy of the model, for a runner that switches its decode steps' cross-attention to the kernel."""
    if not has_cxx_compiler():
        pytest.skip("the kernel is built with a C++ compiler")
    return copy.deepcopy(model)


def window(seed: int) -> torch.Tensor:
    return torch.randn(80, WINDOW_FRAMES, generator=torch.Generator().manual_seed(seed))


WINDOWS = [
    (window(1), [SOT, NO_TIMESTAMPS]),
    (window(2), [PREV, 7, 8, 9, SOT]),  # a carried prompt, timestamps on
    (window(3), [SOT]),
    (window(4), [PREV, 3, SOT, NO_TIMESTAMPS]),
]


@torch.inference_mode()
def reference(model: WhisperForConditionalGeneration, features: torch.Tensor, prefix: list[int], feed: list[int]):
    """Logits of every step of one window alone, without any cache, teacher-forced with `feed`."""
    logits, tokens = [], list(prefix)
    for token in [None, *feed]:
        if token is not None:
            tokens.append(token)
        out = model(input_features=features.unsqueeze(0), decoder_input_ids=torch.tensor([tokens]))
        logits.append(out.logits[0, -1])
    return logits


@pytest.mark.parametrize("cross_attention", ["sdpa", "kernel"])
@torch.inference_mode()
def test_windows_joining_at_different_steps_each_get_their_own_logits(
    request: pytest.FixtureRequest, cross_attention: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    model = request.getfixturevalue("model" if cross_attention == "sdpa" else "in_place_model")
    calls = []
    kernel = paged_decode_kernel.cross_attention

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(paged_decode_kernel, "cross_attention", counted)
    whisper = WhisperRunner(model, max_rows=4)
    if cross_attention == "kernel":
        assert whisper.read_cross_in_place(tmp_path)
    assert whisper._cross_cache.keys_transposed == (cross_attention == "kernel")  # sdpa reads such keys slowly
    runner = RunnerDriver(whisper)
    jobs = [PrefillJob(prefix, {"input_features": features}) for features, prefix in WINDOWS]
    fed: dict[int, list[int]] = {}
    seen: dict[int, list[torch.Tensor]] = {}
    slot_of: dict[int, int] = {}
    last: dict[int, int] = {}
    for step in range(STEPS + 2 * len(WINDOWS)):
        if step % 2 == 0 and step // 2 < len(WINDOWS):  # a new window joins every other step
            i = step // 2
            result = runner.prefill(jobs[i], 10_000)
            assert result is not None
            slot_of[i], first = result
            seen[i], fed[i] = [first], []
            last[slot_of[i]] = int(first.argmax())
        live = {slot: token for slot, token in last.items()}
        if not live:
            continue
        order, logits = runner.decode(live)
        for row, slot in enumerate(order):
            i = next(k for k, s in slot_of.items() if s == slot)
            fed[i].append(live[slot])
            seen[i].append(logits[row])
            last[slot] = int(logits[row].argmax())
        for i, s in list(slot_of.items()):
            if len(fed[i]) >= STEPS and s in last:
                runner.release(s)
                del last[s]
    assert runner.rows_in_use() == 0
    # The kernel: every decode step's cross-attention in every layer, and nothing else (the encoder, the prefixes,
    # the self-attention and the references below stay with sdpa).
    decode_steps = sum(len(got) - 1 for got in seen.values())
    if cross_attention == "kernel":
        assert sum(calls) == decode_steps * model.config.decoder_layers
    else:
        assert not calls
    for i, (features, prefix) in enumerate(WINDOWS):
        expected = reference(model, features, prefix, fed[i][:STEPS])
        for step, (got, want) in enumerate(zip(seen[i], expected, strict=False)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=f"window {i} step {step}")


@torch.inference_mode()
def test_no_speech_probability_is_read_after_the_start_of_transcript(model) -> None:
    runner = WhisperRunner(model, max_rows=2)
    features, prefix = WINDOWS[1]
    job = PrefillJob(prefix, {"input_features": features})
    RunnerDriver(runner).prefill(job, 10_000)
    out = model(input_features=features.unsqueeze(0), decoder_input_ids=torch.tensor([prefix]))
    at_sot = out.logits[0, prefix.index(SOT)].softmax(-1)
    assert job.info["no_speech_prob"] == pytest.approx(float(at_sot[NO_CAPTIONS]), abs=1e-6)
    assert runner.spec.output_limit(len(prefix)) == 448 - len(prefix)


def test_a_window_of_the_wrong_length_is_refused(model) -> None:
    runner = WhisperRunner(model, max_rows=1)
    driver = RunnerDriver(runner)
    with pytest.raises(ValueError, match="3000"):
        driver.prefill(PrefillJob([SOT], {"input_features": torch.zeros(80, 100)}), 10_000)
    assert driver.rows_in_use() == 0 and driver.kv_usage().blocks_used == 0 and not runner._cross_cache.rows


@torch.inference_mode()
def test_alignment_weights_equal_the_eager_cross_attention_of_the_alignment_heads(model) -> None:
    model.generation_config.alignment_heads = [[1, 0], [1, 1], [0, 1]]
    runner = WhisperRunner(model, max_rows=1)
    features, prefix = WINDOWS[0]
    tokens = [*prefix, 11, 12, 13, EOT]
    weights = runner.alignment_weights(features, tokens)
    eager = WhisperForConditionalGeneration(copy.deepcopy(model.config)).eval()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    out = eager(input_features=features.unsqueeze(0), decoder_input_ids=torch.tensor([tokens]), output_attentions=True)
    expected = torch.stack([out.cross_attentions[layer][0, head] for layer, head in [(1, 0), (1, 1), (0, 1)]])
    assert weights.shape == (3, len(tokens), 1500)
    torch.testing.assert_close(weights, expected, rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the shared model is left as it was
    assert not runner._cross_cache.rows  # outside the batch: no row


def test_language_detection_picks_the_likeliest_language_token(model: WhisperForConditionalGeneration) -> None:
    runner = WhisperRunner(model, max_rows=2)
    languages = [52, 53, 54, 55, 56]
    for seed in (1, 2, 3):
        features = window(seed)
        with torch.inference_mode():
            logits = model(input_features=features.unsqueeze(0), decoder_input_ids=torch.tensor([[SOT]])).logits[0, -1]
        assert runner.detect_language(features, SOT, languages) == languages[int(logits[languages].argmax())]
    assert not runner._cross_cache.rows  # outside the batch: no row
    calls: list[int] = []
    hook = model.model.encoder.conv1.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    try:
        runner.detect_language(window(4), SOT, languages, window=("req", 0))
        job = PrefillJob([SOT], {"input_features": window(4), "window": ("req", 0)})
        assert runner.prefill_cost(job.encoder_inputs) == 0
        RunnerDriver(runner).prefill(job, 10_000)
    finally:
        hook.remove()
    assert calls == [1]  # the window's prefill reused the encoder pass of the detection


@torch.inference_mode()
def test_windows_admitted_together_share_one_encoder_call_and_fail_alone(model) -> None:
    runner = WhisperRunner(model, max_rows=4)
    calls: list[int] = []
    hook = model.model.encoder.conv1.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    bad = PrefillJob([SOT], {"input_features": torch.zeros(80, 100)})
    jobs = [PrefillJob(prefix, {"input_features": features}) for features, prefix in WINDOWS[:3]]
    try:
        admitted = [(jobs[0], 10_000), (bad, 10_000), (jobs[1], 10_000), (jobs[2], 10_000)]
        driver = RunnerDriver(runner)
        outcomes = driver.prefill_batch(admitted)
        assert isinstance(outcomes[1], ValueError) and all(isinstance(o, tuple) for o in outcomes[::2])
        assert calls == [1, 1, 1]  # the batch could not be built: one encoder call per good window
    finally:
        hook.remove()
    calls.clear()
    assert driver.rows_in_use() == 3 and runner._cross_cache.rows == 3
    hook = model.model.encoder.conv1.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    try:
        fresh = WhisperRunner(model, max_rows=4)
        windows = [(PrefillJob(prefix, {"input_features": f}), 10_000) for f, prefix in WINDOWS]
        batched = RunnerDriver(fresh).prefill_batch(windows)
    finally:
        hook.remove()
    assert calls == [len(WINDOWS)]  # one encoder call for all four windows
    for (features, prefix), outcome in zip(WINDOWS, batched, strict=True):
        assert not isinstance(outcome, Exception) and outcome is not None
        expected = reference(model, features, prefix, [])[0]
        torch.testing.assert_close(outcome[1], expected, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_prefill_hands_the_cache_over_under_the_keyword_the_model_takes(model) -> None:
    # The prefill calls the encoder-decoder without its head (`model.model`): its keyword is read from that module.
    runner = WhisperRunner(model, max_rows=2)
    features, prefix = WINDOWS[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunnerDriver(runner).prefill(PrefillJob(prefix, {"input_features": features}), 10_000)
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []


@torch.inference_mode()
def test_a_kept_window_serves_its_own_transcription_only_and_is_dropped_when_it_ends(model) -> None:
    """The encoder output of a window is reused for that window of that transcription alone: another transcription's
    window of the same number is encoded from its own audio, a transcription's next window replaces its last, and
    nothing stays once the transcription is released."""
    runner = WhisperRunner(model, max_rows=4)
    driver = RunnerDriver(runner)
    calls: list[int] = []
    hook = model.model.encoder.conv1.register_forward_hook(lambda _, args, __: calls.append(args[0].shape[0]))
    (audio_a, prefix), (audio_b, _) = WINDOWS[0], WINDOWS[1]
    try:
        first = driver.prefill(PrefillJob(prefix, {"input_features": audio_a, "window": ("a", 0)}), 10_000)
        other = PrefillJob(prefix, {"input_features": audio_b, "window": ("b", 0)})
        # Not A's window: it needs its encoder pass.
        assert runner.prefill_cost(other.encoder_inputs) == runner.max_input_len
        second = driver.prefill(other, 10_000)
        retry = PrefillJob(prefix, {"input_features": audio_a, "window": ("a", 0)})
        assert runner.prefill_cost(retry.encoder_inputs) == 0
        driver.prefill(retry, 10_000)
        assert calls == [1, 1]  # the retry of A's window reused its encoder pass
        assert sorted(runner.kept_windows()) == [("a", 0), ("b", 0)]
        driver.prefill(PrefillJob(prefix, {"input_features": audio_b, "window": ("a", 1)}), 10_000)
        assert sorted(runner.kept_windows()) == [("a", 1), ("b", 0)]  # A's first window is done with
    finally:
        hook.remove()
    assert first is not None and second is not None
    torch.testing.assert_close(first[1], reference(model, audio_a, prefix, [])[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(second[1], reference(model, audio_b, prefix, [])[0], rtol=0, atol=1e-4)
    runner.release_windows("a")
    runner.release_windows("b")
    runner.release_windows("never-seen")  # idempotent, and harmless for a key it does not know
    assert runner.kept_windows() == []


def test_kept_windows_are_bounded_by_the_rows(model) -> None:
    runner = WhisperRunner(model, max_rows=2)
    for key in ("a", "b", "c"):
        runner.detect_language(window(1), SOT, [52, 53], window=(key, 0))
    assert runner.kept_windows() == [("b", 0), ("c", 0)]
