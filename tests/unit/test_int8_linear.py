"""Int8 layers: close to the float product, each row independent of its batch, the output layer left alone; int8
products chosen only where the CPU has int8 dot-product instructions (flags injected), float ones over int8-rounded
weights elsewhere."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.quantized_models import build_compressed_tensors
from transformers_openai.int8_linear import (
    Int8Linear,
    choose_products,
    cpu_flags,
    int8_time_ratio,
    quantize_linear_layers,
    quantize_per_channel,
    round_linear_weights,
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


def small_llama(tied: bool, layers: int = 2) -> LlamaConfig:
    """A Llama of `layers` layers 64 wide over 128 tokens, its output layer tied to the input embeddings or not."""
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def test_every_linear_but_the_output_layer_is_swapped() -> None:
    config = small_llama(tied=False)
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


AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
VNNI_XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni\n"
ARM_DOTPROD = "processor\t: 0\nFeatures\t: fp asimd crc32 asimddp\n"


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo() -> None:
    assert {"avx2", "fma"} <= cpu_flags(AVX2_EPYC) and "avx512_vnni" not in cpu_flags(AVX2_EPYC)
    assert "avx512_vnni" in cpu_flags(VNNI_XEON)
    assert "asimddp" in cpu_flags(ARM_DOTPROD)


def test_int8_products_only_where_the_cpu_has_int8_dot_products_and_they_measure_fast() -> None:
    def never() -> float:
        raise AssertionError("no measurement without the instructions")

    avx2 = choose_products("auto", cpu_flags(AVX2_EPYC), measure=never)
    assert not avx2.int8 and "avx512_vnni" in avx2.reason  # the missing instructions are named
    assert choose_products("auto", cpu_flags(VNNI_XEON), measure=lambda: 0.6).int8
    assert choose_products("auto", cpu_flags(ARM_DOTPROD), measure=lambda: 0.8).int8
    slow = choose_products("auto", cpu_flags(VNNI_XEON), measure=lambda: 3.5)  # flags, but no kernel behind them
    assert not slow.int8 and "3.50x" in slow.reason
    assert choose_products("int8", cpu_flags(AVX2_EPYC), measure=never).int8  # asked for: as asked
    assert not choose_products("float", cpu_flags(VNNI_XEON), measure=never).int8
    assert choose_products("auto", cpu_flags(VNNI_XEON), measure=int8_time_ratio).reason  # the real one runs


def test_float_products_keep_float_layers_with_int8_rounded_weights() -> None:
    config = small_llama(tied=False)
    model = LlamaForCausalLM(config).eval()
    head = model.lm_head.weight.detach().clone()
    up = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    assert round_linear_weights(model) == 2 * 7
    rounded = model.model.layers[1].mlp.up_proj
    assert type(rounded) is torch.nn.Linear and rounded.weight.dtype == torch.float32
    values, scale = quantize_per_channel(up)
    assert torch.equal(rounded.weight, values.float() * scale[:, None])
    assert torch.equal(model.lm_head.weight, head)  # the output layer keeps its weights


def test_the_output_layer_too_when_asked_and_the_tied_embeddings_keep_theirs() -> None:
    """`--int8-output-layer`: the output layer is rounded as the others are (int8 products, or int8-rounded float
    weights), in a copy of its own where it shares its weight with the input embeddings, which keep full precision."""
    config = small_llama(tied=True)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    for swap in (quantize_linear_layers, round_linear_weights):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        table = model.model.embed_tokens.weight.detach().clone()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        with torch.inference_mode():
            expected = model(ids).logits
            assert swap(model, output_layer=True) == 2 * 7 + 1
            got = model(ids).logits
        assert torch.equal(model.model.embed_tokens.weight, table)
        head = model.get_output_embeddings()
        if swap is quantize_linear_layers:
            assert isinstance(head, Int8Linear)
        else:
            values, scale = quantize_per_channel(table)
            assert type(head) is torch.nn.Linear and torch.equal(head.weight, values.float() * scale[:, None])
        assert not torch.equal(got, expected)
        assert torch.allclose(got, expected, atol=0.05 * float(expected.abs().max()))


def test_the_step_compiler_loads_int8_dynamic_with_the_products_chosen_here(tmp_path: Path) -> None:
    """`--int8-products auto` times an int8 layer at start; the child that compiles the decode steps must not time it
    again (on a busy machine it chose float products once, loaded a model of another layout and compiled steps the
    server could not use): it is handed the choice this process made, and only for int8-dynamic."""
    from transformers_openai import model_loader
    from transformers_openai.runners.kv.kv_pool import KVSpace
    from transformers_openai.settings import Settings

    config = small_llama(tied=False, layers=1)
    settings = Settings(model="unused", quantization="int8-dynamic", compile_cache_dir=tmp_path)
    assert settings.int8_products == "auto"
    kv = KVSpace(bytes=2**20, block_size=16)
    for swap, chosen in ((quantize_linear_layers, "int8"), (round_linear_weights, "float")):
        model = LlamaForCausalLM(config).eval()
        swap(model)
        acceleration = model_loader._acceleration(settings, model, "int8-dynamic", None, None, kv)
        child = acceleration.compile_elsewhere
        assert isinstance(child, partial) and child.args[0].int8_products == chosen
    plain = model_loader._acceleration(settings, LlamaForCausalLM(config), "none", None, None, kv)
    assert isinstance(plain.compile_elsewhere, partial) and plain.compile_elsewhere.args[0] is settings
