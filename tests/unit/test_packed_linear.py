"""Linear layers packed for oneDNN compute what `nn.Linear` does, and a packed model serves as the plain one does;
an activation moved into its packed layer gives the same values, and is moved only where the layer's forward applies
it straight to that layer's product."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, WhisperForConditionalGeneration

from tests.model_factory import build_tiny_t5, cache_root
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.request import EngineRequest
from transformers_openai.engine.sampling_params import SamplingParams
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.packed_linear import PackedLinear, can_pack, fuse_activations, pack_linear_layers
from transformers_openai.serving.tokenizer import engine_decoder

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not can_pack(torch.float32), reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7,), (1, 7), (16, 7), (2, 5, 7), (3, 1, 7)])
def test_a_packed_layer_computes_what_the_plain_one_does(bias: bool, shape: tuple[int, ...]) -> None:
    linear = torch.nn.Linear(7, 11, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        packed, plain = PackedLinear(linear)(x), linear(x)
    assert packed.shape == plain.shape == (*shape[:-1], 11)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def _resident_bytes_of(path: Path, model: torch.nn.Module) -> int:
    """Resident bytes of the maps of `path` that hold `model`'s tensors (/proc/self/smaps): other tests of the
    same process may have mapped the same file for their own models."""
    addresses = [t.data_ptr() for t in (*model.parameters(), *model.buffers()) if t.layout == torch.strided]
    total, counted = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                start, end = (int(address, 16) for address in fields[0].split("-"))
                counted = (
                    len(fields) >= 6 and fields[5] == str(path) and any(start <= address < end for address in addresses)
                )
            elif counted and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="pages of file maps are given back on Linux only")
def test_packing_gives_back_the_file_pages_of_the_packed_weights(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    weights = (tiny_llama_dir / "model.safetensors").resolve()
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))  # every weight read once: its pages resident
    linear_bytes = sum(m.weight.nbytes for m in model.modules() if type(m) is torch.nn.Linear)
    other_bytes = sum(
        p.nbytes for n, p in model.named_parameters() if not n.endswith("proj.weight") and not n.startswith("lm_head")
    )
    before = _resident_bytes_of(weights, model)
    assert before >= linear_bytes  # the map is there, its pages resident
    assert pack_linear_layers(model) > 0
    after = _resident_bytes_of(weights, model)
    pages_at_edges = 2 * 4096 * sum(1 for _ in model.parameters())
    assert after <= other_bytes + pages_at_edges < before


@pytest.fixture(scope="module")
def plain_and_packed(tiny_llama_dir: Path):
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    packed = copy.deepcopy(plain)
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert pack_linear_layers(packed) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    return plain, packed


def test_a_packed_model_gives_the_plain_models_logits(plain_and_packed) -> None:
    plain, packed = plain_and_packed
    ids = torch.randint(0, plain.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_batched_greedy_on_a_packed_model_equals_its_generate_alone(plain_and_packed, tiny_llama_dir: Path) -> None:
    _, packed = plain_and_packed
    runner = CausalLMRunner(packed, max_rows=4, max_model_len=256)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    core = EngineCore(runner, engine_decoder(tokenizer), Scheduler(max_running=4, max_waiting=8), frozenset())
    prompts = [[5 + i for i in range(n)] for n in (3, 19, 8, 30, 12, 1)]
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
    for i, prompt in enumerate(prompts):
        core.add(EngineRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for output in core.step():
            tokens[output.request_id].extend(output.token_ids)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = packed.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )[0, len(prompt) :].tolist()
        assert tokens[f"r{i}"] == expected, i


M = TypeVar("M", bound=torch.nn.Module)


def _packed_copy(model: M) -> M:
    packed = copy.deepcopy(model)
    assert pack_linear_layers(packed) > 0
    return packed


def test_a_packed_t5_gives_the_plain_models_logits() -> None:
    """T5's feed-forward reads `wo.weight.dtype`: the packed layer answers it and the logits stay the same."""
    plain = AutoModelForSeq2SeqLM.from_pretrained(build_tiny_t5(cache_root() / "tiny-t5"), dtype=torch.float32).eval()
    packed = _packed_copy(plain)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, plain.config.vocab_size, (2, 13), generator=generator)
    decoder_ids = torch.randint(0, plain.config.vocab_size, (2, 5), generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(
            packed(input_ids=ids, decoder_input_ids=decoder_ids).logits,
            plain(input_ids=ids, decoder_input_ids=decoder_ids).logits,
            rtol=1e-4,
            atol=1e-4,
        )


def test_a_packed_whisper_gives_the_plain_models_logits(whisper_dir: Path) -> None:
    plain = WhisperForConditionalGeneration.from_pretrained(whisper_dir, dtype=torch.float32).eval()
    packed = _packed_copy(plain)
    assert isinstance(packed.proj_out, PackedLinear)  # tied to the decoder's embeddings: packed as a copy
    table = packed.model.decoder.embed_tokens.weight
    torch.testing.assert_close(table, plain.model.decoder.embed_tokens.weight, rtol=0, atol=0)  # the table stays
    layers = [*packed.model.encoder.layers, *packed.model.decoder.layers]
    # Each feed-forward's GELU applied by its packed first layer.
    assert all(layer.fc1.activation == "gelu" for layer in layers)
    assert all(isinstance(layer.activation_fn, torch.nn.Identity) for layer in layers)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, plain.config.num_mel_bins, 3000, generator=generator)
    decoder_ids = torch.tensor([[plain.config.decoder_start_token_id, 50362, 464, 3290]])
    with torch.inference_mode():
        torch.testing.assert_close(
            packed(input_features=features, decoder_input_ids=decoder_ids).logits,
            plain(input_features=features, decoder_input_ids=decoder_ids).logits,
            rtol=1e-3,
            atol=1e-3,
        )


@pytest.mark.parametrize("shape", [(5, 16), (2, 300, 16)])
def test_a_packed_layer_applying_gelu_gives_gelu_of_its_product(shape: tuple[int, ...]) -> None:
    linear = torch.nn.Linear(16, 64)
    packed = PackedLinear(linear)
    packed.activation = "gelu"
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), torch.nn.functional.gelu(linear(x)), rtol=1e-5, atol=1e-5)


class WhisperEncoderLayer(torch.nn.Module):  # named as a fusible layer, but its activation is used twice
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.activation_fn = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation_fn(self.fc1(x)) + self.activation_fn(x)


def test_an_activation_the_forward_also_applies_elsewhere_stays_where_it_is() -> None:
    layer = WhisperEncoderLayer()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = layer(x)
        assert pack_linear_layers(layer) == 1
        assert fuse_activations(layer) == 0 and isinstance(layer.activation_fn, torch.nn.GELU)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
