"""Linear layers that multiply in int8 on a CPU: int8 weights per output channel, int8 activations per token.

`--quantization int8-dynamic` on a CPU swaps a model's plain `nn.Linear` layers (not its output layer) for these.
Each token's activations are scaled to int8 by their own absolute maximum, so a row's result never depends on the
other rows of its batch (greedy outputs under batching stay those of the request alone), and the product runs
through `torch._int_mm`, oneDNN's integer matrix product (VNNI or AMX where the CPU has them). torchao's int8
tensors compute the same in eager mode through more work per call: one 576 x 1,536 layer of SmolLM2, one thread,
took 1.7-7.5x float32's time in torchao's int8 dynamic scheme (64 rows to 1), where these layers took 0.2-0.7x
(measured by hand on the development CPU); their speed on a CPU comes only under `torch.compile`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# CPU flags (/proc/cpuinfo) of instructions that multiply int8 vectors and add the products in int32 in one step,
# which oneDNN's integer product (`torch._int_mm`) is built on: x86's AVX-512 VNNI, AVX-VNNI and AMX, Arm's dot
# product and matrix multiply. Without them its product was 18-59x float32's time (AVX2 only, AMD EPYC).
NATIVE_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")
# The most a layer's whole int8 forward may take against the float32 product it replaces. Not 1: with VNNI an int8
# layer took 0.35-0.75x float32's time at one thread, but at two threads on a busy machine single measurements
# reached 2-2.5x, while without a native kernel it takes 18-59x.
MAX_INT8_TIME_RATIO = 3.0
# Inputs of at most this many rows go through the int8 matrix-vector kernel where a layer has its layout
# (`runners/kernels/int8_gemv_kernel.py`); more go to `torch._int_mm`, with the same bits.
KERNEL_MAX_ROWS = 4


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out x in) as int8 values in [-127, 127] and one float32 scale per output channel."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    values = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return values, scale


class Int8Linear(torch.nn.Module):
    """`y = x W^T + b` with `W` in int8 (per output channel scales) and `x` quantized per token as it comes."""

    weight_t: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    blocked_weight: torch.Tensor | None  # the int8 matrix-vector kernel's layout, where `use_rows_kernel` gave it
    weight_sums: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        # Stored as (in x out), the transposed view `_int_mm` takes without a copy.
        self.register_buffer("weight_t", weight.t())
        self.register_buffer("weight_scale", scale.float())
        self.register_buffer("bias", bias)
        self.register_buffer("blocked_weight", None)
        self.register_buffer("weight_sums", None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8Linear:
        values, scale = quantize_per_channel(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(values, scale, bias, linear.weight.dtype)

    @classmethod
    def from_compressed_tensors(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> Int8Linear | None:
        """The layer of a compressed-tensors W8A8 checkpoint (int8 weights per channel, int8 activations per token at
        run time, as `llm-compressor` writes them) still compressed, or None where its scheme is another."""
        scheme = getattr(linear, "quantization_scheme", None)
        weight, scale = getattr(linear, "weight", None), getattr(linear, "weight_scale", None)
        if scheme is None or weight is None or scale is None or weight.dtype != torch.int8:
            return None
        weights, inputs = scheme.weights, scheme.input_activations
        if weights is None or inputs is None or scheme.output_activations is not None:
            return None
        int8 = all(a.type == "int" and a.num_bits == 8 and a.symmetric for a in (weights, inputs))
        if not (int8 and weights.strategy == "channel" and inputs.strategy == "token" and inputs.dynamic):
            return None
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight.detach(), scale.detach().reshape(-1), bias, dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight (out x in), for code that inspects a layer's weight shape or device."""
        return self.weight_t.t()

    @property
    def takes_rows_kernel(self) -> bool:
        """Whether the int8 matrix-vector kernel computes this layer: its results are float32, which the `_int_mm`
        path's rescaled ones are only where the layer's float side is float32."""
        return self.dtype == torch.float32 and (self.bias is None or self.bias.dtype == torch.float32)

    def add_rows_kernel(self, blocked: torch.Tensor, sums: torch.Tensor) -> None:
        """Gives the layer the kernel's layout of its weight (`int8_gemv_kernel.block_weight`; the kernel must be
        loaded): inputs of at most `KERNEL_MAX_ROWS` rows then multiply through the kernel."""
        self.blocked_weight, self.weight_sums = blocked, sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor
        rows = x.reshape(-1, self.in_features).float()
        blocked, sums = self.blocked_weight, self.weight_sums
        if torch.compiler.is_compiling() and blocked is not None and sums is not None:
            # One opaque C++ operator in the graph: the kernel or the passes below, the same bits as eager.
            y = torch.ops.transformers_openai.int8_linear(
                rows, self.weight_t, self.weight_scale, self.bias, blocked, sums
            )
            return y.view(*x.shape[:-1], self.out_features)
        # 1-4 rows through the kernel, the same bits as below.
        if rows.shape[0] <= KERNEL_MAX_ROWS and blocked is not None and sums is not None:
            y = torch.ops.transformers_openai.int8_gemv(
                rows, blocked, sums, self.weight_scale, self.bias, self.out_features, 0
            )
            return y.view(*x.shape[:-1], self.out_features)
        # As compressed-tensors (llm-compressor's W8A8) has it: the row's extreme over 127.5, rounded into [-128, 127].
        x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.5
        x_int8 = torch.round(rows / x_scale).clamp(-128, 127).to(torch.int8)
        y = torch.mul(torch._int_mm(x_int8, self.weight_t), x_scale).mul_(self.weight_scale)  # two passes, not three
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rows_kernel = ", rows_kernel=True" if self.blocked_weight is not None else ""
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{features}, bias={self.bias is not None}{rows_kernel}"


def quantizes_activations(model: torch.nn.Module) -> bool:
    """Whether `model` rounds activations to int8 per token (holds an `Int8Linear`): then a row's greedy answer
    stays that of the request alone only where every float operation before a rounding gives a row the same bits
    whatever its batch (`CausalLMRunner.attend_per_query`)."""
    return any(isinstance(module, Int8Linear) for module in model.modules())


def int8_matmul_works() -> bool:
    """Whether `torch._int_mm` runs on this CPU's torch build and agrees with the float product."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(3, 64, generator=generator)
    try:
        with torch.inference_mode():
            got, expected = Int8Linear.from_linear(linear)(x), linear(x)
    except RuntimeError as exc:
        logger.info("int8 matrix products unavailable: %s", exc)
        return False
    return bool(torch.allclose(got, expected, atol=0.05))


@dataclass(frozen=True)
class ProductChoice:
    """Whether int8-dynamic multiplies in int8 (`Int8Linear`) or rounds the weights to int8 and multiplies in float
    (`round_linear_weights`), and why (for the log)."""

    int8: bool
    reason: str


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo's text (x86 `flags`, Arm `Features`)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def this_cpu_flags() -> frozenset[str]:
    """This CPU's flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def int8_time_ratio(in_features: int = 576, out_features: int = 1536, rows: tuple[int, ...] = (1, 16)) -> float:
    """How many times float32's time an `Int8Linear` forward takes on this CPU: the worst over `rows` of the fastest
    of a few calls each (the fastest: a busy neighbour slows a call, never speeds it up; SmolLM2's feed-forward shape
    by default, one decode row and a batch; about 50 ms)."""
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    layer = Int8Linear.from_linear(linear)
    packed = torch.ops.mkldnn._reorder_linear_weight(
        linear.weight.detach(), None
    )  # as `runners/packed_linear.py` has it

    def median_s(call: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
        call(x)
        fastest = float("inf")
        for _ in range(15):
            start = time.perf_counter()
            call(x)
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    def float_product(x: torch.Tensor) -> object:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    worst = 0.0
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, generator=generator)
            worst = max(worst, median_s(layer, x) / median_s(float_product, x))
    return worst


def choose_products(asked: str, flags: frozenset[str], measure: Callable[[], float] = int8_time_ratio) -> ProductChoice:
    """int8 products where asked for (`asked`, `--int8-products`, is `int8`), float ones for `float`; with `auto`,
    int8 where the CPU has int8 dot-product instructions (`NATIVE_INT8_FLAGS`) and `measure` (an int8 layer's time
    over float32's, on this CPU now) finds them not grossly slower than float32 (`MAX_INT8_TIME_RATIO`), float
    products over int8-rounded weights elsewhere."""
    if asked != "auto":
        return ProductChoice(asked == "int8", f"--int8-products {asked}")
    native = [flag for flag in NATIVE_INT8_FLAGS if flag in flags]
    if not native:
        return ProductChoice(
            False,
            f"this CPU has no int8 dot-product instructions (none of {', '.join(NATIVE_INT8_FLAGS)}): int8 products "
            "would run many times slower than float32",
        )
    ratio = measure()
    if ratio > MAX_INT8_TIME_RATIO:
        return ProductChoice(False, f"{', '.join(native)}, but an int8 layer took {ratio:.2f}x float32's time here")
    return ProductChoice(True, f"{', '.join(native)}; an int8 layer took {ratio:.2f}x float32's time here")


def round_linear_weights(model: torch.nn.Module, output_layer: bool = False) -> int:
    """int8-dynamic where the CPU does not multiply int8 fast: the weights of the layers `quantize_linear_layers` would
    swap are rounded to int8 per output channel and kept as float (the int8 model's weights, float32's speed;
    activations are not rounded); returns how many."""
    with torch.no_grad():
        layers = _quantizable(model, output_layer)
        output = _output_layer(model)
        for _, linear in layers:
            values, scale = quantize_per_channel(linear.weight)
            rounded = (values.float() * scale[:, None]).to(linear.weight.dtype)
            if linear is output:  # its weight may be the input embeddings' too: they keep theirs
                linear.weight = torch.nn.Parameter(rounded, requires_grad=False)
            else:
                linear.weight.copy_(rounded)
    return len(layers)


def _quantizable(model: torch.nn.Module, output_layer: bool = False) -> list[tuple[str, torch.nn.Linear]]:
    """The plain float `nn.Linear` layers of a model, its output layer only with `output_layer` (otherwise the logits
    keep full precision)."""
    output = None if output_layer else _output_layer(model)
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not output and module.weight.is_floating_point()
    ]


def _output_layer(model: torch.nn.Module) -> object:
    output_of = getattr(model, "get_output_embeddings", None)
    return output_of() if callable(output_of) else None


def quantize_linear_layers(model: torch.nn.Module, output_layer: bool = False) -> int:
    """Swaps every plain float `nn.Linear` of a CPU model but its output layer (the logits keep full precision; with
    `output_layer` that one too, as llama.cpp's Q8_0 has it) for an `Int8Linear`; returns how many. Raises where this
    torch build cannot multiply int8 matrices.

    Whisper's encoder included: alone, in process, it ran 30% slower in int8 (rounding 1,500 frames of activations
    and scaling the products back cost more than the integer product saves), but the server at concurrency 16
    transcribed 11% more audio a second with it in int8 (results then scaled back in three passes, now two) than
    with it in float (interleaved in one run,
    `docs/results/whisper-int8-encoder-float-vs-int8-cpu.json`)."""
    if not int8_matmul_works():
        raise RuntimeError("--quantization int8-dynamic: this torch build has no int8 matrix product on this CPU")
    layers = _quantizable(model, output_layer)
    with torch.no_grad():
        for name, linear in layers:
            model.set_submodule(name, Int8Linear.from_linear(linear))
    return len(layers)


def use_int8_for_compressed_tensors(model: torch.nn.Module) -> int:
    """Swaps the W8A8 layers of a compressed-tensors model, as loaded (still compressed), for `Int8Linear`:
    transformers would otherwise decompress them to float at the first forward and compute in float, rounding
    activations to int8 values on the way (slower than float32 alone). Returns how many were swapped."""
    if not int8_matmul_works():
        return 0
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and (layer := Int8Linear.from_compressed_tensors(module, dtype)):
            model.set_submodule(name, layer)
            swapped += 1
    left = any(getattr(module, "quantization_scheme", None) is not None for module in model.modules())
    hook = getattr(model, "ct_decompress_hook", None)
    if swapped and not left and hook is not None:  # nothing left for it to decompress
        hook.remove()
    return swapped
