"""Decoder-only language models on kvattn layers, loaded from Hugging Face checkpoints without torch."""

from kvattn.errors import CheckpointError, UnsupportedConfigError
from kvattn.models.config import ModelConfig, from_hf_config
from kvattn.models.decoder import DecoderLM
from kvattn.models.generate import Generated, generate, stream
from kvattn.models.hf import from_pretrained, load_safetensors
from kvattn.models.sampling import Sampling
from kvattn.models.serving import Completion, Server

__all__ = [
    "CheckpointError",
    "Completion",
    "DecoderLM",
    "Generated",
    "ModelConfig",
    "UnsupportedConfigError",
    "from_hf_config",
    "from_pretrained",
    "generate",
    "load_safetensors",
    "Sampling",
    "Server",
    "stream",
]
