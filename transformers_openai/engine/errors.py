"""Errors the engine raises; the API layer maps them to HTTP responses."""


class EngineError(Exception):
    """A failure inside the engine that ends the requests it touched."""


class EngineOverloaded(EngineError):
    """The running batch and the waiting queue are both full."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManySequences(EngineError):
    """One submission asks for more sequences than the engine could ever hold at once."""


class DuplicateRequestId(EngineError):
    """A request id that is already in flight."""


class EngineStopped(EngineError):
    """The engine is not running (not started yet, or shutting down)."""


class ConstraintFailed(EngineError):
    """A request's own token constraint cannot go on (its grammar failed, or costs too much to follow): that request
    ends alone, as a fault of what it asked for (`ErrorKind.CONSTRAINT`), not of the engine."""
