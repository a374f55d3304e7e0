"""Serving requests on a paged model: continuous batching with prefix caching and preemption."""

from kvattn.serving.requests import Completion, Stats, Token
from kvattn.serving.server import Server

__all__ = ["Completion", "Server", "Stats", "Token"]
