"""Decoder-only language models on kvattn layers, loaded from Hugging Face checkpoints without torch.

Generating text with them is `kvattn.generation` (fixed batches) and
`kvattn.LLM` / `kvattn.serving` (continuous batching).
"""

from kvattn.errors import CheckpointError, UnsupportedConfigError
from kvattn.models.decoder import CausalLM
from kvattn.models.hf import checkpoint_config, eos_token_ids, from_pretrained, load_safetensors
from kvattn.models.model_config import ModelConfig, from_hf_config

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "UnsupportedConfigError",
    "checkpoint_config",
    "eos_token_ids",
    "from_hf_config",
    "from_pretrained",
    "load_safetensors",
]
