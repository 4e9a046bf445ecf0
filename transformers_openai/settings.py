"""The one typed configuration: every field is a CLI flag (kebab-case) and an environment variable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from transformers_openai.quantization import Int8Products, QuantizationChoice, quantization_help

ModelKind = Literal["auto", "causal-lm", "image-text-to-text", "seq2seq", "whisper", "embedding", "cross-encoder"]
# Lists come as repeated flags or as comma-separated environment variables (API_KEY=a,b).
CommaList = Annotated[list[str], NoDecode]
_BYTES = TypeAdapter(ByteSize)  # "4GiB", "512MB"
# --max-batch-size by default: a decoder's rows share the paged K/V cache; the other kinds hold memory per row.
DECODER_BATCH_ROWS = 64
OTHER_BATCH_ROWS = 16


class SpeculativeSettings(BaseModel):
    """--speculative-config, keyed as vLLM's: n-gram prompt lookup (a draft `model` is not supported yet)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(5, ge=1, le=16)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    prompt_lookup_min: int = Field(1, ge=1, le=64)
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_draft_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" in data:
            raise ValueError('a draft "model" is not supported yet: use {"method": "ngram"}')
        return data

    @model_validator(mode="after")
    def _bounds_in_order(self) -> SpeculativeSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


def _user_cache() -> Path:
    """The user's cache directory: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


class Settings(BaseSettings):
    """Precedence: command-line flag, then environment variable (upper-case field name), then default."""

    model_config = SettingsConfigDict(
        case_sensitive=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m transformers_openai.main",
        populate_by_name=True,
        extra="ignore",
    )

    model: str = Field(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        validation_alias=AliasChoices("model", "hf_model"),
        description="Hub id or local directory of the model (alias: --hf-model / HF_MODEL).",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside --model to load (dequantized on load).")
    quantization: QuantizationChoice = Field("none", description=quantization_help())
    int8_products: Int8Products = Field(
        "auto",
        description="On a CPU, how int8 activations (--quantization int8-dynamic, W8A8 checkpoints) are multiplied: "
        "int8 (oneDNN's integer product), float (the weights rounded to int8 and kept in float, activations not "
        "rounded: float32's speed), or auto: int8 where the CPU has int8 dot-product instructions (avx512_vnni, "
        "avx_vnni, amx_int8; Arm asimddp, i8mm) and an int8 layer measures under 3x float32's time at start, float "
        "elsewhere (without them int8 products ran 18-59x slower than float32).",
    )
    int8_output_layer: bool = Field(
        False,
        description="With --quantization int8-dynamic on a CPU, round the output layer to int8 too, as llama.cpp's "
        "Q8_0 does: a quarter of its bytes read per token (SmolLM2: 28 MB instead of 113, the largest single read of "
        "a decode step), logits no longer those of the float32 layer. Off by default: the logits keep full precision.",
    )
    served_model_name: str | None = Field(None, description="Model id clients use; defaults to --model.")
    models: CommaList = Field(
        default_factory=list,
        description="More models to serve beside --model, each as PATH or NAME=PATH (NAME: its served name); repeat "
        "the flag or separate with commas. A request picks one by its `model` field; each has its own engine, K/V "
        "pool and batch, with the other settings as given for the server.",
    )
    models_config: Path | None = Field(
        None,
        description="A JSON or YAML file listing more models to serve: a list of objects with `model` and any of "
        "the per-model settings (served_model_name, model_kind, dtype, quantization, max_model_len, "
        "kv_cache_memory, max_batch_size, chat_template, ...; see docs/options.md), which override the server's "
        "for that model.",
    )
    load_on_demand: bool = Field(
        False,
        description="With several models: load each only when a request first names it (that request waits, up to "
        "--model-load-timeout), instead of all at start.",
    )
    idle_unload_seconds: float | None = Field(
        None,
        gt=0,
        description="Unload a model no request has used for this many seconds (its engine stopped, its memory "
        "freed); the next request naming it loads it again. Unset: models stay loaded.",
    )
    models_memory_budget: float | None = Field(
        None,
        description="Bytes (or '12GiB') all loaded models may take together; a load that would pass it first "
        "unloads the least recently used idle model, else it is refused (503). Default: 80% of the machine's RAM.",
    )
    model_load_timeout: float = Field(
        300.0,
        gt=0,
        description="How long a request waits for the model it names to load on demand before a 503 with Retry-After.",
    )
    model_kind: ModelKind = Field(
        "auto",
        description="Model kind; auto detects it from the model's config (a *ForSequenceClassification "
        "architecture with one label: cross-encoder; sentence-transformers directories and BERT-family encoders: "
        "embedding). 'embedding' serves a decoder's last-token vectors on /v1/embeddings; 'cross-encoder' scores "
        "pairs on /v1/rerank and /v1/score.",
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(7088, ge=1, le=65535, description="Port to bind.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        validation_alias=AliasChoices("dtype", "torch_dtype"),
        description="Weights dtype; auto is bfloat16 on CUDA (float16 where bf16 is unsupported) and on CPUs with "
        "native bf16 matrix units (AVX512-BF16 or AMX), float32 on other CPUs.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="Where the model runs; auto prefers CUDA.")
    attn_implementation: str = Field("sdpa", description="Attention kernel: sdpa, eager, flash_attention_2, ...")
    pack_cpu_weights: bool = Field(
        True,
        description="On a CPU, lay the linear layers' weights out once for oneDNN (float32, or bfloat16 where the "
        "CPU has it) instead of MKL repacking them every call: decode steps of a few rows get much faster; "
        "results differ only by float rounding. An output layer tied to the embeddings is packed as a copy (the "
        "model grows by that table).",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly. Otherwise, on CUDA, a plain causal decoder's decode steps and short "
        "prompts' prefills are captured at start as CUDA graphs (one per shape bucket) and replayed: far less host "
        "time per step. Also turns --cpu-compile off.",
    )
    cpu_compile: bool = Field(
        True,
        description="On a CPU, run a plain causal decoder's decode steps compiled by torch.compile (inductor's C++ "
        "kernels and a C++ wrapper calling them: 10-30% shorter steps; without a C++ compiler they run eagerly), float "
        "weights or --quantization int8-dynamic's (its int8 layers where the int8 kernel serves them). The "
        "server answers at once with eager steps while a child process compiles the two graphs (minutes on a small "
        "CPU), then swaps them in without a restart (/metrics: decode_step_compiled); they are kept in "
        "--compile-cache-dir, and later starts load them in the background in seconds.",
    )
    compile_cache_dir: Path = Field(
        default_factory=lambda: _user_cache() / "transformers-openai" / "compiled-steps",
        description="Where compiled steps, the C++ inductor built for them (its cache: TORCHINDUCTOR_CACHE_DIR is "
        "set to a folder here) and our C++ kernels (decode attention, the matrix-vector product of 1-4 rows) are "
        "kept between starts (default: "
        "under $XDG_CACHE_HOME, else ~/.cache); they are pickles and shared libraries, loaded at start: it is made "
        "private (0700), and refused, with a warning and a temporary folder used instead, when another user could "
        "write it.",
    )
    device_map: str | None = Field(
        None, description="accelerate device map ('auto': spread one model over several GPUs); overrides --device."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Split the model over this many processes (one per GPU, or CPU processes), each holding a share "
        "of every layer's weights and of the K/V cache: the server starts the other ranks itself (or run it under "
        "torchrun --nproc-per-node N). Decoder-only models with a tensor-parallel plan in transformers; it must "
        "divide their attention and K/V heads.",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Most requests (rows) stepped together; default 64 for a decoder LLM (the K/V cache decides how "
        "many of them fit, and preempts beyond it), 16 for T5, Whisper and embedding models (memory of their own per "
        "row).",
    )
    max_queue: int = Field(64, ge=0, description="Most requests waiting beyond the running batch; more get 429.")
    lora_modules: CommaList = Field(
        default_factory=list,
        description="LoRA adapters (PEFT directories) served beside a decoder, T5 or Whisper model from the start, "
        "as name=path (comma-separated or repeated); a request picks one by its name in `model`, and requests with "
        "different adapters and none share one batch. Steps then run eagerly (no compiled decode step, no CUDA "
        "graphs).",
    )
    max_loras: int = Field(4, ge=1, description="Most LoRA adapters resident at once; a load beyond gets 400.")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank accepted; an adapter above it is refused.")
    allow_runtime_lora: bool = Field(
        False,
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key), loading "
        "adapters only from under --lora-dir.",
    )
    lora_dir: CommaList = Field(
        default_factory=list,
        description="Directories run-time LoRA loads may read from (comma-separated); paths elsewhere are refused.",
    )
    max_prefill_tokens: int = Field(
        4096,
        ge=1,
        description="Prompt tokens prefilled per engine step; longer prompts are prefilled in chunks over several "
        "steps while running streams keep decoding. Lower bounds the stall a long prompt causes; higher lowers "
        "time to first token.",
    )
    max_model_len: int | None = Field(
        None, ge=8, description="Context length (prompt + completion); defaults to the model's own limit."
    )
    kv_cache_memory: float | None = Field(
        None,
        gt=0,
        description="Memory for the K/V cache of running requests: bytes (4GiB, 512MB, 1e9) or a fraction (at most 1) "
        "of the device memory free after loading. Default: 0.85 of it on CUDA; on a CPU 0.25 of the available "
        "memory, at most 4 GiB, in whole 512 MiB (taken as used). Requests wait when it is full; a running one is "
        "preempted and recomputed later rather than failing.",
    )
    kv_block_size: int = Field(16, ge=1, le=1024, description="Tokens per K/V cache block.")
    speculative_config: str | None = Field(
        None,
        description='Speculative decoding, as vLLM configures it (JSON): {"method": "ngram", '
        '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1} proposes up to 5 tokens per '
        "step by looking the last 4..1 tokens up in the prompt and output, verified in one forward (greedy output "
        'unchanged, sampling keeps its distribution); optional "disable_by_batch_size": N speculates only in steps '
        "of at most N rows. Decoder-only models; off by default (docs/speculative.md).",
    )
    chat_template: Path | None = Field(None, description="Jinja file overriding the tokenizer's chat template.")
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How the model writes tool calls; auto reads it from the chat template (<tool_call>: hermes, "
        "[TOOL_CALLS]: mistral, <|python_tag|>: llama3_json), hermes when the template does not say.",
    )
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "response_schema"] = Field(
        "auto",
        description="How the model's thought is told from its answer (returned as reasoning_content): "
        "deepseek_r1 and qwen3 (<think>...</think>), response_schema (the tokenizer's own, through transformers' "
        "parse_response); auto: the tokenizer's response schema where it has one, else <think> when the chat "
        "template writes it, else none (the thought, if any, stays in the content).",
    )
    default_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='Variables given to the chat template of every request (JSON, e.g. {"enable_thinking": false}); '
        "a request's chat_template_kwargs override them.",
    )
    response_role: str = Field("assistant", description="Role of the generated chat message.")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="max_tokens when a request gives none; unset: rest of the context (chat), 16 (completions).",
    )
    max_request_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    max_chat_messages: int = Field(
        2048, ge=1, description="Most messages one chat request may have (OpenAI's limit); more get 400."
    )
    max_content_parts: int = Field(
        4096, ge=1, description="Most content parts the messages of one chat request may have together; more get 400."
    )
    limit_mm_per_prompt: int = Field(
        8, ge=0, description="Most images one request may hold (vision-language models); more get 400."
    )
    max_image_pixels: int = Field(
        16_000_000, ge=1, description="Most pixels (width x height) one image may have once decoded; more get 400."
    )
    max_image_bytes: int = Field(
        10 * 1024 * 1024,
        ge=1024,
        description="Largest image accepted, as fetched or once its base64 is decoded; larger ones get 400 (an "
        "image sent inline is also bounded by --max-request-bytes).",
    )
    allowed_media_domains: CommaList = Field(
        default_factory=list,
        description="Hosts whose http(s) image URLs the server may fetch ('*' for any public host); none by "
        "default: images come as data: URLs. Loopback and private addresses stay refused unless "
        "--allow-private-media-urls.",
    )
    allow_private_media_urls: bool = Field(
        False, description="Let image URLs reach loopback, link-local and private addresses (trusted networks only)."
    )
    media_fetch_timeout: float = Field(10.0, gt=0, description="Seconds one image URL may take to fetch.")
    max_audio_bytes: int = Field(
        25 * 1024 * 1024, ge=1024, description="Largest audio file accepted by /v1/audio/*; larger ones get 413."
    )
    max_audio_seconds: float = Field(
        3600.0, gt=0, description="Longest audio accepted by /v1/audio/*, in seconds; longer files get 400."
    )
    max_audio_decodes: int = Field(
        2, ge=1, description="Audio uploads decoded at once (each holds its samples in memory); more wait their turn."
    )
    max_realtime_sessions: int = Field(
        16, ge=1, description="Realtime transcription sessions (/v1/realtime WebSockets) open at once; more get 429."
    )
    realtime_idle_timeout: float = Field(
        60.0, gt=0, description="Seconds a realtime session may send no event before the server closes it."
    )
    realtime_max_buffer_seconds: float = Field(
        60.0,
        gt=0,
        description="Audio a realtime session may hold uncommitted, in seconds; an append past it gets an error event.",
    )
    max_inflight_bytes: int = Field(
        512 * 1024 * 1024,
        ge=1024 * 1024,
        description="Request body bytes the server holds at once, over all requests being received or parsed (audio "
        "uploads are counted as they arrive, then kept on disk); a request that would pass it gets 503.",
    )
    max_schema_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest JSON schema (response_format, strict tools) accepted, in bytes of its compact JSON; "
        "larger ones get 400.",
    )
    grammar_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Memory the compiled grammars of distinct schemas may keep between requests, least recently used "
        "dropped first; 0 keeps none.",
    )
    max_embedding_tokens: int = Field(
        300_000,
        ge=1,
        description="Most tokens one /v1/embeddings, /v1/rerank or /v1/score request may hold over all its inputs (a "
        "cross-encoder's pairs); more get 400.",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU (default: torch's, at most the CPUs the process may use: its "
        "CPU affinity and its cgroup's CPU quota, rounded down).",
    )
    cpu_thread_fallback: bool = Field(
        True,
        description="On a CPU with several torch threads: when decode steps run far slower than usual (another "
        "process took a core), run on half the threads until the cores are free again (tried every few seconds).",
    )
    api_keys: CommaList = Field(
        default_factory=list,
        validation_alias=AliasChoices("api_key", "api_keys"),
        description="Accepted API keys (Authorization: Bearer KEY); repeat the flag or comma-separate. None: open.",
    )
    auth_health_and_metrics: bool = Field(False, description="Also require the API key for /health and /metrics.")
    allowed_origins: CommaList = Field(default_factory=list, description="CORS origins allowed ('*' for any).")
    allowed_methods: CommaList = Field(default_factory=lambda: ["*"], description="CORS methods allowed.")
    allowed_headers: CommaList = Field(default_factory=lambda: ["*"], description="CORS headers allowed.")
    allow_credentials: bool = Field(False, description="CORS: allow credentials.")
    shutdown_timeout: float = Field(
        30.0, ge=0, description="On SIGTERM, seconds running requests may take to finish before the server exits."
    )
    keep_alive_timeout: int = Field(5, ge=1, description="Seconds an idle kept-alive connection stays open.")
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection has to send a complete request head; late ones get 408."
    )
    body_timeout: float = Field(
        60.0, gt=0, description="Seconds a request body has to arrive once its head is in; late ones get 408."
    )
    max_connections: int = Field(
        1024, ge=1, description="Open connections allowed at once; beyond it a connection gets 503 and is closed."
    )
    stream_stall_timeout: float = Field(
        30.0,
        gt=0,
        description="A stream whose client has not taken data for this many seconds is aborted and its row freed.",
    )
    max_stored_responses: int = Field(
        1000,
        ge=0,
        description="Responses of /v1/responses kept in memory for GET and previous_response_id, least recently "
        "used dropped first; 0 stores none.",
    )
    max_stored_response_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Bytes the stored responses of /v1/responses may take together (their JSON), least recently used "
        "dropped first.",
    )
    data_dir: Path = Field(
        default_factory=lambda: _user_cache() / "transformers-openai" / "data",
        description="Where the Batch API keeps its files and batches (SQLite and the files' bytes), so a batch "
        "survives a restart and resumes (default: under $XDG_CACHE_HOME, else ~/.cache); made on first use.",
    )
    batch_concurrency: int = Field(
        4,
        ge=1,
        description="Batch API lines run at once (over all batches), each at a priority below every interactive "
        "request.",
    )
    max_batch_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, description="Largest file accepted by POST /v1/files; larger ones get 413."
    )
    max_batch_lines: int = Field(
        50_000, ge=1, description="Most lines (requests) one batch's input file may hold; more fail the batch."
    )
    max_batch_files: int = Field(
        1000, ge=1, description="Most files stored at once (uploads and batch outputs); more uploads get 400."
    )
    allowed_hosts: CommaList = Field(
        default_factory=list,
        description="Host header values accepted (others get 400), against DNS rebinding; '*' for any. Default: "
        "localhost, 127.0.0.1 and ::1 when --host is a loopback address, any otherwise.",
    )
    replica_id: str | None = Field(
        None, description="Sent back as X-Replica-Id on every response: which replica answered, behind a balancer."
    )
    metrics_compat: Literal["none", "vllm"] = Field(
        "none",
        description="'vllm': /metrics also exports the waiting, running and K/V-usage gauges under vLLM's names "
        "(vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc), as routers and the "
        "Gateway API inference extension read them.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level.")
    log_format: Literal["text", "json"] = Field("text", description="Log lines as plain text or one JSON object each.")

    def batch_rows(self, kind: str) -> int:
        """--max-batch-size, or its default for a model of `kind` (a ModelKind other than auto)."""
        decoder = kind in ("causal-lm", "image-text-to-text")
        return self.max_batch_size or (DECODER_BATCH_ROWS if decoder else OTHER_BATCH_ROWS)

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            SpeculativeSettings.model_validate_json(value)
        except ValidationError as exc:
            problems = "; ".join(
                ": ".join([*(".".join(str(part) for part in error["loc"]) for _ in error["loc"][:1]), error["msg"]])
                for error in exc.errors()
            )
            raise ValueError(f"--speculative-config / SPECULATIVE_CONFIG: {problems}") from None
        return value

    @property
    def speculative(self) -> SpeculativeSettings | None:
        """The parsed --speculative-config, or None when speculative decoding is off."""
        if self.speculative_config is None:
            return None
        return SpeculativeSettings.model_validate_json(self.speculative_config)

    @field_validator("kv_cache_memory", "models_memory_budget", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() and value.strip()[-1].isalpha():
            return float(_BYTES.validate_python(value.strip()))
        return value

    @field_validator(
        "api_keys",
        "models",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        "allowed_hosts",
        "allowed_media_domains",
        "lora_modules",
        "lora_dir",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [part.strip() for item in value for part in str(item).split(",") if part.strip()]
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _some_key_when_given(cls, value: Any) -> Any:
        """A key setting that is not blank yet names no key (API_KEY="," or " , ") is a mistake that would leave the
        server open: refused at start rather than taken as "no key"."""
        given = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if any(str(item).strip() for item in given) and not cls._split_commas(value):
            raise ValueError("the API key setting names no key (only commas and spaces): give a key, or leave it unset")
        return value

    @field_validator("lora_modules")
    @classmethod
    def _name_equals_path(cls, value: list[str]) -> list[str]:
        for item in value:
            name, equals, path = item.partition("=")
            if not equals or not name.strip() or not path.strip():
                raise ValueError(f"--lora-modules / LORA_MODULES: '{item}' is not name=path")
        return value

    @property
    def lora_paths(self) -> dict[str, Path]:
        """--lora-modules by name."""
        pairs = (item.partition("=") for item in self.lora_modules)
        return {name.strip(): Path(path.strip()) for name, _, path in pairs}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def joined_lora_modules(args: list[str]) -> list[str]:
    """vLLM's form `--lora-modules a=PATH b=PATH` (several values after one flag) as `--lora-modules a=PATH,b=PATH`,
    which the settings' parser reads."""
    joined: list[str] = []
    for arg in args:
        previous = joined[-2:]
        after_flag = previous[:1] == ["--lora-modules"] and len(previous) == 2
        after_flag = after_flag or (previous != [] and previous[-1].startswith("--lora-modules="))
        if after_flag and "=" in arg and not arg.startswith("-"):
            joined[-1] = f"{joined[-1]},{arg}"
        else:
            joined.append(arg)
    return joined
