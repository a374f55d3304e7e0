"""The model families kvattn runs, one file each, and the registry from a checkpoint's `model_type` to its family.

Each file (`gpt2`, `llama`, `gemma`) defines a `kvattn.models.spec.Family` (`llama` a second, Phi-3's): its
`config.json` translation, its block spec and its weight table. Adding a
family is one file here, one line per `model_type` in `MODEL_TYPES`, and
its fixtures and tests.
"""

from __future__ import annotations

from kvattn.models.families import gemma, gpt2, llama
from kvattn.models.spec import Family

__all__ = ["FAMILIES", "MODEL_TYPES"]

MODEL_TYPES: dict[str, Family] = {
    "gpt2": gpt2.FAMILY,
    "llama": llama.FAMILY,
    "mistral": llama.FAMILY,
    "qwen2": llama.FAMILY,
    "qwen3": llama.FAMILY,
    "phi3": llama.PHI3,
    "gemma2": gemma.FAMILY,
    "gemma3_text": gemma.FAMILY,
}

# By `ModelConfig.family`.
FAMILIES: dict[str, Family] = {family.name: family for family in MODEL_TYPES.values()}
