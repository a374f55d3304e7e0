"""Speculative decoding: several tokens per call of the target model, exactly the tokens (or the distribution) of `generate`.

A round drafts up to R tokens per sequence, then the target scores the
pending token and the drafts in one `prefill` chunk of R + 1 tokens. Each
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

The whole generation is one compiled program, compiled once per batch, R
and prompt bucket (and, as `generate`'s, per `max_new_tokens`, sampling and
stop tokens): a `lax.while_loop` whose body runs rounds while they are
wanted, then plain steps until a round is, each in a loop of its own (a
branch per token would copy the carried caches each time on a CPU). A round
never drafts past `max_new_tokens`, so the caches need no more room than
plain `generate` needs.

The pure pieces, drafting by lookup, verifying and the policy deciding
when rounds pay, are in `kvattn.generation.speculation`, which the serving
engine runs too; the drafters and their side of the loop in
`kvattn.generation.drafters`.

Axis letters (`kvattn.math.ops`): B batch, R drafted tokens per round (`num_tokens`), V
vocabulary, S history slots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvattn.generation.drafters import (
    DraftModel, DraftSteps, Loop, PromptLookup, checked_draft, rolls_back, split_keys,
)
from kvattn.generation.inputs import checked_inputs
from kvattn.generation.sampling import sample
from kvattn.generation.speculation import verify
from kvattn.models.decoder import CausalLM

__all__ = ["Speculated", "speculate"]






class Speculated(NamedTuple):
    """What `speculate` returns: `generate`'s tokens and counts, and how the rounds went."""

    tokens: jax.Array
    """`(B, max_new_tokens)` int32; after a stop token, zeros."""
    counts: jax.Array
    """`(B,)` int32: tokens each sequence produced, its stop token included."""
    rounds: jax.Array
    """int32: verify calls, each one `prefill` of R + 1 tokens by the target."""
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




def _put(history, columns, tokens, rows):
    """`history` with `tokens` `(B, T)` written at `columns` `(B, T)` of the chosen `rows`; others dropped."""
    columns = jnp.where(rows[:, None], columns, history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], columns].set(tokens, mode="drop")



@functools.partial(
    jax.jit, static_argnames=("graphdef", "drafter", "max_new_tokens", "sampling", "stop_tokens")
)
def _program(graphdef, params, cache, drafter, drafter_params, drafter_state, prompts, lengths, key, cost,
             max_new_tokens, sampling, stop_tokens):
    """The whole speculative generation: prefill, then rounds or plain steps until every sequence is done."""
    model = nnx.merge(graphdef, params, cache)
    origin = model.pos
    logits = model.prefill(prompts, lengths, last_only=True)
    key, first = split_keys(key, 2, sampling)
    drafter_state = drafter._start(drafter_params, drafter_state, prompts, lengths)
    batch, width = prompts.shape
    num_tokens = drafter.num_tokens
    policy = drafter.policy
    everyone = jnp.ones((batch,), jnp.bool_)
    history = jnp.zeros((batch, width + max_new_tokens + num_tokens + 1), jnp.int32).at[:, :width].set(prompts)
    history = _put(history, lengths[:, None], sample(logits, first, sampling)[:, None], everyone)
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    zero = jnp.zeros((batch,), jnp.int32)
    loop = Loop(
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
        key, sub = split_keys(loop.key, 2, sampling)
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
        key, draft_key, verify_key = split_keys(loop.key, 3, sampling)
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
            min_p = None if sampling.min_p is None else jnp.full((batch,), sampling.min_p)
            kept, token, _ = verify(logits, drafts, widths, *settings, keys, q, min_p=min_p)
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
      model: a `CausalLM` with contiguous caches; a sliding-window ring
        needs `spare_slots` of at least `num_tokens - 1` (`CausalLM`).
      speculative: a `PromptLookup` or a `DraftModel`.

    `prompts`, `max_new_tokens`, `lengths`, `temperature`, `top_k`, `top_p`,
    `stop_tokens` and `rng` are as in `generate`.

    Returns:
      `Speculated(tokens, counts, rounds, steps, drafted, accepted)`.

    An example is in the models guide, under Speculative decoding.
    """
    if not isinstance(speculative, (PromptLookup, DraftModel)):
        raise TypeError(f"speculative must be a PromptLookup or a DraftModel, got {type(speculative).__name__}")
    rolls_back(model, "model", speculative.num_tokens)
    inputs = checked_inputs(model, prompts, max_new_tokens, lengths, temperature, top_k, top_p, stop_tokens, rng)
    drafter, drafter_params, drafter_state, cost = (), (), (), 0.0
    if isinstance(speculative, DraftModel):
        drafter_params, drafter_state, cost = checked_draft(speculative.draft, model, inputs.lengths, max_new_tokens,
                                                            speculative.num_tokens)
        drafter = DraftSteps(nnx.graphdef(speculative.draft), speculative.num_tokens,
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


