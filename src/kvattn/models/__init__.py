"""Decoder-only language models on kvattn layers, loaded from Hugging Face checkpoints without torch."""

from kvattn.errors import CheckpointError, UnsupportedConfigError
from kvattn.models.model_config import ModelConfig, from_hf_config
from kvattn.models.decoder import CausalLM
from kvattn.models.generate import Generated, generate, stream
from kvattn.models.hf import from_pretrained, load_safetensors
from kvattn.models.sampling import Sampling

__all__ = [
    "CausalLM",
    "CheckpointError",
    "Generated",
    "ModelConfig",
    "UnsupportedConfigError",
    "from_hf_config",
    "from_pretrained",
    "generate",
    "load_safetensors",
    "Sampling",
    "stream",
]
