"""What every handler needs: the engine, the tokenizer and the model's limits."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from numpy.typing import NDArray

from transformers_openai.engine.embedding_engine import TokenPair
from transformers_openai.engine.lora_adapters import LoraAdapter, LoraAdapters
from transformers_openai.engine.request import EngineRequest, RequestOutput
from transformers_openai.protocol.common import ModelCard
from transformers_openai.serving.errors import BadRequestError, ModelNotFoundError
from transformers_openai.serving.prompt_limits import PromptLimits
from transformers_openai.serving.speech.whisper_tokens import WhisperTokens
from transformers_openai.serving.text.structured_output import StructuredOutputs
from transformers_openai.serving.text.tool_formats import HERMES, ToolFormat
from transformers_openai.serving.tokenizer import TokenizerService


class Capability(str, enum.Enum):
    """What a served model can do: which endpoint families it answers."""

    TEXT = "text"  # /v1/chat/completions, /v1/completions
    SPEECH = "speech"  # /v1/audio/transcriptions, /v1/audio/translations
    EMBEDDINGS = "embeddings"  # /v1/embeddings
    SCORES = "scores"  # /v1/rerank, /v1/score: a cross-encoder's, or an embedding model's cosine similarity
    VISION = "vision"  # image parts in chat (and Responses) messages


class EngineClient(Protocol):
    """The engine's surface as the serving layer uses it (AsyncEngine, or a fake in tests)."""

    @property
    def running(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def submit(self, requests: Sequence[EngineRequest]) -> list[AsyncIterator[RequestOutput]]: ...

    def abort(self, request_id: str) -> None: ...

    def fail_in_flight(self, message: str) -> int: ...

    def stats(self) -> Any: ...


class SpeechObserver(Protocol):
    """Told of every finished transcription (the metrics)."""

    def on_transcription(self, endpoint: str, audio_seconds: float, real_time_factor: float) -> None: ...


class SpeechClient(Protocol):
    """The speech model's work outside the batch (`engine.speech_calls.SpeechCalls`, or a fake in tests)."""

    async def detect_language(
        self,
        features: NDArray[Any],
        sot: int,
        language_tokens: Sequence[int],
        window: tuple[str, int] | None = None,
        lora: LoraAdapter | None = None,
    ) -> int: ...

    async def alignment_weights(
        self, features: NDArray[Any], tokens: list[int], lora: LoraAdapter | None = None
    ) -> Any: ...

    async def release_windows(self, key: str) -> None: ...


@dataclass(frozen=True)
class SpeechModel:
    """What the audio endpoints need beside the engine: features, special tokens, the model's own calls, limits."""

    feature_extractor: Any  # WhisperFeatureExtractor
    tokens: WhisperTokens
    calls: SpeechClient
    max_audio_seconds: float
    max_audio_decodes: int = 2  # uploads decoded at once
    observer: SpeechObserver | None = None

    @property
    def sampling_rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    @property
    def hop_length(self) -> int:
        return int(self.feature_extractor.hop_length)


class EmbedClient(Protocol):
    """The embedding engine as the embeddings handler uses it (EmbeddingEngine, or a fake in tests)."""

    async def embed(self, inputs: list[list[int]], priority: int = 0) -> list[Any]:
        """The vectors of `inputs`; while requests of a lower `priority` value wait, those of a higher one wait."""
        ...


@dataclass(frozen=True)
class EmbeddingModel:
    """What /v1/embeddings needs beside the tokenizer: the engine that embeds and the model's limits.

    `normalized`: vectors come out with unit length (a vector cut to `dimensions` is scaled back to it).
    `matryoshka`: the model was trained to be cut short (`dimensions` is allowed), to any size up to `width` or,
    where `matryoshka_dims` names them, to those sizes only.
    """

    engine: EmbedClient
    max_input_len: int
    width: int
    normalized: bool
    matryoshka: bool = False
    matryoshka_dims: tuple[int, ...] | None = None
    max_total_tokens: int = 300_000  # tokens one request may hold over all its inputs (--max-embedding-tokens)


class PairScoreClient(Protocol):
    """The embedding engine running a cross-encoder, as the score handler uses it (EmbeddingEngine, or a fake)."""

    async def embed(self, inputs: list[TokenPair]) -> list[Any]: ...


@dataclass(frozen=True)
class CrossEncoderModel:
    """What /v1/rerank and /v1/score need of a cross-encoder beside the tokenizer: the engine that scores token
    pairs (one float each) and the model's limits."""

    engine: PairScoreClient
    max_input_len: int  # tokens of one pair, the special tokens included
    max_total_tokens: int = 300_000  # tokens one request may hold over all its pairs (--max-embedding-tokens)


class VisionPrompts(Protocol):
    """A vision-language model's prompts: chat messages with images rendered and tokenized by the model's own
    processor (`serving/vision/`), or a fake in tests."""

    async def encode_chat(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], dict[str, Any]]:
        """The prompt's token ids (each image's placeholder tokens in place) and what the runner needs to encode its
        images (`EngineRequest.encoder_inputs`); `messages` are `protocol.ChatMessage`s. A bad image is a 400."""
        ...


@dataclass
class ServingContext:
    engine: EngineClient
    tokenizer: TokenizerService
    model_name: str
    model_aliases: frozenset[str]
    max_model_len: int
    model_kind: str
    # Encoder-decoder models: the encoder's input limit, apart from the `max_model_len` tokens generated.
    max_input_len: int | None = None
    response_role: str = "assistant"
    default_max_tokens: int | None = None
    capabilities: frozenset[Capability] = frozenset({Capability.TEXT})
    speech: SpeechModel | None = None
    # The text prompt goes to an encoder (T5), not before the generated text: as the model kind declares it.
    encoder_decoder: bool = False
    structured: StructuredOutputs | None = None  # response_format's schemas and forced tool calls (text models)
    tool_format: ToolFormat = HERMES  # how the model writes tool calls
    prompt_limits: PromptLimits | None = None  # cheap limits checked on the raw body before anything else
    max_stored_responses: int = 1000  # /v1/responses kept for GET and previous_response_id; 0: none
    max_stored_response_bytes: int = 256 * 1024 * 1024  # what they may take together, as bytes of their JSON
    embeddings: EmbeddingModel | None = None  # embedding models: /v1/embeddings (and scores by cosine similarity)
    cross_encoder: CrossEncoderModel | None = None  # cross-encoders: /v1/rerank and /v1/score
    quantization: str = "none"  # how the weights are quantized (transformers_openai.quantization.describe)
    vision: VisionPrompts | None = None  # vision-language models: prompts with images
    # How the thought is told from the answer (settings.reasoning_parser: auto, none, deepseek_r1, qwen3,
    # response_schema), and the chat template's variables for every request (a request's own override them).
    reasoning_parser: str = "none"
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    adapters: LoraAdapters | None = None  # the model's LoRA adapters, requested by their names (--lora-modules)

    def image_prompts(self) -> VisionPrompts:
        """The model's prompts with images; a 400 naming the messages for a model that reads none."""
        if self.vision is None:
            raise BadRequestError(f"the model '{self.model_name}' does not read images", param="messages")
        return self.vision

    def serves(self, name: str) -> bool:
        """Whether a request may name `name`: the served model (its served name or its path) or a resident adapter;
        the registry of a server with several models asks each loaded one."""
        return name in self.model_aliases or self.adapter(name) is not None

    def check_model(self, name: str) -> None:
        """A request must name what this model serves (`serves`): anything else is a 404."""
        if not self.serves(name):
            raise ModelNotFoundError(f"the model '{name}' does not exist", param="model")

    def adapter(self, name: str | None) -> LoraAdapter | None:
        """The resident LoRA adapter a request names, None for the base model (or a name that is no adapter)."""
        if self.adapters is None or name is None or name in self.model_aliases:
            return None
        return self.adapters.get(name)

    def adapter_cards(self) -> list[ModelCard]:
        """The resident adapters as /v1/models lists them: each with its base model as `parent`, its path as `root`."""
        if self.adapters is None:
            return []
        return [
            ModelCard(id=adapter.name, root=str(adapter.path), parent=self.model_name, max_model_len=self.max_model_len)
            for adapter in self.adapters.resident()
        ]
