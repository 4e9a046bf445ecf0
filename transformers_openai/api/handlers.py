"""The handlers of one served model's endpoint families, built from its serving context."""

from __future__ import annotations

from dataclasses import dataclass

from transformers_openai.serving.context import Capability, ServingContext
from transformers_openai.serving.embeddings import EmbeddingHandler
from transformers_openai.serving.errors import BadRequestError
from transformers_openai.serving.messages.handler import MessagesHandler
from transformers_openai.serving.scoring.handler import ScoreHandler
from transformers_openai.serving.speech.transcription import TranscriptionHandler
from transformers_openai.serving.text.chat import ChatHandler
from transformers_openai.serving.text.completions import CompletionHandler
from transformers_openai.serving.text.response_store import ResponseStore
from transformers_openai.serving.text.responses import ResponsesHandler
from transformers_openai.serving.tokenize import TokenizeHandler


@dataclass(frozen=True)
class Handlers:
    """The handlers of the served model's endpoint families; a family it cannot serve is a clear 400."""

    model_name: str
    text: tuple[ChatHandler, CompletionHandler] | None
    speech: TranscriptionHandler | None
    tokenize: TokenizeHandler  # every model kind has a tokenizer
    text_responses: ResponsesHandler | None = None  # /v1/responses, through the chat handler
    embedder: EmbeddingHandler | None = None
    scorer: ScoreHandler | None = None  # /v1/rerank and /v1/score: cross-encoders and embedding models
    text_messages: MessagesHandler | None = None  # Anthropic's /v1/messages, through the chat handler

    @property
    def chat(self) -> ChatHandler:
        return self._text()[0]

    @property
    def completions(self) -> CompletionHandler:
        return self._text()[1]

    @property
    def responses(self) -> ResponsesHandler:
        self._text()  # a speech model: the same 400 as chat
        assert self.text_responses is not None  # built whenever `text` is
        return self.text_responses

    @property
    def messages(self) -> MessagesHandler:
        self._text()  # a speech model: the same 400 as chat
        assert self.text_messages is not None  # built whenever `text` is
        return self.text_messages

    @property
    def embeddings(self) -> EmbeddingHandler:
        if self.embedder is None and self.scorer is not None:
            raise BadRequestError(
                f"the model '{self.model_name}' is a cross-encoder: it scores a query and a document together and "
                "gives no vectors; use /v1/rerank or /v1/score",
                param="model",
                code="model_not_supported",
            )
        if self.embedder is None:
            raise BadRequestError(
                f"the model '{self.model_name}' is not served as an embedding model; start the server with an "
                "embedding model, or with --model-kind embedding for a decoder's last-token vectors",
                param="model",
                code="model_not_supported",
            )
        return self.embedder

    @property
    def scores(self) -> ScoreHandler:
        if self.scorer is None:
            raise BadRequestError(
                f"the model '{self.model_name}' does not score text pairs: /v1/rerank and /v1/score serve "
                "cross-encoders (a sequence classifier with one label) and embedding models (cosine similarity)",
                param="model",
                code="model_not_supported",
            )
        return self.scorer

    @property
    def transcriptions(self) -> TranscriptionHandler:
        if self._pooling_only:
            raise self._embedding_only()
        if self.speech is None:
            raise BadRequestError(
                f"the model '{self.model_name}' is a text model: it does not take audio; "
                "use /v1/chat/completions or /v1/completions",
                param="model",
                code="model_not_supported",
            )
        return self.speech

    @property
    def _pooling_only(self) -> bool:
        """An embedding model or a cross-encoder: it neither generates text nor transcribes."""
        return self.text is None and self.speech is None and (self.embedder is not None or self.scorer is not None)

    def _embedding_only(self) -> BadRequestError:
        """The answer of an embedding model or a cross-encoder to a route that generates."""
        kind, routes = (
            ("an embedding model", "/v1/embeddings")
            if self.embedder is not None
            else ("a cross-encoder", "/v1/rerank or /v1/score")
        )
        return BadRequestError(
            f"the model '{self.model_name}' is {kind}: it does not generate text; use {routes}",
            param="model",
            code="model_not_supported",
        )

    def _text(self) -> tuple[ChatHandler, CompletionHandler]:
        if self._pooling_only:
            raise self._embedding_only()
        if self.text is None:
            raise BadRequestError(
                f"the model '{self.model_name}' is a speech recognition model: it does not take text prompts; "
                "use /v1/audio/transcriptions or /v1/audio/translations",
                param="model",
                code="model_not_supported",
            )
        return self.text

    @classmethod
    def for_context(cls, context: ServingContext) -> Handlers:
        text = (ChatHandler(context), CompletionHandler(context)) if Capability.TEXT in context.capabilities else None
        speech = TranscriptionHandler(context) if Capability.SPEECH in context.capabilities else None
        tokenize = TokenizeHandler(context, text[0].tools if text is not None else None)
        store = ResponseStore(context.max_stored_responses, context.max_stored_response_bytes)
        responses = ResponsesHandler(text[0], store) if text is not None else None
        embedder = EmbeddingHandler(context) if Capability.EMBEDDINGS in context.capabilities else None
        scorer = ScoreHandler(context) if Capability.SCORES in context.capabilities else None
        messages = MessagesHandler(text[0]) if text is not None else None
        return cls(
            context.model_name,
            text,
            speech,
            tokenize,
            text_responses=responses,
            embedder=embedder,
            scorer=scorer,
            text_messages=messages,
        )
