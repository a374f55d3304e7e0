"""The fixed-batch loops' checks, once: `generate`, `stream` and `speculate` refuse the same things the same way.

Everything is checked before any state changes, then the prompts are padded
to their bucket, so few compiled programs serve every prompt length. The
engine (`kvattn.serving.Server.check`) checks its requests with the same
pieces: `kvattn.models.tokens` for ids, `Sampling` for settings.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvattn import validation as check
from kvattn.generation.sampling import Sampling
from kvattn.models.decoder import CausalLM
from kvattn.models.tokens import stop_ids, token_ids

__all__ = ["Inputs", "bucket", "checked_inputs", "checked_sampling"]


def bucket(length: int) -> int:
    """Prompt lengths are padded up to a power of two (at least 8), so few programs serve all prompts."""
    return max(8, 1 << (length - 1).bit_length())


class Inputs(NamedTuple):
    padded: np.ndarray
    """`(B, bucket)` int32: the prompts, right-padded to their bucket."""
    lengths: np.ndarray
    sampling: Sampling
    stop_tokens: tuple[int, ...]


def checked_inputs(model: CausalLM, prompts, max_new_tokens, lengths, temperature, top_k, top_p, stop_tokens,
                   rng) -> Inputs:
    """`generate`'s arguments checked (before anything changes) and padded to their bucket."""
    batch = model.blocks[0].attention.config.cache.batch_size
    prompts = token_ids(prompts, model.config.vocab_size, "prompts", (batch, None))
    check.positive_int(max_new_tokens, "max_new_tokens")
    sampling = checked_sampling(model, temperature, top_k, top_p, rng)
    stop_tokens = stop_ids(stop_tokens, model.config.vocab_size)
    num_prompt = prompts.shape[1]
    if num_prompt < 1:
        raise ValueError(f"prompts must hold at least one token, got shape {prompts.shape}")
    if lengths is None:
        lengths = np.full((batch,), num_prompt)
    else:
        lengths = np.asarray(check.host(lengths))
        if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer) or lengths.dtype == np.bool_ \
                or lengths.min() < 1 or lengths.max() > num_prompt:
            raise ValueError(
                f"lengths must be int ({batch},) in [1, {num_prompt}], got {lengths.dtype} {lengths.tolist()}"
            )
    pos = check.state(model.cache_config, model.pos)
    check.capacity(model.cache_config, pos, lengths + max_new_tokens)
    padded = np.zeros((batch, bucket(num_prompt)), np.int32)
    padded[:, :num_prompt] = prompts
    return Inputs(padded, lengths, sampling, stop_tokens)


def checked_sampling(model: CausalLM, temperature, top_k, top_p, rng) -> Sampling:
    sampling = Sampling(temperature, top_k, top_p).check_vocab(model.config.vocab_size)
    sampling.check_rng(rng)
    return sampling
