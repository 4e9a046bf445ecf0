"""Int8 layers: close to the float product, each row independent of its batch, the output layer left alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.quantized_models import build_compressed_tensors
from transformers_openai.int8_linear import (
    Int8Linear,
    quantize_linear_layers,
    quantize_per_channel,
    use_int8_for_compressed_tensors,
)


def test_per_channel_values_and_scales_rebuild_the_weight() -> None:
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    values, scale = quantize_per_channel(weight)
    assert values.dtype == torch.int8 and int(values.abs().max()) == 127
    assert torch.allclose(values.float() * scale[:, None], weight, atol=float(scale.max()) / 2 + 1e-6)


def test_a_row_gets_the_same_result_alone_and_in_a_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 80)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(9, 96, generator=generator)
    x[4] *= 50  # a row with large activations must not change the others' scales
    with torch.inference_mode():
        batched = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        expected = linear(x)
    assert torch.equal(batched, alone)
    error = (batched - expected).abs().max(dim=1).values / expected.abs().max(dim=1).values
    assert float(error.max()) < 0.03
    assert batched.shape == (9, 80) and layer(x.view(3, 3, 96)).shape == (3, 3, 80)


def test_every_linear_but_the_output_layer_is_swapped() -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = model(ids).logits
        swapped = quantize_linear_layers(model)
        got = model(ids).logits
    assert swapped == 2 * 7  # q, k, v, o, gate, up, down in each layer
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    assert torch.allclose(got, expected, atol=0.05 * float(expected.abs().max()))


def test_a_compressed_tensors_w8a8_model_computes_in_int8_as_its_own_layers_do(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    made = build_compressed_tensors(tiny_llama_dir, tmp_path / "w8a8", "W8A8")
    own = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32).eval()  # compressed-tensors' float forward
    ours = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32).eval()
    assert use_int8_for_compressed_tensors(ours) == 2 * 7
    assert not hasattr(ours.model.layers[0].mlp.up_proj, "quantization_scheme")
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected, got = own(ids).logits, ours(ids).logits
    assert isinstance(ours.model.layers[1].self_attn.o_proj, Int8Linear)  # the decompression hook did not undo it
    assert torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()))
