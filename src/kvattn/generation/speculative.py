"""Speculative decoding: several tokens per call of the target model, exactly the tokens (or the distribution) of `generate`.

A round drafts up to K tokens per sequence, then the target scores the
pending token and the drafts in one `prefill` chunk of K + 1 tokens. Each
sequence keeps the drafts the target agrees with, plus one token of the
target's own (the correction at the first disagreement, or a bonus token
after a fully kept run), and `truncate` rolls every cache, target and draft,
back to exactly what was kept. Sequences keep their own numbers of tokens
per round; a stop token inside a kept run ends its sequence there.

Two drafters:

- `PromptLookup` copies: the tokens that followed the latest earlier
  occurrence of the sequence's last n tokens (n up to `max_ngram`) in its
  own prompt and output. No second model, so drafting costs next to nothing.
- `DraftModel` asks a smaller `CausalLM` with the same vocabulary.

**Exact.** Greedy keeps a draft when it is the target's argmax, so the
output is plain greedy decoding's. Sampling is speculative sampling: a draft
d drawn from q is kept with probability min(1, p(d) / q(d)); at the first
one refused, the token is drawn from the normalised (p - q)+; after a fully
kept run, from p. p and q are what `Sampling` samples from (temperature,
top-k and top-p applied), so every token has the distribution plain sampling
gives it. For prompt lookup q is a point mass on the draft.

**Adaptive.** A round costs more than a step: the verify chunk, and for a
draft model its steps. The loop keeps a running estimate of the drafts
accepted per round and runs rounds only while they pay for themselves
(decoding is bandwidth bound, so a draft step costs the share of the
target's weight bytes that the draft reads); otherwise it takes plain steps,
as `generate` does, and tries a round again after `Policy.probe_every` steps
(twice as long after each try that did not pay). A draft model drafts one
token more than rounds have lately kept.

The whole generation is one compiled program, compiled once per batch, K
and prompt bucket (and, as `generate`'s, per `max_new_tokens`, sampling and
stop tokens): a `lax.while_loop` whose body runs rounds while they are
wanted, then plain steps until a round is, each in a loop of its own (a
branch per token would copy the carried caches each time on a CPU). A round
never drafts past `max_new_tokens`, so the caches need no more room than
plain `generate` needs.

The pure pieces, drafting by lookup, verifying and the policy deciding
when rounds pay, are in `kvattn.generation.speculation`, which the serving
engine runs too.

Axis letters: B batch, K drafted tokens per round (`num_tokens`), V
vocabulary, S history slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn import validation as check
from kvattn.generation.inputs import checked_inputs
from kvattn.generation.sampling import Sampling, sample
from kvattn.generation.speculation import Policy, lookup, probabilities, verify
from kvattn.models.decoder import CausalLM

__all__ = ["MAX_DRAFT_TOKENS", "DraftModel", "PromptLookup", "Speculated", "speculate"]

MAX_DRAFT_TOKENS = 64
"""The most tokens a round drafts: past a few, a verify chunk costs like a prefill and rounds never pay."""

# ---------------------------------------------------------------- the options


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
      num_tokens: K, the most tokens drafted per round, at most `MAX_DRAFT_TOKENS`.
      max_ngram: the longest suffix looked up (any positive int: the
        lookup's cost grows with the history, not with this).
      policy: when rounds are tried (`kvattn.generation.speculation.Policy`).
    """

    num_tokens: int
    max_ngram: int = 3
    policy: Policy = Policy()

    def __post_init__(self):
        object.__setattr__(self, "num_tokens", _draft_tokens(self.num_tokens))
        object.__setattr__(self, "max_ngram", check.positive_int(self.max_ngram, "max_ngram"))
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a kvattn.generation.speculation.Policy, got {type(self.policy).__name__}")

    # The drafter's side of the loop; `_DraftSteps` is the other drafter's.

    def _start(self, params, state, prompts, lengths):
        return state

    def _offer(self, loop: _Loop, budget):
        drafts, widths = lookup(loop.history, loop.filled, self.num_tokens, self.max_ngram)
        widths = jnp.minimum(widths, budget)
        return jnp.where(jnp.arange(self.num_tokens)[None, :] < widths[:, None], drafts, 0), widths

    def _draft(self, params, state, loop: _Loop, drafts, widths, key, sampling: Sampling):
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
      num_tokens: K, the most tokens drafted per round, at most `MAX_DRAFT_TOKENS`.
      policy: when rounds are tried (`kvattn.generation.speculation.Policy`).
    """

    draft: CausalLM
    num_tokens: int
    policy: Policy = Policy()

    def __post_init__(self):
        if not isinstance(self.draft, CausalLM):
            raise TypeError(f"draft must be a kvattn.models.CausalLM, got {type(self.draft).__name__}")
        object.__setattr__(self, "num_tokens", _draft_tokens(self.num_tokens))
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a kvattn.generation.speculation.Policy, got {type(self.policy).__name__}")


def _draft_tokens(value) -> int:
    value = check.positive_int(value, "num_tokens")
    if value > MAX_DRAFT_TOKENS:
        raise ValueError(f"num_tokens must be at most {MAX_DRAFT_TOKENS} drafts per round, got {value}")
    return value


class Speculated(NamedTuple):
    """What `speculate` returns: `generate`'s tokens and counts, and how the rounds went."""

    tokens: jax.Array
    """`(B, max_new_tokens)` int32; after a stop token, zeros."""
    counts: jax.Array
    """`(B,)` int32: tokens each sequence produced, its stop token included."""
    rounds: jax.Array
    """int32: verify calls, each one `prefill` of K + 1 tokens by the target."""
    steps: jax.Array
    """int32: plain steps, taken while rounds did not pay."""
    drafted: jax.Array
    """`(B,)` int32: drafts the target verified, per sequence."""
    accepted: jax.Array
    """`(B,)` int32: the drafts it kept."""

    @property
    def acceptance(self) -> float:
        """The share of verified drafts kept, over the batch (NaN when nothing was drafted)."""
        drafted = int(np.sum(self.drafted))
        return int(np.sum(self.accepted)) / drafted if drafted else float("nan")


# ------------------------------------------------------------------- the loop


class _Loop(NamedTuple):
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


def _split(key, count: int, sampling: Sampling):
    """`count` keys from `key`; greedy decoding reads none, so it is not split (each split is a hash to compile)."""
    return jax.random.split(key, count) if sampling.temperature > 0 else jnp.stack([key] * count)


def _put(history, columns, tokens, rows):
    """`history` with `tokens` `(B, T)` written at `columns` `(B, T)` of the chosen `rows`; others dropped."""
    columns = jnp.where(rows[:, None], columns, history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], columns].set(tokens, mode="drop")


@dataclasses.dataclass(frozen=True)
class _DraftSteps:
    """A draft model's side of the loop: static (its graph, K, its vocabulary); its arrays travel apart."""

    graphdef: Any
    num_tokens: int
    vocab_size: int
    policy: Policy

    def _start(self, params, state, prompts, lengths):
        draft = nnx.merge(self.graphdef, params, state)
        draft.prefill(prompts, lengths, last_only=True)
        return nnx.state(draft, nnx.Cache)

    def _offer(self, loop: _Loop, budget):
        return jnp.zeros((budget.shape[0], self.num_tokens), jnp.int32), jnp.minimum(loop.length, budget)

    def _draft(self, params, state, loop: _Loop, drafts, widths, key, sampling: Sampling):
        """Feeds the draft the tokens it lacks, then drafts `widths` tokens per sequence.

        The draft lacks one token (the pending one) after a round that kept
        fewer than K drafts, two after one that kept all K (it never saw the
        last), and more after plain steps: it takes them in chunks of K + 1,
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
        keys = _split(key, self.num_tokens, sampling)

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


@functools.partial(
    jax.jit, static_argnames=("graphdef", "drafter", "max_new_tokens", "sampling", "stop_tokens")
)
def _program(graphdef, params, cache, drafter, drafter_params, drafter_state, prompts, lengths, key, cost,
             max_new_tokens, sampling, stop_tokens):
    """The whole speculative generation: prefill, then rounds or plain steps until every sequence is done."""
    model = nnx.merge(graphdef, params, cache)
    origin = model.pos
    logits = model.prefill(prompts, lengths, last_only=True)
    key, first = _split(key, 2, sampling)
    drafter_state = drafter._start(drafter_params, drafter_state, prompts, lengths)
    batch, width = prompts.shape
    num_tokens = drafter.num_tokens
    policy = drafter.policy
    everyone = jnp.ones((batch,), jnp.bool_)
    history = jnp.zeros((batch, width + max_new_tokens + num_tokens + 1), jnp.int32).at[:, :width].set(prompts)
    history = _put(history, lengths[:, None], sample(logits, first, sampling)[:, None], everyone)
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    zero = jnp.zeros((batch,), jnp.int32)
    loop = _Loop(
        nnx.state(model, nnx.Cache), drafter_state, origin, history, lengths, zero, jnp.zeros((batch,), jnp.bool_),
        key, jnp.float32(num_tokens), jnp.int32(policy.probe_every), jnp.int32(policy.probe_every), jnp.int32(num_tokens),
        jnp.int32(0),
        jnp.int32(0), zero, zero,
    )

    def done(loop):
        return loop.stopped | (loop.counts >= max_new_tokens)

    def is_stop(tokens):
        return jnp.any(tokens[..., None] == stops.reshape((1,) * tokens.ndim + (-1,)), axis=-1)

    def plain(loop):
        """One step of `generate`: the pending token enters the target's caches, and the next is sampled."""
        model = nnx.merge(graphdef, params, loop.target)
        active = ~done(loop)
        token = jnp.take_along_axis(loop.history, loop.filled[:, None], axis=1)[:, 0]
        stop = is_stop(token) & active
        logits = model.step(token, active=active & ~stop)
        key, sub = _split(loop.key, 2, sampling)
        history = _put(loop.history, loop.filled[:, None] + 1, sample(logits, sub, sampling)[:, None], active)
        moved = active.astype(jnp.int32)
        return loop._replace(
            target=nnx.state(model, nnx.Cache), history=history, filled=loop.filled + moved,
            counts=loop.counts + moved, stopped=loop.stopped | stop, key=key, waited=loop.waited + 1,
            steps=loop.steps + 1,
        )

    def round_(loop, drafts, widths):
        """Draft, verify in one chunk, keep what the target agrees with, roll the caches back to it."""
        active = ~done(loop)
        key, draft_key, verify_key = _split(loop.key, 3, sampling)
        drafts, q, drafter_state = drafter._draft(
            drafter_params, loop.drafter, loop, drafts, widths, draft_key, sampling
        )
        pending = jnp.take_along_axis(loop.history, loop.filled[:, None], axis=1)
        chunk = jnp.concatenate([pending, drafts], axis=1)
        model = nnx.merge(graphdef, params, loop.target)
        before = model.pos
        logits = model.prefill(chunk, jnp.where(active, widths + 1, 0))
        if sampling.temperature == 0.0:
            kept, token, _ = verify(logits, drafts, widths, None, None, None, None)
        else:
            settings = (jnp.full((batch,), value) for value in (
                sampling.temperature, sampling.top_k or 0, 1.0 if sampling.top_p is None else sampling.top_p))
            keys = jax.random.split(verify_key, batch * (num_tokens + 1)).reshape(batch, num_tokens + 1)
            kept, token, _ = verify(logits, drafts, widths, *settings, keys, q)
        # The run produced is the pending token and the kept drafts, up to a stop token.
        run = jnp.arange(num_tokens + 1)[None, :] <= kept[:, None]
        stopping = is_stop(chunk) & run if stop_tokens else jnp.zeros(chunk.shape, jnp.bool_)
        stop = jnp.any(stopping, axis=1) & active
        produced = jnp.where(active, jnp.where(stop, jnp.argmax(stopping, axis=1) + 1, kept + 1), 0)
        keep = before + produced - stop.astype(jnp.int32)  # a stop token never enters the caches, as in generate
        model.truncate(keep)
        drafter_state = drafter._roll_back(drafter_params, drafter_state, keep)
        columns = loop.filled[:, None] + jnp.arange(num_tokens + 1)[None, :]
        history = _put(loop.history, columns, chunk, active)
        history = _put(history, (loop.filled + produced)[:, None], token[:, None], active & ~stop)
        trying = active & (widths > 0)
        kept_mean = jnp.sum(jnp.where(trying, kept, 0)) / jnp.maximum(jnp.sum(trying), 1)
        expected = policy.estimate(loop.expected, kept_mean).astype(jnp.float32)
        length = jnp.clip(jnp.round(expected).astype(jnp.int32) + 1, 1, num_tokens)
        patience = policy.patience(expected, loop.patience, cost, length.astype(jnp.float32))
        return loop._replace(
            target=nnx.state(model, nnx.Cache), drafter=drafter_state, history=history,
            filled=loop.filled + produced, counts=loop.counts + produced, stopped=loop.stopped | stop, key=key,
            expected=expected, waited=jnp.int32(0), patience=patience.astype(jnp.int32), length=length,
            rounds=loop.rounds + 1, drafted=loop.drafted + jnp.where(active, widths, 0),
            accepted=loop.accepted + jnp.where(active, kept, 0),
        )

    def offer(loop):
        """What the drafter would draft now, and whether a round is wanted: drafts to verify, and rounds pay or are due."""
        budget = jnp.where(done(loop), 0, max_new_tokens - loop.counts - 1)
        drafts, widths = drafter._offer(loop, budget)
        wanted = jnp.any(widths > 0) & policy.wants_round(loop.expected, loop.waited, loop.patience, cost,
                                                          loop.length.astype(jnp.float32))
        return drafts, widths, wanted & ~jnp.all(done(loop))

    def rounds(loop):
        return round_(loop, *offer(loop)[:2])

    def body(loop):
        # Rounds while they are wanted, then steps until one is: two flat loops rather than a branch per token,
        # which on a CPU costs a copy of the carried caches each time it is taken.
        loop = jax.lax.while_loop(lambda loop: offer(loop)[2], rounds, loop)
        return jax.lax.while_loop(lambda loop: ~offer(loop)[2] & ~jnp.all(done(loop)), plain, loop)

    loop = jax.lax.while_loop(lambda loop: ~jnp.all(done(loop)), body, loop)
    produced = jnp.arange(max_new_tokens)[None, :]
    tokens = jnp.take_along_axis(loop.history, lengths[:, None] + produced, axis=1)
    tokens = jnp.where(produced < loop.counts[:, None], tokens, 0)
    stats = (loop.rounds, loop.steps, loop.drafted, loop.accepted)
    return tokens, loop.counts, stats, loop.target, loop.drafter


# ------------------------------------------------------------------ the entry


def speculate(model: CausalLM, prompts, max_new_tokens: int, *, speculative: PromptLookup | DraftModel,
              lengths=None, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
              stop_tokens=(), rng=None) -> Speculated:
    """`kvattn.generation.generate` in speculative rounds, with how the rounds went.

    The same arguments, checks and result as `generate` (whose
    `speculative=` calls this), plus the counts of rounds, plain steps,
    drafts and kept drafts. The model's caches afterwards hold exactly what
    plain `generate` leaves in them.

    Args:
      model: a `CausalLM` with contiguous caches (no sliding-window ring:
        `truncate` cannot roll one back).
      speculative: a `PromptLookup` or a `DraftModel`.

    `prompts`, `max_new_tokens`, `lengths`, `temperature`, `top_k`, `top_p`,
    `stop_tokens` and `rng` are as in `generate`.

    Returns:
      `Speculated(tokens, counts, rounds, steps, drafted, accepted)`.

    An example is in the models guide, under Speculative decoding.
    """
    _rolls_back(model, "model")
    if not isinstance(speculative, (PromptLookup, DraftModel)):
        raise TypeError(f"speculative must be a PromptLookup or a DraftModel, got {type(speculative).__name__}")
    inputs = checked_inputs(model, prompts, max_new_tokens, lengths, temperature, top_k, top_p, stop_tokens, rng)
    drafter, drafter_params, drafter_state, cost = (), (), (), 0.0
    if isinstance(speculative, DraftModel):
        drafter_params, drafter_state, cost = _checked_draft(speculative.draft, model, inputs.lengths, max_new_tokens)
        drafter = _DraftSteps(nnx.graphdef(speculative.draft), speculative.num_tokens,
                              speculative.draft.config.vocab_size, speculative.policy)
    else:
        drafter = speculative
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
    tokens, counts, stats, cache, drafter_state = _program(
        graphdef, params, cache, drafter, drafter_params, drafter_state, jnp.asarray(inputs.padded),
        jnp.asarray(inputs.lengths, jnp.int32), jax.random.key(0) if rng is None else rng, jnp.float32(cost),
        int(max_new_tokens), inputs.sampling, inputs.stop_tokens,
    )
    nnx.update(model, cache)
    if isinstance(speculative, DraftModel):
        nnx.update(speculative.draft, drafter_state)
    return Speculated(tokens, counts, *stats)


def _rolls_back(model: CausalLM, name: str) -> None:
    """Refuses a model whose caches `truncate` cannot roll back: paged, or a sliding-window ring."""
    config = model.blocks[0].attention.config
    if config.paged:
        raise ValueError(
            f"speculative decoding here needs contiguous caches; the {name} is paged (its sequences belong to a "
            "PageManager): build it without num_pages and page_size"
        )
    if config.window is not None:
        raise ValueError(
            f"speculative decoding rolls caches back with truncate, which the {name}'s sliding-window ring of "
            f"{config.window} slots cannot do (it was built with max_len past its window); build it with "
            f"max_len <= {config.window}, or decode without speculative"
        )


def _checked_draft(draft: CausalLM, model: CausalLM, lengths, max_new_tokens: int):
    """The draft's params and caches and its cost per step in target steps, after checking it can draft for `model`."""
    if draft is model:
        raise ValueError("the draft model must be another CausalLM than the target (their caches differ)")
    _rolls_back(draft, "draft model")
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft model must share the target's vocabulary: vocab_size {model.config.vocab_size} expected, "
            f"got {draft.config.vocab_size}"
        )
    batch, draft_batch = (m.blocks[0].attention.config.batch_size for m in (model, draft))
    if draft_batch != batch:
        raise ValueError(f"the draft model must have the target's batch size {batch}, got batch_size={draft_batch}")
    attention = draft.blocks[0].attention
    held = check.state(attention.config, attention.pos[...])
    target_held = np.asarray(model.pos)
    if not np.array_equal(held, target_held):
        raise ValueError(
            f"the draft model's caches must hold what the target's hold: pos {target_held.tolist()} expected, got "
            f"{held.tolist()} (reset() both, or truncate them alike)"
        )
    check.capacity(attention.config, held, np.asarray(lengths) + max_new_tokens)
    _, params, cache = nnx.split(draft, nnx.Param, nnx.Cache)
    return params, cache, _step_bytes(draft) / _step_bytes(model)


def _step_bytes(model: CausalLM) -> int:
    """Weight bytes one decode step reads: all but the embedding table (one row), unless the output reads it whole."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    unread = 0 if model.config.tie_embeddings else model.embed[...].nbytes
    if model.positions is not None:
        unread += model.positions[...].nbytes
    return total - unread
