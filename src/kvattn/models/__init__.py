"""Decoder-only language models on kvattn layers, loaded from Hugging Face checkpoints without torch."""

from kvattn.errors import CheckpointError, UnsupportedConfigError
from kvattn.models.decoder import CausalLM
from kvattn.models.generate import Generated, generate, stream
from kvattn.models.hf import from_pretrained, load_safetensors
from kvattn.models.model_config import ModelConfig, from_hf_config
from kvattn.models.sampling import Sampling
from kvattn.models.speculative import DraftModel, PromptLookup, Speculated, speculate

__all__ = [
    "CausalLM",
    "CheckpointError",
    "DraftModel",
    "Generated",
    "ModelConfig",
    "PromptLookup",
    "Sampling",
    "Speculated",
    "UnsupportedConfigError",
    "from_hf_config",
    "from_pretrained",
    "generate",
    "load_safetensors",
    "speculate",
    "stream",
]
