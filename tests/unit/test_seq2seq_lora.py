"""LoRA adapters on the encoder-decoder runners: T5 rows with adapter A, adapter B and none, prefilled and decoded
together, each get their own PEFT model's logits (encoder, cross-attention and decoder adapted); a Whisper window's
kept encoder output is reused by a row with the adapter it was encoded with, never by another, and an adapter on the
feed-forward's first layer is added before its GELU even where packing fused the GELU into that layer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import T5Config, T5ForConditionalGeneration, WhisperConfig, WhisperForConditionalGeneration

from tests.runner_driver import RunnerDriver
from transformers_openai.engine.prefill import PrefillJob
from transformers_openai.runners.lora.adapter import LoraAdapter, read_adapter
from transformers_openai.runners.packed_linear import PackedLinear, pack_linear_layers
from transformers_openai.runners.seq2seq import Seq2SeqRunner
from transformers_openai.runners.whisper import WINDOW_FRAMES, WhisperRunner

torch.set_num_threads(1)

CPU = torch.device("cpu")
INPUTS = [[5, 9, 14, 3, 1], [7, 2, 1], [11, 4, 6, 8, 10, 12, 1]]
STEPS = 4


def _t5() -> T5ForConditionalGeneration:
    config = T5Config(  # type: ignore[call-arg]  # decoder_start_token_id reaches PretrainedConfig via **kwargs
        vocab_size=48,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).eval()


def _peft(base: torch.nn.Module, path: Path, seed: int, targets: list[str], shapes: dict[str, tuple[int, int]]):
    """A PEFT model on a copy of `base` with random LoRA weights on `targets`, saved at `path` and read back as the
    runner reads adapters."""
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(str(path))
    adapter = read_adapter(path.name, path.name, path, shapes, 8, torch.float32, CPU)
    return model.eval(), adapter


@torch.inference_mode()
def _reference(model: Any, input_ids: list[int], decoder_ids: list[int]) -> torch.Tensor:
    """Next-token logits of one request alone, uncached: `model`'s (a PEFT model, or the base)."""
    out = model(input_ids=torch.tensor([input_ids]), decoder_input_ids=torch.tensor([decoder_ids]))
    return out.logits[0, -1]


def test_t5_rows_with_different_adapters_in_one_batch_get_their_own_peft_logits(tmp_path: Path) -> None:
    base = _t5()
    runner = Seq2SeqRunner(copy.deepcopy(base), max_rows=4, max_model_len=32, max_input_len=16)
    shapes = runner.serve_adapters()
    assert "encoder.block.0.layer.0.SelfAttention.q" in shapes and "decoder.block.1.layer.1.EncDecAttention.v" in shapes
    peft_a, lora_a = _peft(base, tmp_path / "a", 1, ["q", "v"], shapes)
    peft_b, lora_b = _peft(base, tmp_path / "b", 2, ["q", "v"], shapes)
    models: list[Any] = [peft_a, base, peft_b]
    loras: list[LoraAdapter | None] = [lora_a, None, lora_b]
    driver = RunnerDriver(runner)
    fed: dict[int, list[int]] = {}
    logits: dict[int, torch.Tensor] = {}
    for row, (ids, lora) in enumerate(zip(INPUTS, loras, strict=True)):
        job = PrefillJob([0], {"input_ids": ids}, lora=lora)
        result = driver.prefill(job, 64)
        assert result is not None
        assert result[0] == row
        fed[row], logits[row] = [0], result[1]
    for step in range(STEPS + 1):
        for row, model in enumerate(models):
            expected = _reference(model, INPUTS[row], fed[row])
            torch.testing.assert_close(logits[row], expected, rtol=0, atol=1e-4, msg=f"row {row}, step {step}")
        tokens = {row: int(row_logits.argmax()) for row, row_logits in logits.items()}
        order, batch = driver.decode(tokens)
        for i, row in enumerate(order):
            fed[row].append(tokens[row])
            logits[row] = batch[i]
    different = [_reference(model, INPUTS[0], [0]) for model in models]
    assert not torch.allclose(different[0], different[1]) and not torch.allclose(different[2], different[1])


def test_a_kept_whisper_window_is_encoded_again_for_another_adapter_fc1_before_its_gelu(tmp_path: Path) -> None:
    config = WhisperConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        decoder_start_token_id=50,
        eos_token_id=51,
        pad_token_id=51,
    )
    torch.manual_seed(0)
    base = WhisperForConditionalGeneration(config).eval()
    packed = copy.deepcopy(base)
    pack_linear_layers(packed)
    fc1 = packed.model.encoder.layers[0].fc1
    assert isinstance(fc1, PackedLinear) and fc1.activation == "gelu"  # the GELU fused into it, as served
    runner = WhisperRunner(packed, max_rows=2)
    shapes = runner.serve_adapters()
    peft_a, lora_a = _peft(base, tmp_path / "a", 1, ["q_proj", "v_proj", "fc1"], shapes)
    encodings: list[int] = []
    hook = runner.model.model.encoder.register_forward_hook(lambda *_: encodings.append(1))
    audio = torch.randn(80, WINDOW_FRAMES, generator=torch.Generator().manual_seed(3))
    driver = RunnerDriver(runner)
    try:
        runner.detect_language(audio, 50, [52, 53], window=("t", 0), lora=lora_a)  # keeps the window under A
        base_row = driver.prefill(PrefillJob([50], {"input_features": audio, "window": ("t", 0)}), 10)
        assert len(encodings) == 2  # the base row encoded the window itself
        lora_row = driver.prefill(PrefillJob([50], {"input_features": audio, "window": ("t", 0)}, lora=lora_a), 10)
        assert len(encodings) == 3  # the window was kept for the base now: A's row encoded again
    finally:
        hook.remove()
    assert base_row is not None and lora_row is not None
    features = audio[None]
    with torch.inference_mode():
        for row, model in ((base_row, base), (lora_row, peft_a)):
            expected = model(input_features=features, decoder_input_ids=torch.tensor([[50]])).logits[0, -1]
            torch.testing.assert_close(row[1], expected, rtol=0, atol=1e-4)
