"""The frontend side: an OpenAI-compatible HTTP server that routes to workers and sheds load."""

__version__ = "0.1.0"
