"""Loads the model and tokenizer named by the settings and wires runner, engine and serving context."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    WhisperForConditionalGeneration,
)
from transformers.distributed.configuration_utils import DistributedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from transformers_openai.embedding_loader import (
    CROSS_ENCODER,
    ENCODER_TYPES,
    cross_encoder_activation,
    cross_encoder_context,
    embedding_context,
    embedding_pooling,
    is_cross_encoder,
    sentence_transformers_dir,
)
from transformers_openai.engine.async_engine import AsyncEngine
from transformers_openai.engine.core import EngineCore
from transformers_openai.engine.intra_op_threads import cpu_threads, engine_threads
from transformers_openai.engine.lora_adapters import LoraAdapters, LoraLimits
from transformers_openai.engine.scheduler import Scheduler
from transformers_openai.engine.speculative.config import SpeculativeConfig
from transformers_openai.engine.speculative.speculator import Speculator
from transformers_openai.engine.speech_calls import SpeechCalls
from transformers_openai.engine.stats import EngineObserver
from transformers_openai.int8_linear import Int8Linear
from transformers_openai.metrics import Metrics
from transformers_openai.parallel.checks import tensor_parallel_problem
from transformers_openai.parallel.leader import Leader
from transformers_openai.parallel.ranks import Ranks, join_ranks
from transformers_openai.parallel.rendezvous import LoopbackRendezvous
from transformers_openai.quantization import plan_quantization
from transformers_openai.runners.base import Acceleration, DecodeStep, ModelRunner, SpeechRunner
from transformers_openai.runners.causal_lm import CausalLMRunner
from transformers_openai.runners.kernels.int8_gemv_kernel import use_rows_kernel
from transformers_openai.runners.kv.kv_pool import KVSpace
from transformers_openai.runners.packed_linear import pack_linear_layers
from transformers_openai.runners.seq2seq import Seq2SeqRunner
from transformers_openai.runners.steps.paged_step import StepExecutor
from transformers_openai.runners.steps.step_store import has_cxx_compiler, private_store
from transformers_openai.runners.vision_lm import VisionLMRunner, image_problem
from transformers_openai.runners.whisper import WhisperRunner
from transformers_openai.serving.context import Capability, ServingContext, SpeechModel, SpeechObserver
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.speech.audio import warm_up_decoder
from transformers_openai.serving.speech.whisper_tokens import WhisperTokens
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.text.tool_formats import FORMATS, detect_format
from transformers_openai.serving.tokenizer import TokenizerService, engine_decoder
from transformers_openai.serving.vision.limits import ImageLimits
from transformers_openai.serving.vision.prompts import ProcessorPrompts
from transformers_openai.settings import Settings
from transformers_openai.step_compiler import compile_in_child

logger = logging.getLogger(__name__)

_DEFAULT_CONTEXT = 2048
# The GIL switch interval of a server whose decode steps run as CUDA graphs (Python's default: 5 ms).
GPU_ENGINE_SWITCH_INTERVAL_S = 0.0005

# The model kinds whose runners serve LoRA adapters per row (`serve_adapters`).
LORA_KINDS = frozenset({"causal-lm", "seq2seq", "whisper"})


def detect_kind(config: PretrainedConfig, override: str = "auto", sentence_transformers: bool = False) -> str:
    """The model kind: `override` unless it is auto; a sequence classifier with one label is a cross-encoder, and
    else a sentence-transformers directory or a BERT-family encoder is an embedding model (a decoder is served for
    embeddings only when asked: --model-kind embedding)."""
    if override != "auto":
        return override
    if is_cross_encoder(config):
        return CROSS_ENCODER
    if sentence_transformers or config.model_type in ENCODER_TYPES:
        return "embedding"
    if config.model_type == "whisper":
        return "whisper"
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if (
        getattr(config, "vision_config", None) is not None
        or config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return VISION_KIND
    return "causal-lm"


def vision_model_problem(model: PreTrainedModel, device_map: str | None) -> str | None:
    """Why this image-text-to-text model cannot be served (the runner merges image features into a causal decoder's
    prompt over the paged K/V pool); None when it can."""
    name = type(model).__name__
    if device_map:
        return f"--device-map does not serve vision-language models ({name}): load it on one device"
    return image_problem(model)


def served_kind(config: PretrainedConfig, override: str = "auto", sentence_transformers: bool = False) -> str:
    """The kind the model is served as: as detected, except an image-text-to-text checkpoint whose images cannot be
    placed, which serves text as a decoder (with a warning saying why)."""
    kind = detect_kind(config, override, sentence_transformers)
    text_only = text_only_kind(config) if kind == VISION_KIND else None
    if text_only is None:
        return kind
    logger.warning("%s: images are not served, the model serves text as a decoder", text_only)
    return "causal-lm"


def text_only_kind(config: PretrainedConfig) -> str | None:
    """Why a checkpoint detected as image-text-to-text is served for text only (as a decoder), judged from its
    architecture built on the meta device (no weights); None when its images are served."""
    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
    except Exception:  # judged again once the weights are loaded
        logger.debug("%s not built on the meta device", config.model_type, exc_info=True)
        return None
    return image_problem(model)


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but CUDA is not available")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting != "auto":
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[setting]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and
    slower than float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own checks
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


# Without --kv-cache-memory: this share of the GPU memory free once the model is loaded (the rest is for activations),
# or on a CPU this share of the available memory, at most CPU_KV_CAP bytes (a CPU pool's pages take memory only once
# used, so the process grows with the live tokens up to it).
GPU_KV_SHARE = 0.85
CPU_KV_SHARE = 0.25
CPU_KV_CAP = 4 * 2**30
# A CPU's default budget is rounded down to a multiple of this: the compiled decode step is kept for the pool's size,
# so a restart while a little more or less memory is free reuses it instead of compiling again.
CPU_KV_STEP = 512 * 2**20


def resolve_kv_space(setting: float | None, block_size: int, device: torch.device) -> KVSpace:
    """The K/V budget in bytes: `setting` is bytes, or a fraction (at most 1) of the device's free memory."""
    free = _free_memory(device)
    if setting is None:
        share = GPU_KV_SHARE if device.type == "cuda" else CPU_KV_SHARE
        budget = int(free * share) if device.type == "cuda" else _cpu_default(min(int(free * share), CPU_KV_CAP))
    elif setting <= 1:
        budget = int(free * setting)
    else:
        budget = int(setting)
    return KVSpace(bytes=budget, block_size=block_size)


def _cpu_default(budget: int) -> int:
    """A CPU's default K/V budget in whole `CPU_KV_STEP`s (the budget itself when smaller than one)."""
    return budget // CPU_KV_STEP * CPU_KV_STEP or budget


def _rows_kernel_store(settings: Settings, model: torch.nn.Module) -> Path | None:
    """Where the kernel for 1-4 rows is built, or None to go without it: its layout is a second copy of the plain
    linear weights, refused (with a log line) when larger than a quarter of the machine's memory. Decided from the
    total, not what is free, so that the server and the child compiling its steps decide alike."""
    weights = (getattr(module, "weight", None) for module in model.modules() if type(module) is torch.nn.Linear)
    copy = sum(w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor) and w.is_floating_point())
    total = _total_memory()
    if copy > total // 4:
        logger.info(
            "no matrix-vector kernel for 1-4 rows: its copy of the weights (%.1f GB) would pass a quarter of the "
            "machine's %.1f GB; oneDNN's packed product serves every batch",
            copy / 1e9,
            total / 1e9,
        )
        return None
    return private_store(settings.compile_cache_dir)


def _total_memory() -> int:
    return _meminfo("MemTotal")


def _meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields[field].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 16 * 2**30  # not Linux: assume a modest machine


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo("MemAvailable")


def context_length(config: PretrainedConfig, requested: int | None) -> int:
    text_config = config.get_text_config(decoder=True)
    # T5-style models have relative positions and no hard limit; n_positions is their nominal one.
    native = (
        getattr(text_config, "max_position_embeddings", None)
        or getattr(text_config, "n_positions", None)
        or _DEFAULT_CONTEXT
    )
    if requested is None:
        return int(native)
    if requested > native:
        raise ValueError(f"--max-model-len {requested} is longer than the model's {native} positions")
    return requested


def stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(t) for t in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def encoder_input_length(config: PretrainedConfig, tokenizer: Any) -> int:
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < 1_000_000:
        return tokenizer_limit
    return int(getattr(config, "n_positions", None) or _DEFAULT_CONTEXT)


class StartupPhases:
    """Where start-up spends its time, for one log line."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in self.seconds.items())
        return f"{self._last - self._start:.1f}s ({parts})"


def load_serving_context(
    settings: Settings, observer: EngineObserver | None = None, leader: Leader | None = None
) -> ServingContext:
    """Everything a served model needs, built from the settings (runs in a worker thread); with `leader`, as rank 0
    of a tensor-parallel group whose other ranks run `load_follower`."""
    phases = StartupPhases()
    torch.set_num_threads(cpu_threads(settings.torch_threads))
    source: dict[str, Any] = {"gguf_file": settings.gguf_file} if settings.gguf_file else {}
    config = AutoConfig.from_pretrained(settings.model, **source)
    sentence_transformers = not settings.gguf_file and sentence_transformers_dir(settings.model) is not None
    kind = served_kind(config, settings.model_kind, sentence_transformers)
    spec = MODEL_KINDS[kind]
    device = resolve_device(settings.device)
    tokenizer = AutoTokenizer.from_pretrained(settings.model, **source)
    # A vision-language model's processor before its weights: one that cannot be loaded fails the start at once.
    processor = _processor(settings.model) if Capability.VISION in spec.capabilities else None
    phases.done("config and tokenizer")
    # Embeddings and cross-encoders: the pooling or the activation read (and a model that cannot be served so
    # refused) before the weights are loaded.
    activation = cross_encoder_activation(settings.model, config) if kind == CROSS_ENCODER else None
    pooling = embedding_pooling(settings, config) if spec.build_runner is None and activation is None else None
    ranks = _join_ranks(settings, config, kind, leader.rendezvous if leader is not None else None)
    dtype = resolve_dtype(settings.dtype, device)
    model, quantization = _load_model(settings, config, spec.model_class, device, dtype, ranks, phases)
    problem = vision_model_problem(model, settings.device_map) if kind == VISION_KIND else None
    if problem is not None:
        raise ValueError(problem)
    if settings.pack_cpu_weights and model.device.type == "cpu" and not settings.device_map and ranks is None:
        # Plain float linear layers only: quantized ones keep their own kernels. The kernels for 1-4 rows (float32,
        # and int8 for int8-dynamic's layers) are built (or found) in the compile store.
        rows_kernels = _rows_kernel_store(settings, model)
        packed = pack_linear_layers(model, rows_kernels)
        logger.info("packed %d linear layers for oneDNN", packed)
        if rows_kernels is not None:
            use_rows_kernel(model, rows_kernels)
        phases.done("packing")
    if activation is not None:  # kinds with an engine of their own
        context = replace(
            cross_encoder_context(settings, config, tokenizer, model, activation), quantization=quantization
        )
    elif pooling is not None:
        context = replace(embedding_context(settings, config, tokenizer, model, pooling), quantization=quantization)
    else:
        context = _generation_context(settings, kind, model, tokenizer, quantization, observer, leader, ranks, phases)
    if processor is not None:
        context = replace(context, vision=ProcessorPrompts(processor, image_limits(settings)))
    logger.info("start-up took %s", phases.summary())
    return context


def image_limits(settings: Settings) -> ImageLimits:
    """What a request's images may be, as the settings say (host names compared without case or final dot)."""
    return ImageLimits(
        max_images=settings.limit_mm_per_prompt,
        max_pixels=settings.max_image_pixels,
        max_bytes=settings.max_image_bytes,
        allowed_domains=frozenset(d.strip().lower().rstrip(".") for d in settings.allowed_media_domains if d.strip()),
        allow_private=settings.allow_private_media_urls,
        fetch_timeout=settings.media_fetch_timeout,
    )


def _generation_context(
    settings: Settings,
    kind: str,
    model: PreTrainedModel,
    tokenizer: Any,
    quantization: str,
    observer: EngineObserver | None,
    leader: Leader | None,
    ranks: Ranks | None,
    phases: StartupPhases,
) -> ServingContext:
    """The engine over the kind's runner, prepared as the settings allow, and what serving it needs."""
    spec = MODEL_KINDS[kind]
    assert spec.build_runner is not None
    max_len = spec.context_length(model, settings.max_model_len)
    max_input_len = encoder_input_length(model.config, tokenizer) if spec.text_encoder else None
    logger.info(
        "loaded %s (%s) on %s as %s, quantization %s", settings.model, kind, model.device, model.dtype, quantization
    )
    kv_space = _kv_space(settings, model.device, ranks)
    rows = settings.batch_rows(kind)
    runner, speech_runner = spec.build_runner(model, rows, max_len, max_input_len or max_len, kv_space)
    phases.done("K/V cache")
    adapters = _lora_adapters(settings, kind, runner, model)
    on_compiled = observer.on_decode_step if isinstance(observer, Metrics) else None
    prepared = runner.prepare(_acceleration(settings, model, quantization, leader, ranks, kv_space, on_compiled))
    for done in prepared.done:
        phases.done(done)
    if prepared.asynchronous:
        # A step's host work is a fraction of its device time: the engine thread, waiting for the device without
        # the GIL, must get it back soon, not after the 5 ms the event loop may keep it by default.
        sys.setswitchinterval(GPU_ENGINE_SWITCH_INTERVAL_S)
    if runner.spec.max_model_len < max_len:
        logger.warning(
            "the K/V cache (--kv-cache-memory %.0f MiB) holds at most %d tokens per request: context lowered from %d",
            kv_space.bytes / 2**20,
            runner.spec.max_model_len,
            max_len,
        )
        max_len = runner.spec.max_model_len
    logger.info("context %d tokens, %d rows", max_len, rows)
    scheduler = Scheduler(rows, settings.max_queue, settings.max_prefill_tokens)
    # On a CPU with several threads: set on the engine thread when it starts (engine/intra_op_threads.py).
    cpu = model.device.type == "cpu"
    threads = engine_threads(torch.get_num_threads(), settings.cpu_thread_fallback) if cpu else None
    stops = stop_token_ids(model, tokenizer)
    speculative = settings.speculative
    speculator = None
    if speculative is not None and kind == "causal-lm":
        speculator = Speculator(SpeculativeConfig(**speculative.model_dump()))
    if speculative is not None:
        logger.info("speculative decoding: %s", "on, " + repr(speculative) if speculator else f"off for a {kind} model")
    core = EngineCore(
        runner, engine_decoder(tokenizer), scheduler, stops, observer, threads, prepared.asynchronous, speculator
    )
    engine = AsyncEngine(core)
    speech = None
    if speech_runner is not None:
        speech = _speech_model(settings, model, tokenizer, SpeechCalls(engine, speech_runner), observer)
    limits = (max_len, max_input_len, scheduler.capacity)
    context = _serving_context(settings, kind, tokenizer, engine, limits, speech, quantization, phases)
    return replace(context, adapters=adapters)


def _lora_adapters(settings: Settings, kind: str, runner: Any, model: PreTrainedModel) -> LoraAdapters | None:
    """The LoRA adapters served beside a decoder, T5 or Whisper model (--lora-modules, read now: one that cannot be
    served fails the start), or None when none may be (no --lora-modules nor --allow-runtime-lora)."""
    if not settings.lora_modules and not settings.allow_runtime_lora:
        return None
    if kind not in LORA_KINDS or not isinstance(runner, CausalLMRunner | Seq2SeqRunner):
        raise ValueError(f"LoRA adapters are served on decoder-only, T5 and Whisper models, not on a {kind} model")
    if settings.allow_runtime_lora and not settings.lora_dir:
        raise ValueError("--allow-runtime-lora loads adapters from under --lora-dir only: give one")
    dirs = tuple(Path(folder) for folder in settings.lora_dir) if settings.allow_runtime_lora else None
    limits = LoraLimits(settings.max_loras, settings.max_lora_rank, dirs)
    adapters = LoraAdapters(settings.model_name, runner.serve_adapters(), model.dtype, model.device, limits)
    for name, path in settings.lora_paths.items():
        adapter = adapters.load(name, path)
        logger.info("LoRA adapter '%s' (rank %d, %d layers) from %s", name, adapter.rank, len(adapter.pairs), path)
    return adapters


def _processor(model: str) -> Any:
    """A vision-language model's own processor, which renders and preprocesses its prompts with images."""
    try:
        processor = AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
        raise RuntimeError(f"the processor of {model} cannot be loaded ({type(exc).__name__}: {exc})") from exc
    if getattr(processor, "image_processor", None) is None:
        raise RuntimeError(f"{model} has no image processor (AutoProcessor gave a {type(processor).__name__})")
    return processor


def _compilable(model: PreTrainedModel, quantization: str) -> bool:
    """Whether a CPU model's decode steps may be compiled: float weights, or int8-dynamic's where every int8 layer has
    the int8 kernel, whose C++ operator the graph calls as it is (the same bits as eager: answers under batching stay
    those of each request alone). Other quantized layers keep their own kernels, eagerly."""
    if quantization == "none":
        return True
    int8_layers = [module for module in model.modules() if isinstance(module, Int8Linear)]
    return quantization == "int8-dynamic" and all(layer.blocked_weight is not None for layer in int8_layers)


def _as_loaded(settings: Settings, model: PreTrainedModel, quantization: str) -> Settings:
    """The settings that load `model` again as this process did: int8-dynamic's products as chosen here (`auto`
    times an int8 layer at start, and a child timing it on a busy machine could choose the other, loading a model of
    another layout than the one its steps are compiled for)."""
    if quantization != "int8-dynamic":
        return settings
    products = "int8" if any(isinstance(module, Int8Linear) for module in model.modules()) else "float"
    return settings.model_copy(update={"int8_products": products})


def _acceleration(
    settings: Settings,
    model: PreTrainedModel,
    quantization: str,
    leader: Leader | None,
    ranks: Ranks | None,
    kv_space: KVSpace,
    on_compiled: Callable[[DecodeStep], None] | None = None,
) -> Acceleration:
    """What a runner may set up before serving: on a GPU CUDA graphs; on a CPU decode steps compiled (quantized layers
    keep their own kernels, eagerly) and kernels that read K/V in place, kept in the compile store: compiled in a
    child process (`step_compiler.py`, over the K/V geometry of `kv_space`) or loaded as an earlier start compiled
    them, and swapped in while eager steps serve; with tensor parallelism, steps run on every rank."""
    distribute = None
    if leader is not None and ranks is not None:
        distribute = partial(leader.lead, ranks=ranks)
    if settings.enforce_eager or settings.device_map:
        return Acceleration(distribute=distribute)
    if model.device.type == "cuda":
        return Acceleration(graphs=True, distribute=distribute)
    compiled = settings.cpu_compile and _compilable(model, quantization)
    if compiled and not has_cxx_compiler():
        logger.warning("no C++ compiler (g++ or clang++, or $CXX) for torch.compile: decode steps run eagerly")
        compiled = False
    store = private_store(settings.compile_cache_dir)
    elsewhere = partial(compile_in_child, _as_loaded(settings, model, quantization), kv_space, store)
    return Acceleration(
        compiled=compiled,
        kernels=True,
        store=store,
        distribute=distribute,
        compile_elsewhere=elsewhere,
        on_compiled=on_compiled,
    )


def compile_steps_alone(settings: Settings, kv_space: KVSpace, store: Path) -> bool:
    """A server's decode steps compiled into `store` by a process of its own (`step_compiler.py`): the model loaded,
    packed and given a K/V pool of `kv_space` as the server did, so the steps' key and guards match the server's.
    False where no compiled step applies, or the compile failed."""
    source: dict[str, Any] = {"gguf_file": settings.gguf_file} if settings.gguf_file else {}
    config = AutoConfig.from_pretrained(settings.model, **source)
    sentence_transformers = not settings.gguf_file and sentence_transformers_dir(settings.model) is not None
    kind = served_kind(config, settings.model_kind, sentence_transformers)
    spec = MODEL_KINDS[kind]
    if spec.build_runner is None:
        return False
    device = torch.device("cpu")
    dtype = resolve_dtype(settings.dtype, device)
    model, _ = _load_model(settings, config, spec.model_class, device, dtype, None, StartupPhases())
    if settings.pack_cpu_weights:
        rows_kernels = store if _rows_kernel_store(settings, model) is not None else None
        pack_linear_layers(model, rows_kernels)
        if rows_kernels is not None:
            use_rows_kernel(model, rows_kernels)
    max_len = spec.context_length(model, settings.max_model_len)
    runner, _ = spec.build_runner(model, settings.batch_rows(kind), max_len, max_len, kv_space)
    return bool(runner.prepare(Acceleration(compiled=True, kernels=True, store=store)).done)


def _serving_context(
    settings: Settings,
    kind: str,
    tokenizer: Any,
    engine: AsyncEngine,
    limits: tuple[int, int | None, int],
    speech: SpeechModel | None,
    quantization: str,
    phases: StartupPhases,
) -> ServingContext:
    """The serving side of a generating model: its templates, tool format, grammars and `limits` (context, encoder
    input and sequences at once), warmed up."""
    spec = MODEL_KINDS[kind]
    max_len, max_input_len, max_sequences = limits
    template = settings.chat_template.read_text() if settings.chat_template else None
    tokenizer_service = TokenizerService(tokenizer, template)
    tool_format = (
        detect_format(tokenizer_service.template_source(with_tools=True))
        if settings.tool_call_parser == "auto"
        else FORMATS[settings.tool_call_parser]
    )
    structured = (
        StructuredOutputs(tokenizer, settings.max_schema_bytes, settings.grammar_cache_bytes)
        if Capability.TEXT in spec.capabilities
        else None
    )
    # What a first request would otherwise build while others stream (the engine thread waits for the GIL).
    if structured is not None:
        structured.warm_up()
    if speech is not None:
        warm_up_decoder(speech.sampling_rate)
    phases.done("warm-up")
    prompt_limits = PromptLimits(
        max_messages=settings.max_chat_messages,
        max_content_parts=settings.max_content_parts,
        max_prompt_tokens=max_input_len or max_len,
        max_token_chars=tokenizer_service.longest_token_chars(),
        max_sequences=max_sequences,
    )
    return ServingContext(
        engine=engine,
        tokenizer=tokenizer_service,
        model_name=settings.model_name,
        model_aliases=frozenset({settings.model_name, settings.model}),
        max_model_len=max_len,
        model_kind=kind,
        max_input_len=max_input_len,
        response_role=settings.response_role,
        default_max_tokens=settings.default_max_tokens,
        capabilities=spec.capabilities,
        speech=speech,
        encoder_decoder=spec.text_encoder,
        structured=structured,
        tool_format=tool_format,
        prompt_limits=prompt_limits,
        max_stored_responses=settings.max_stored_responses,
        max_stored_response_bytes=settings.max_stored_response_bytes,
        quantization=quantization,
        reasoning_parser=settings.reasoning_parser,
        default_template_kwargs=dict(settings.default_chat_template_kwargs),
    )


def load_follower(settings: Settings) -> tuple[Ranks, StepExecutor]:
    """A tensor-parallel rank other than 0: its shard of the model and of the K/V pool, sized as rank 0 sizes its own
    (the same steps as `load_serving_context`, in the same order, so the ranks' collectives meet)."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    config = AutoConfig.from_pretrained(settings.model)
    kind = served_kind(config, settings.model_kind)
    ranks = _join_ranks(settings, config, kind)
    assert ranks is not None  # a follower runs only with --tensor-parallel-size > 1
    device = resolve_device(settings.device)
    model, _ = _load_model(
        settings, config, AutoModelForCausalLM, device, resolve_dtype(settings.dtype, device), ranks, StartupPhases()
    )
    kv_space = _kv_space(settings, model.device, ranks)
    runner = CausalLMRunner(model, settings.batch_rows(kind), _text_context(model, settings.max_model_len), kv_space)
    return ranks, runner.executor


def _join_ranks(
    settings: Settings, config: PretrainedConfig, kind: str, rendezvous: LoopbackRendezvous | None = None
) -> Ranks | None:
    """With --tensor-parallel-size > 1: the model and settings checked, then this process joined to its ranks."""
    size, quantization = settings.tensor_parallel_size, settings.quantization
    problem = tensor_parallel_problem(config, kind, size, quantization, settings.gguf_file, settings.device_map)
    if problem is not None:
        raise ValueError(problem)
    if size == 1:
        return None
    return join_ranks(size, rendezvous)


def _load_model(
    settings: Settings,
    config: PretrainedConfig,
    model_class: Any,
    device: torch.device,
    dtype: torch.dtype,
    ranks: Ranks | None,
    phases: StartupPhases,
) -> tuple[PreTrainedModel, str]:
    """The weights on `device` (this rank's shard of them with `ranks`), quantized as the settings ask; and the
    quantization served."""
    source: dict[str, Any] = {"gguf_file": settings.gguf_file} if settings.gguf_file else {}
    placement: dict[str, Any] = {"device_map": settings.device_map} if settings.device_map else {}
    if settings.gguf_file and settings.quantization != "none":
        raise ValueError("--quantization does not apply to a GGUF file (transformers dequantizes it as it loads)")
    plan = plan_quantization(config, settings.quantization, device, settings.int8_products, settings.int8_output_layer)
    quantization = plan.served
    if quantization != "none":
        # A quantizer places the weights it makes as it loads them (some cannot be moved after).
        placement.setdefault("device_map", {"": device})
    if plan.config is not None:
        placement["quantization_config"] = plan.config
    if ranks is not None:  # transformers places each rank's shard on its device
        placement["distributed_config"] = DistributedConfig(tp_size=ranks.size)
    try:
        model = model_class.from_pretrained(
            settings.model, dtype=dtype, attn_implementation=settings.attn_implementation, **source, **placement
        )
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as exc:
        if quantization == "none":
            raise
        raise RuntimeError(f"the {quantization} model cannot be loaded on {device}: {exc}") from exc
    if settings.gguf_file:
        quantization = "gguf-dequantized"
    if not placement.keys() & {"device_map", "distributed_config"}:  # otherwise already placed
        model.to(device)
    model.eval()
    phases.done("weights")
    if plan.after_load is not None:
        logger.info("%d linear layers swapped for int8 ones (%s)", plan.after_load(model), quantization)
        phases.done("quantizing")
    return model, quantization


def _kv_space(settings: Settings, device: torch.device, ranks: Ranks | None) -> KVSpace:
    """The K/V budget; with tensor parallelism, each rank's for its shard, the same on every rank (their pools hold
    the same blocks): the smallest rank's, and on a CPU, whose memory the ranks share, a share of it each."""
    space = resolve_kv_space(settings.kv_cache_memory, settings.kv_block_size, device)
    if ranks is None:
        return space
    budget = space.bytes // ranks.size if device.type == "cpu" else space.bytes
    return replace(space, bytes=ranks.smallest(budget))


def _speech_model(
    settings: Settings, model: PreTrainedModel, tokenizer: Any, calls: SpeechCalls, observer: object
) -> SpeechModel:
    feature_extractor = AutoFeatureExtractor.from_pretrained(settings.model)  # type: ignore[no-untyped-call]
    multilingual = bool(getattr(model.generation_config, "is_multilingual", model.config.vocab_size >= 51865))
    on_transcription = getattr(observer, "on_transcription", None)
    return SpeechModel(
        feature_extractor=feature_extractor,
        tokens=WhisperTokens.from_tokenizer(tokenizer, multilingual),
        calls=calls,
        max_audio_seconds=settings.max_audio_seconds,
        max_audio_decodes=settings.max_audio_decodes,
        observer=cast(SpeechObserver, observer) if on_transcription is not None else None,
    )


@dataclass(frozen=True)
class ModelKind:
    """Everything that differs between the kinds of model served: one entry each, in one place."""

    model_class: Any
    # (model, rows, context, encoder input length, K/V budget) -> the runner, and the same as a speech model (its
    # work outside the batch) for a kind that transcribes. None: a kind with its own engine.
    build_runner: Callable[[PreTrainedModel, int, int, int, KVSpace], BuiltRunner] | None
    capabilities: frozenset[Capability]
    context_length: Callable[[PreTrainedModel, int | None], int]
    text_encoder: bool = False  # the text prompt is the encoder's input (T5), with its own length limit


BuiltRunner = tuple[ModelRunner, SpeechRunner | None]


def _speech_runner(runner: WhisperRunner) -> BuiltRunner:
    return runner, runner


def _text_context(model: PreTrainedModel, requested: int | None) -> int:
    return context_length(model.config, requested)


def _decoder_positions(model: PreTrainedModel, requested: int | None) -> int:
    native = int(model.config.max_target_positions)
    return native if requested is None else min(requested, native)


_TEXT = frozenset({Capability.TEXT})
VISION_KIND = "image-text-to-text"
MODEL_KINDS: dict[str, ModelKind] = {
    "causal-lm": ModelKind(
        AutoModelForCausalLM, lambda m, rows, n, _, kv: (CausalLMRunner(m, rows, n, kv), None), _TEXT, _text_context
    ),
    "seq2seq": ModelKind(
        AutoModelForSeq2SeqLM,
        lambda m, rows, n, inputs, kv: (Seq2SeqRunner(m, rows, n, inputs, kv), None),
        _TEXT,
        _text_context,
        text_encoder=True,
    ),
    "whisper": ModelKind(
        WhisperForConditionalGeneration,
        lambda m, rows, n, _, kv: _speech_runner(WhisperRunner.with_rules(m, rows, kv)),
        frozenset({Capability.SPEECH}),
        _decoder_positions,
    ),
    "embedding": ModelKind(AutoModel, None, frozenset({Capability.EMBEDDINGS, Capability.SCORES}), _text_context),
    CROSS_ENCODER: ModelKind(AutoModelForSequenceClassification, None, frozenset({Capability.SCORES}), _text_context),
    VISION_KIND: ModelKind(
        AutoModelForImageTextToText,
        lambda m, rows, n, _, kv: (VisionLMRunner(m, rows, n, kv), None),
        frozenset({Capability.TEXT, Capability.VISION}),
        _text_context,
    ),
}
