"""The pure pieces of speculative decoding, once for every face: drafting by lookup, verifying, and when to try.

`lookup` drafts what followed the latest earlier occurrence of a sequence's
last tokens. `verify` decides how many drafts each sequence keeps and draws
the target's token after them: greedy keeps a draft when it is the argmax;
sampling keeps it with probability min(1, p/q) and draws from the normalised
(p - q)+ at the first refusal (q a point mass on the draft for a drafter that
copies). `Policy` decides when a round is worth trying. The fixed-batch loop
(`kvattn.generation.speculate`) runs them inside one compiled program; the
serving engine runs `lookup` and `verify` in its device programs and the
policy per request on the host.

Axis letters (`kvattn.math.ops`): B rows, R drafted tokens, R1 = R + 1, V vocabulary, S history slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvattn.generation.sampling import (
    Adjustments, RowSampling, adjusted, draw, filter_rows, filtered, greedy_tokens, row_keys, token_logprobs,
)

__all__ = ["Policy", "lookup", "probabilities", "verify", "verify_rows"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """When speculative rounds pay for themselves, from a running estimate of the drafts they keep.

    A round costs more than a step (the verify chunk, and a draft model's own
    steps), so rounds run only while they keep enough drafts; otherwise plain
    steps run, and a round is tried again after `probe_every` of them (twice
    as long after each try that did not pay, up to `max_patience`). The same
    arithmetic runs on Python numbers (the engine, per request) and traced
    arrays (the fixed-batch loop, per batch).

    Args:
      probe_every: plain steps after which a round is tried again, however low the estimate.
      max_patience: the longest wait between such tries.
      smoothing: weight of the latest round in the estimate (rounds tend to
        keep all their drafts or none, so it averages over a few).
      verify_overhead: what a verify chunk costs beyond one step, in steps:
        the drafts a round must keep to pay for it. On a CPU a product of a
        few rows by a weight matrix reads it about half as fast as a step's
        matrix-vector product, so a chunk of a few tokens costs about two
        steps; on an accelerator about one, and this is cautious.
    """

    probe_every: int = 16
    max_patience: int = 64
    smoothing: float = 0.25
    verify_overhead: float = 1.0

    def pays(self, expected, draft_cost=0.0, length=0):
        """Whether rounds keeping `expected` drafts cost less per token than steps, when a draft model drafting
        `length` tokens costs `draft_cost` target steps per token (0 for lookup)."""
        return expected >= self.verify_overhead + draft_cost * length

    def wants_round(self, expected, waited, patience, draft_cost=0.0, length=0):
        """Whether to try a round now: it pays, or `waited` plain steps reached `patience`."""
        return self.pays(expected, draft_cost, length) | (waited >= patience)

    def estimate(self, expected, kept):
        """The running estimate after a round that kept `kept` drafts."""
        return (1 - self.smoothing) * expected + self.smoothing * kept

    def patience(self, expected, patience, draft_cost=0.0, length=0):
        """Plain steps before the next try after a round: `probe_every` while rounds pay, else twice as many."""
        pays = self.pays(expected, draft_cost, length)
        if isinstance(pays, bool):  # host numbers: no device op (each would be a dispatch, the first a compile)
            return self.probe_every if pays else min(2 * patience, self.max_patience)
        return jnp.where(pays, self.probe_every, jnp.minimum(2 * patience, self.max_patience))


def lookup(history: Int[Array, "B S"], filled: Int[Array, " B"], num_tokens: int, max_ngram: int
           ) -> tuple[Int[Array, "B R"], Int[Array, " B"]]:
    """Prompt lookup's drafts: what followed the latest earlier occurrence of each sequence's last tokens.

    The longest suffix of at most `max_ngram` tokens that occurred before
    wins, then its latest occurrence. Each candidate occurrence's match
    length grows in one loop over suffix lengths, so the cost is
    `min(max_ngram, S)` comparisons of the history, traced once.

    Args:
      history: each sequence's tokens; those after `filled` are ignored.
      filled: per sequence, the index of its last known token (the pending one).
      num_tokens: R, the most tokens drafted.
      max_ngram: the longest suffix looked up.

    Returns:
      `(drafts, widths)`: the drafted tokens (fewer than R known ones repeat,
      as a loop would); `widths` R, or 0 without a match.
    """
    slots = history.shape[1]
    ends = jnp.arange(slots)[None, :]  # where an earlier occurrence ends: a known token must follow it
    filled = filled.astype(jnp.int32)

    def grow(offset, carry):
        matching, length = carry
        mine = jnp.take_along_axis(history, jnp.maximum(filled - offset, 0)[:, None], axis=1)
        theirs = jnp.take_along_axis(history, jnp.clip(ends - offset, 0, slots - 1), axis=1)
        matching = matching & (ends >= offset) & (filled[:, None] >= offset) & (theirs == mine)
        return matching, length + matching.astype(jnp.int32)

    start = (ends < filled[:, None], jnp.zeros(history.shape, jnp.int32))
    _, length = jax.lax.fori_loop(0, min(max_ngram, slots), grow, start)
    score = jnp.where(length > 0, length * slots + ends, -1)  # the longest match, then the latest
    end = jnp.argmax(score, axis=1).astype(jnp.int32)
    found = jnp.max(score, axis=1) >= 0
    follow = jnp.maximum(filled - end, 1)  # tokens known after the occurrence
    columns = end[:, None] + 1 + jnp.arange(num_tokens)[None, :] % follow[:, None]
    drafts = jnp.take_along_axis(history, jnp.minimum(columns, slots - 1), axis=1)
    widths = jnp.where(found, num_tokens, 0).astype(jnp.int32)
    return jnp.where(found[:, None], drafts, 0), widths


def probabilities(logits: Float[Array, "*rows V"], sampling) -> Float[Array, "*rows V"]:
    """The distribution `kvattn.generation.sampling.sample` draws from: temperature, then top-k, then top-p."""
    shape = logits.shape
    return jax.nn.softmax(filtered(logits.reshape(-1, shape[-1]), sampling), axis=-1).reshape(shape)


def _accepts(p: Float[Array, "B R"], q: Float[Array, "B R"], uniform: Float[Array, "B R"]) -> Bool[Array, "B R"]:
    """Speculative sampling's test: keep a draft with probability min(1, p / q) (q > 0: the draft was drawn from q)."""
    return uniform * q < p


def _leading(flags: Bool[Array, "B R"]) -> Int[Array, " B"]:
    """Per row, how many of the first flags are all true."""
    return jnp.where(jnp.all(flags, axis=1), flags.shape[1], jnp.argmin(flags, axis=1)).astype(jnp.int32)


def verify(logits: Float[Array, "B R1 V"], drafts: Int[Array, "B R"], widths: Int[Array, " B"],
           temperature: Float[Array, " B"] | None, top_k: Int[Array, " B"] | None, top_p: Float[Array, " B"] | None,
           keys: jax.Array | None, q: Float[Array, "B R V"] | None = None, min_p: Float[Array, " B"] | None = None
           ) -> tuple[Int[Array, " B"], Int[Array, " B"], Float[Array, "B R1 V"]]:
    """How many drafts each sequence keeps, and the target's token after them.

    Row b samples at `temperature[b]` (0: greedy) among its `top_k[b]` /
    `top_p[b]` / `min_p[b]` candidates (`filter_rows`); `temperature=None` is greedy for
    every row and compiles to argmaxes alone. The token at a row's position
    j draws with `keys[b, j]` and the acceptance test of its draft with
    `fold_in(keys[b, j], 1)`, so a row without drafts gets exactly `draw`'s
    token for that key.

    Args:
      logits: the target's logits at the pending token and at each draft.
      drafts: the drafted tokens, valid up to `widths`.
      widths: drafts per sequence.
      temperature, top_k, top_p: each row's sampling, or all None for greedy.
      min_p: each row's min-p (None: none).
      keys: `(B, K1)` keys, one per position (None when greedy).
      q: the distributions the drafts were drawn from; None for a point mass
        on each draft (prompt lookup, and any greedy drafter).

    Returns:
      `(kept, token, scaled)`: drafts kept `(B,)`, each sequence's next token
      `(B,)`, and the logits over each row's temperature (for log-probabilities).
    """
    rows, width, vocab = logits.shape
    drafting = jnp.arange(width - 1)[None, :] < widths[:, None]
    top = greedy_tokens(logits)
    greedy_kept = _leading(drafting & (top[:, :-1] == drafts))
    greedy_token = jnp.take_along_axis(top, greedy_kept[:, None], axis=1)[:, 0]
    if temperature is None:
        return greedy_kept, greedy_token, logits
    sampling = temperature > 0
    scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None, None]
    kept, token = jax.lax.cond(  # an all-greedy batch skips the draws
        jnp.any(sampling), lambda: _sampled(scaled, drafts, drafting, sampling, greedy_kept, greedy_token, widths,
                                            top_k, top_p, min_p, keys, q),
        lambda: (greedy_kept, greedy_token))
    return kept, token, scaled


def _sampled(scaled, drafts, drafting, sampling, greedy_kept, greedy_token, widths, top_k, top_p, min_p, keys, q):
    """`verify`'s drafts kept and next token where some row samples (its greedy rows keep the greedy answer)."""
    rows, width, vocab = scaled.shape
    candidates = filter_rows(scaled.reshape(rows * width, vocab), jnp.repeat(top_k, width), jnp.repeat(top_p, width),
                             None if min_p is None else jnp.repeat(min_p, width)).reshape(scaled.shape)
    p = jax.nn.softmax(candidates, axis=-1)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.ones_like(p_draft) if q is None else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys[:, :-1])
    kept = jnp.where(sampling, _leading(drafting & _accepts(p_draft, q_draft, uniform)), greedy_kept)
    refused = (kept < widths)[:, None]
    last = jnp.take_along_axis(candidates, kept[:, None, None], axis=1)[:, 0]
    at = jnp.minimum(kept, width - 2)[:, None]
    if q is None:  # the residual (p - one_hot(d))+ after a refused draft d is p without d
        refused_draft = jnp.take_along_axis(drafts, at, axis=1)
        last = jnp.where(refused & (jnp.arange(vocab)[None, :] == refused_draft), -jnp.inf, last)
    else:
        p_next = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(p_next - jnp.take_along_axis(q, at[:, :, None], axis=1)[:, 0], 0.0)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)  # rounding only
        last = jnp.where(refused, jnp.log(residual), last)
    drawn = draw(last, keys[jnp.arange(rows), kept])
    return kept, jnp.where(sampling, drawn, greedy_token).astype(jnp.int32)


def verify_rows(logits: Float[Array, "B R1 V"], drafts: Int[Array, "B R"], widths: Int[Array, " B"],
                settings: RowSampling, adjustments: Adjustments | None = None):
    """`verify` for rows that each sample with their own `RowSampling` (copied drafts), with log-probabilities.

    The token at a row's position j uses the key `sample_rows` would use for
    it (its `index` + j), and the `adjustments` `(B, K1, V)` the host made
    for that position (as if the drafts before it were kept), so a row
    without drafts gets exactly `sample_rows`' token, and a draft a grammar
    forbids is refused.

    Returns:
      `(kept, tokens, logprobs, top_ids, top_logprobs)`: drafts kept `(B,)`; the tokens produced `(B, K1)`
      (the kept drafts, then the target's token, then zeros); each one's log-probability after its row's
      temperature; the `MAX_TOP_LOGPROBS` most likely tokens and their log-probabilities at each position
      (zeros when no row's `settings.top_logprobs` asks).
    """
    rows, width, _ = logits.shape
    at = jnp.arange(width)
    positions = jax.tree.map(lambda field: jnp.repeat(field, width), settings)._replace(
        index=(settings.index[:, None] + at.astype(jnp.uint32)[None, :]).reshape(-1))
    keys = row_keys(positions).reshape(rows, width)
    logits = adjusted(logits, adjustments)
    kept, token, scaled = verify(logits, drafts, widths, settings.temperature, settings.top_k, settings.top_p, keys,
                                 min_p=settings.min_p)
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(at[None, :] < kept[:, None], padded, jnp.where(at[None, :] == kept[:, None], token[:, None], 0))
    return kept, tokens, *token_logprobs(scaled, tokens, jnp.any(settings.top_logprobs > 0))
