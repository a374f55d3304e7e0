"""The drafters of speculative decoding and their side of its loop: what each offers, drafts and rolls back.

`PromptLookup` copies tokens from the sequence's own history; `DraftModel`
asks a smaller `CausalLM` (its loop side is `DraftSteps`). `Loop` is the
carry of `kvattn.generation.speculative`'s while loop, which both read.
The checks that a model can be rolled back, and a draft can draft for a
target, are here too.

Axis letters (`kvattn.math.ops`): B batch, R drafted tokens per round (`num_tokens`), V
vocabulary, S history slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import validation as check
from kvattn.generation.sampling import Sampling, sample
from kvattn.generation.speculation import Policy, lookup, probabilities
from kvattn.models.decoder import CausalLM

__all__ = [
    "MAX_DRAFT_TOKENS", "DraftModel", "DraftSteps", "Loop", "PromptLookup", "checked_draft", "draft_tokens",
    "rolls_back", "split_keys", "step_bytes",
]

MAX_DRAFT_TOKENS = 64
"""The most tokens a round drafts: past a few, a verify chunk costs like a prefill and rounds never pay."""


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Draft by copying: the tokens that followed an earlier occurrence of the sequence's last tokens.

    The longest suffix of n <= `max_ngram` tokens (the pending token
    included) that occurs earlier in the sequence's prompt or output is
    looked up, and the tokens that followed its latest occurrence are
    drafted; fewer than `num_tokens` of them are repeated, the sequence
    being in a loop (as greedy decoding often is). A sequence without a
    match drafts nothing that round.

    Args:
      num_tokens: R, the most tokens drafted per round, at most `MAX_DRAFT_TOKENS`.
      max_ngram: the longest suffix looked up (any positive int: the
        lookup's cost grows with the history, not with this).
      policy: when rounds are tried (`kvattn.generation.speculation.Policy`).
    """

    num_tokens: int
    max_ngram: int = 3
    policy: Policy = Policy()

    def __post_init__(self):
        object.__setattr__(self, "num_tokens", draft_tokens(self.num_tokens))
        object.__setattr__(self, "max_ngram", check.positive_int(self.max_ngram, "max_ngram"))
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a kvattn.generation.speculation.Policy, got {type(self.policy).__name__}")

    # The drafter's side of the loop; `DraftSteps` is the other drafter's.

    def _start(self, params, state, prompts, lengths):
        return state

    def _offer(self, loop: Loop, budget):
        drafts, widths = lookup(loop.history, loop.filled, self.num_tokens, self.max_ngram)
        widths = jnp.minimum(widths, budget)
        return jnp.where(jnp.arange(self.num_tokens)[None, :] < widths[:, None], drafts, 0), widths

    def _draft(self, params, state, loop: Loop, drafts, widths, key, sampling: Sampling):
        return drafts, None, state

    def _roll_back(self, params, state, keep):
        return state

@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
    """Draft with a smaller model: `draft` proposes, the target verifies.

    The draft shares the target's tokenizer (the same vocabulary size, which
    is checked), batch size, and the tokens its caches hold (usually none).
    Its caches are rolled back with the target's; afterwards they hold the
    prompts and a prefix of the new tokens.

    Args:
      draft: a `CausalLM` with contiguous caches.
      num_tokens: R, the most tokens drafted per round, at most `MAX_DRAFT_TOKENS`.
      policy: when rounds are tried (`kvattn.generation.speculation.Policy`).
    """

    draft: CausalLM
    num_tokens: int
    policy: Policy = Policy()

    def __post_init__(self):
        if not isinstance(self.draft, CausalLM):
            raise TypeError(f"draft must be a kvattn.models.CausalLM, got {type(self.draft).__name__}")
        object.__setattr__(self, "num_tokens", draft_tokens(self.num_tokens))
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a kvattn.generation.speculation.Policy, got {type(self.policy).__name__}")

def draft_tokens(value) -> int:
    value = check.positive_int(value, "num_tokens")
    if value > MAX_DRAFT_TOKENS:
        raise ValueError(f"num_tokens must be at most {MAX_DRAFT_TOKENS} drafts per round, got {value}")
    return value

class Loop(NamedTuple):
    """The while loop's carry."""

    target: Any  # the target's nnx.Cache state
    drafter: Any  # the drafter's: a draft model's nnx.Cache state, or ()
    origin: jax.Array  # (B,) what the caches held before the prompts: history index i is position origin + i
    history: jax.Array  # (B, S): each prompt, then its new tokens; the pending one at `filled`
    filled: jax.Array  # (B,)
    counts: jax.Array  # (B,) tokens produced
    stopped: jax.Array  # (B,) bool
    key: jax.Array
    expected: jax.Array  # float32: running estimate of drafts kept per round
    waited: jax.Array  # int32: plain steps since the last round (the first round is always tried)
    patience: jax.Array  # int32: plain steps before a round is tried regardless
    length: jax.Array  # int32: drafts a draft model makes per round
    rounds: jax.Array
    steps: jax.Array
    drafted: jax.Array  # (B,)
    accepted: jax.Array  # (B,)

def split_keys(key, count: int, sampling: Sampling):
    """`count` keys from `key`; greedy decoding reads none, so it is not split (each split is a hash to compile)."""
    return jax.random.split(key, count) if sampling.temperature > 0 else jnp.stack([key] * count)

@dataclasses.dataclass(frozen=True)
class DraftSteps:
    """A draft model's side of the loop: static (its graph, R, its vocabulary); its arrays travel apart."""

    graphdef: Any
    num_tokens: int
    vocab_size: int
    policy: Policy

    def _start(self, params, state, prompts, lengths):
        draft = nnx.merge(self.graphdef, params, state)
        draft.prefill(prompts, lengths, last_only=True)
        return nnx.state(draft, nnx.Cache)

    def _offer(self, loop: Loop, budget):
        return jnp.zeros((budget.shape[0], self.num_tokens), jnp.int32), jnp.minimum(loop.length, budget)

    def _draft(self, params, state, loop: Loop, drafts, widths, key, sampling: Sampling):
        """Feeds the draft the tokens it lacks, then drafts `widths` tokens per sequence.

        The draft lacks one token (the pending one) after a round that kept
        fewer than R drafts, two after one that kept all R (it never saw the
        last), and more after plain steps: it takes them in chunks of R + 1,
        the last chunk's logits drafting the first token.
        """
        chunk = self.num_tokens + 1
        rows = loop.history.shape[0]

        def absorb(carry):
            state, lag, first = carry
            draft = nnx.merge(self.graphdef, params, state)
            columns = (draft.pos - loop.origin)[:, None] + jnp.arange(chunk)[None, :]
            take = jnp.minimum(lag, chunk)
            tokens = jnp.take_along_axis(loop.history, jnp.minimum(columns, loop.history.shape[1] - 1), axis=1)
            tokens = jnp.where(jnp.arange(chunk)[None, :] < take[:, None], tokens, 0)
            logits = draft.prefill(tokens, take, last_only=True)
            first = jnp.where(((lag > 0) & (lag <= chunk))[:, None], logits, first)
            return nnx.state(draft, nnx.Cache), lag - take, first

        held = nnx.merge(self.graphdef, params, state).pos - loop.origin
        lag = jnp.where(widths > 0, loop.filled + 1 - held, 0)
        state, _, first = jax.lax.while_loop(
            lambda carry: jnp.any(carry[1] > 0), absorb, (state, lag, jnp.zeros((rows, self.vocab_size), jnp.float32))
        )
        greedy = sampling.temperature == 0.0
        keys = split_keys(key, self.num_tokens, sampling)

        def pick(logits, index, drafts, q):
            """The draft's token at `index`, drawn by the target's sampler, and the distribution it came from."""
            token = sample(logits, keys[index], sampling)
            return drafts.at[:, index].set(token), None if greedy else q.at[:, index].set(probabilities(logits, sampling))

        q = None if greedy else jnp.zeros((rows, self.num_tokens, self.vocab_size), jnp.float32)
        drafts, q = pick(first, 0, drafts, q)

        def step(index, carry):
            state, drafts, q = carry
            draft = nnx.merge(self.graphdef, params, state)
            logits = draft.step(drafts[:, index - 1], active=index < widths)
            drafts, q = pick(logits, index, drafts, q)
            return nnx.state(draft, nnx.Cache), drafts, q

        state, drafts, q = jax.lax.fori_loop(1, jnp.max(widths), step, (state, drafts, q))
        return jnp.where(jnp.arange(self.num_tokens)[None, :] < widths[:, None], drafts, 0), q, state

    def _roll_back(self, params, state, keep):
        draft = nnx.merge(self.graphdef, params, state)
        draft.truncate(jnp.minimum(draft.pos, keep))
        return nnx.state(draft, nnx.Cache)

def rolls_back(model: CausalLM, name: str, num_tokens: int) -> None:
    """Refuses a model whose caches `truncate` cannot roll back `num_tokens` refused drafts.

    Paged caches belong to a `PageManager`; a sliding-window ring rolls back
    its spare slots and one (`kvattn.Contiguous`).
    """
    if model.cache_config.cache.paged:
        raise ValueError(
            f"speculative decoding here needs contiguous caches; the {name} is paged (its sequences belong to a "
            "PageManager): build it without num_pages and page_size"
        )
    for block in model.blocks:
        config = block.attention.config
        if config.window is not None and config.cache.spare_slots + 1 < num_tokens:
            raise ValueError(
                f"speculative decoding of up to {num_tokens} drafts rolls caches back that many tokens, which the "
                f"{name}'s sliding-window ring of {config.window} slots with spare_slots="
                f"{config.cache.spare_slots} cannot (it rolls back spare_slots + 1); build it with "
                f"spare_slots >= {num_tokens - 1}, or with max_len <= {config.window}"
            )

def checked_draft(draft: CausalLM, model: CausalLM, lengths, max_new_tokens: int, num_tokens: int):
    """The draft's params and caches and its cost per step in target steps, after checking it can draft for `model`."""
    if draft is model:
        raise ValueError("the draft model must be another CausalLM than the target (their caches differ)")
    rolls_back(draft, "draft model", num_tokens)
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft model must share the target's vocabulary: vocab_size {model.config.vocab_size} expected, "
            f"got {draft.config.vocab_size}"
        )
    batch, draft_batch = (m.blocks[0].attention.config.cache.batch_size for m in (model, draft))
    if draft_batch != batch:
        raise ValueError(f"the draft model must have the target's batch size {batch}, got batch_size={draft_batch}")
    held = check.state(draft.cache_config, draft.pos)
    target_held = np.asarray(model.pos)
    if not np.array_equal(held, target_held):
        raise ValueError(
            f"the draft model's caches must hold what the target's hold: pos {target_held.tolist()} expected, got "
            f"{held.tolist()} (reset() both, or truncate them alike)"
        )
    check.capacity(draft.cache_config, held, np.asarray(lengths) + max_new_tokens)
    _, params, cache = nnx.split(draft, nnx.Param, nnx.Cache)
    return params, cache, step_bytes(draft) / step_bytes(model)

def step_bytes(model: CausalLM) -> int:
    """Weight bytes one decode step reads: all but the embedding table (one row), unless the output reads it whole."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    unread = 0 if model.config.tie_embeddings else model.embed[...].nbytes
    if model.positions is not None:
        unread += model.positions[...].nbytes
    return total - unread
