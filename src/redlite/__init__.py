"""redlite: an OpenAI-compatible inference server that keeps conversation state across turns."""

__version__ = "0.1.0"
