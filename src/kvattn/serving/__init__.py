"""Serving requests on a paged model: continuous batching with prefix caching and preemption."""

from kvattn.serving.server import Completion, Server, Stats, Token

__all__ = ["Completion", "Server", "Stats", "Token"]
