"""Linear layers whose weights oneDNN has laid out ahead of time for this CPU, swapped into a loaded model.

A model's `nn.Linear` multiplies through MKL's general matrix product, which packs the weight for the CPU's
vector units on every call. With a decode batch of a few rows that packing is a large share of the work: at 16
rows and 2 threads a 576 x 49,152 projection takes about 30 ms as `nn.Linear` and 11 ms packed once
(`loadtest step-breakdown --weights plain,packed` shows the whole step). oneDNN's packed linear is the one
torch's own CPU compiler uses for frozen weights (`mkldnn._linear_pointwise`); results differ from MKL's only by
float rounding. Each packed copy replaces its plain weight, except where the weight is shared with another module (an
output layer tied to the input embeddings, which still look rows up in the plain table): that one is copied, the
model growing by one table (113 MB for SmolLM2 in float32) for an output layer 2-3x faster (SmolLM2's 49,152 x 576
one, 2 threads: 10.5 ms plain against 5.6 packed at 1 row, 18.8 against 6.6 at 16, 46 against 18.6 at 64).

Where a layer applies an activation straight to a packed layer's product (Whisper's feed-forward: `gelu(fc1(x))`),
oneDNN applies it as it writes the product (`fuse_activations`): the same values, without a second pass over a
large output (Whisper's encoder's widest products)."""

from __future__ import annotations

import ctypes
import inspect
import logging
import mmap
import sys
from pathlib import Path
from typing import Any, cast

import torch

from transformers_openai.runners.kernels import gemv_kernel

logger = logging.getLogger(__name__)


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` with `W` kept in oneDNN's blocked layout (the plain weight is not kept); with `rows_kernel`
    also in the matrix-vector kernel's layout (`gemv_kernel.py`, which must be loaded), which inputs of at most
    `gemv_kernel.MAX_ROWS` rows multiply through (a decode step at low concurrency)."""

    def __init__(self, linear: torch.nn.Linear, rows_kernel: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation: str | None = None  # "gelu": applied to the product (exact GELU), see `fuse_activations`
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.register_buffer("blocked_weight", gemv_kernel.block_weight(weight) if rows_kernel else None)

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight: right shape, dtype and device for model code that inspects them (T5's feed-forward
        casts to `wo.weight.dtype`), but an opaque oneDNN tensor, not one to compute with."""
        return cast(torch.Tensor, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        weight, bias = self.weight, cast(torch.Tensor | None, self.bias)
        blocked = cast(torch.Tensor | None, self.blocked_weight)
        if torch.compiler.is_compiling():  # one opaque call in a compiled graph
            if blocked is not None:  # the kernel's C++ operator: no Python between the graph and the product
                y: torch.Tensor = gemv_kernel.linear(rows, weight, bias, blocked)
            else:  # `register_compilable_op`
                y = torch.ops.transformers_openai.packed_linear(rows, weight, bias, blocked)
            if self.activation == "gelu":
                y = torch.nn.functional.gelu(y)  # the compiler fuses it with what follows
        elif blocked is not None and rows.shape[0] <= gemv_kernel.MAX_ROWS:
            y = gemv_kernel.gemv(rows, blocked, bias, self.out_features)
            if self.activation == "gelu":
                y = torch.nn.functional.gelu(y)
        elif self.activation == "gelu":
            y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "gelu", [], "none")  # "none": erf, not tanh
        else:
            y = _linear(rows, weight, bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fused = f", activation={self.activation}" if self.activation else ""
        rows_kernel = ", rows_kernel=True" if self.blocked_weight is not None else ""
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{features}, bias={self.bias is not None}{fused}{rows_kernel}"


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor | None = None
) -> torch.Tensor:
    """oneDNN's packed product, or the matrix-vector kernel's for a few rows where the layer has its layout."""
    if blocked is not None and x.shape[0] <= gemv_kernel.MAX_ROWS:
        return gemv_kernel.gemv(x, blocked, bias, weight.shape[0])
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return y


def _linear_shape(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocked: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def register_compilable_op() -> None:
    """Registers `torch.ops.transformers_openai.packed_linear`, what `PackedLinear` calls inside `torch.compile`:
    inductor lowers oneDNN's packed linear only for weights it froze itself, so the packed weights reach the
    compiled graph through an operator it treats as opaque (its output's shape given). Idempotent."""
    if hasattr(torch.ops.transformers_openai, "packed_linear"):
        return
    # Defined with the plain library functions, not `torch.library.custom_op` (whose Python wrappers cost more than
    # the small products themselves): the dispatcher calls the kernel directly; torch keeps the registrations for the
    # process's life.
    name = "transformers_openai::packed_linear"
    torch.library.define(name, "(Tensor x, Tensor weight, Tensor? bias, Tensor? blocked=None) -> Tensor")
    torch.library.impl(name, "CompositeExplicitAutograd", _linear)
    torch.library.register_fake(name, _linear_shape)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear is there for `dtype` on this CPU and agrees with `nn.Linear`."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, dtype=dtype)
    x = torch.randn(3, 5, 64, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            packed, plain = PackedLinear(linear)(x), linear(x)
    except RuntimeError as exc:  # a torch build without the op
        logger.info("packed CPU linear layers unavailable: %s", exc)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(packed.float(), plain.float(), rtol=tolerance, atol=tolerance))


def pack_linear_layers(model: torch.nn.Module, kernels: Path | None = None) -> int:
    """Packs every `nn.Linear` of a CPU model whose weight is plain (a quantized layer is left as it is); returns how
    many were packed (0 when it cannot). With `kernels` (where the C++ kernels are built and kept), float32 layers
    also get the matrix-vector kernel's layout for inputs of 1-4 rows (`gemv_kernel.py`), where it can be built."""
    dtype = next(model.parameters()).dtype
    if not can_pack(dtype):
        return 0
    rows_kernel = kernels is not None and dtype == torch.float32 and gemv_kernel.load(kernels)
    owners: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and _plain(getattr(module, "weight", None), dtype)
    ]
    mapped = FileMappedPages()
    packed = 0
    # By name, one at a time: each plain weight goes as soon as its packed copy is made.
    with torch.no_grad():
        for name in names:
            linear = cast(torch.nn.Linear, model.get_submodule(name))
            model.set_submodule(name, PackedLinear(linear, rows_kernel))
            if owners[id(linear.weight)] == 1:  # a tied table stays, for the module sharing it
                mapped.release(linear.weight)
            packed += 1
    if rows_kernel and packed:
        variant = {gemv_kernel.AVX512: "AVX-512", gemv_kernel.AVX2: "AVX2"}.get(gemv_kernel.best_variant(), "plain C++")
        logger.info("%d packed layers multiply 1-4 rows with the matrix-vector kernel (%s)", packed, variant)
    fused = fuse_activations(model) if packed else 0
    if fused:
        logger.info("%d activations applied by their packed layers", fused)
    return packed


# Layer classes whose forward applies an activation straight to a linear layer's product, by the attribute names of
# the two (`self.activation_fn(self.fc1(`); `fuse_activations` checks that their source still reads so.
FUSIBLE_LAYERS = {"WhisperEncoderLayer": ("fc1", "activation_fn"), "WhisperDecoderLayer": ("fc1", "activation_fn")}


def fuse_activations(model: torch.nn.Module) -> int:
    """Moves each exact GELU applied straight to a packed layer's product into that layer (oneDNN applies it as it
    writes the product: the same values, one pass over the output less) and leaves an identity in its place;
    returns how many were moved. Only in the layer classes of `FUSIBLE_LAYERS` whose forward calls the activation
    once, on the linear layer's output."""
    fused = 0
    for layer in model.modules():
        names = FUSIBLE_LAYERS.get(type(layer).__name__)
        if names is None:
            continue
        linear_name, activation_name = names
        linear, activation = getattr(layer, linear_name, None), getattr(layer, activation_name, None)
        if not (isinstance(linear, PackedLinear) and linear.activation is None and _exact_gelu(activation)):
            continue
        if not _applies_once_to_product(type(layer), linear_name, activation_name):
            continue
        linear.activation = "gelu"
        setattr(layer, activation_name, torch.nn.Identity())
        fused += 1
    return fused


def unfuse_activations(model: torch.nn.Module) -> int:
    """Puts back, as modules of their own, the activations `fuse_activations` moved into packed layers: where
    something is added to the layer's product before its activation (a LoRA update), the product must come out
    plain. Returns how many were put back."""
    unfused = 0
    for layer in model.modules():
        names = FUSIBLE_LAYERS.get(type(layer).__name__)
        linear = None if names is None else getattr(layer, names[0], None)
        if names is None or not isinstance(linear, PackedLinear) or linear.activation != "gelu":
            continue
        linear.activation = None
        setattr(layer, names[1], torch.nn.GELU())
        unfused += 1
    return unfused


def _exact_gelu(module: object) -> bool:
    """An erf GELU: torch's, or transformers' `GELUActivation` calling torch's."""
    if isinstance(module, torch.nn.GELU):
        return module.approximate == "none"
    return type(module).__name__ == "GELUActivation" and getattr(module, "act", None) is torch.nn.functional.gelu


def _applies_once_to_product(layer_class: type[torch.nn.Module], linear_name: str, activation_name: str) -> bool:
    """Whether `layer_class.forward` calls the activation exactly once, and on the linear layer's output."""
    try:
        source = inspect.getsource(layer_class.forward)
    except (OSError, TypeError):
        return False
    call = f"self.{activation_name}("
    return source.count(call) == 1 and f"{call}self.{linear_name}(" in source


def _plain(weight: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """A weight of plain float values in the model's dtype: not a quantized tensor subclass such as torchao's, nor
    missing (compressed-tensors keeps packed int4 weights under other names until the first forward)."""
    return weight is not None and type(weight.data) is torch.Tensor and weight.dtype == dtype


class FileMappedPages:
    """Gives back the pages of weights read from a memory-mapped file (safetensors) once they are not needed.

    The map stays open while any tensor of it lives (the embeddings), so the pages of every packed weight would
    stay resident beside their packed copies: twice the model's size at load. Dropping the pages that lie wholly
    inside a dropped weight (`madvise(MADV_DONTNEED)`; a file page read again would come back from the file)
    keeps the load at about one copy. Only file-backed maps are touched, and only on Linux.
    """

    MADV_DONTNEED = 4

    def __init__(self) -> None:
        self._files: list[tuple[int, int]] = []
        self._madvise: Any = None
        if sys.platform != "linux":
            return
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[5].startswith("/"):
                        start, end = (int(address, 16) for address in fields[0].split("-"))
                        self._files.append((start, end))
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError) as exc:
            logger.debug("file-mapped weight pages stay resident: %s", exc)
            self._files = []
        self._page = mmap.PAGESIZE

    def release(self, tensor: torch.Tensor) -> None:
        if not self._files or not tensor.is_contiguous():
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(low <= start and end <= high for low, high in self._files):
            return
        first = -(-start // self._page) * self._page  # whole pages only: neighbours keep theirs
        last = end // self._page * self._page
        if last > first:
            self._madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), self.MADV_DONTNEED)
