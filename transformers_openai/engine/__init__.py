"""The continuous-batching engine: scheduler, sampling, stopping and the async front. Knows nothing of HTTP."""

from transformers_openai.engine.async_engine import AsyncEngine
from transformers_openai.engine.errors import EngineError, EngineOverloaded, EngineStopped
from transformers_openai.engine.request import EngineRequest, ErrorKind, FinishReason, RequestOutput, TokenLogprob
from transformers_openai.engine.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineError",
    "EngineOverloaded",
    "EngineRequest",
    "EngineStopped",
    "ErrorKind",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
