"""The one error type engines raise for requests they cannot serve."""

class EngineError(RuntimeError):
    """Raised by an engine for a request it cannot serve (e.g. context overflow, bad rewind)."""
