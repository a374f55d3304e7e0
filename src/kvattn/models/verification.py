"""The pure pieces of speculative decoding: drafting by prompt lookup, and verifying drafts against the target.

`lookup` (on device, a batch) and `lookup_tokens` (on the host, one
sequence) draft what followed the latest earlier occurrence of a
sequence's last tokens. `verify` (one `Sampling` for the batch, drafts from
any q) and `verify_rows` (each row its own `RowSampling` and seed, drafts
copied) decide how many drafts each sequence keeps and draw the target's
token after them: greedy keeps a draft when it is the argmax; sampling keeps
it with probability min(1, p/q) and draws from the normalised (p - q)+ at
the first refusal (`kvattn.models.speculative` explains the whole loop).

Axis letters: B (or R) rows, K drafted tokens, K1 = K + 1, V vocabulary, S history slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvattn.models.sampling import MAX_TOP_LOGPROBS, RowSampling, Sampling, filtered, row_keys, scaled_rows

__all__ = ["lookup", "lookup_tokens", "probabilities", "verify", "verify_rows"]


def lookup(history: Int[Array, "B S"], filled: Int[Array, " B"], num_tokens: int, max_ngram: int
           ) -> tuple[Int[Array, "B K"], Int[Array, " B"]]:
    """Prompt lookup's drafts: what followed the latest earlier occurrence of each sequence's last tokens.

    Args:
      history: each sequence's tokens; those after `filled` are ignored.
      filled: per sequence, the index of its last known token.
      num_tokens: K, the most tokens drafted.
      max_ngram: the longest suffix looked up (the longest one that matches wins).

    Returns:
      `(drafts, widths)`: the drafted tokens; `widths` K, or 0 without a match.
    """
    slots = history.shape[1]
    index = jnp.arange(slots)[None, :]
    starts = jnp.zeros_like(filled)
    follow = jnp.zeros_like(filled)  # tokens known after the chosen occurrence (0: none found)
    for size in range(1, max_ngram + 1):  # a longer match overrides a shorter one
        match = jnp.ones(history.shape, jnp.bool_)
        for offset in range(size):
            wanted = jnp.take_along_axis(history, jnp.maximum(filled - size + 1 + offset, 0)[:, None], axis=1)
            shifted = jnp.pad(history[:, offset:], ((0, 0), (0, offset)))  # shifted[b, i] = history[b, i + offset]
            match = match & (shifted == wanted)
        known = filled[:, None] + 1 - (index + size)  # tokens known after the occurrence at i
        match = match & (known >= 1) & (filled[:, None] + 1 >= size)
        latest = jnp.where(match, index, -1)
        best = jnp.argmax(latest, axis=1)
        found = jnp.max(latest, axis=1) >= 0
        starts = jnp.where(found, best + size, starts)
        follow = jnp.where(found, jnp.take_along_axis(known, best[:, None], axis=1)[:, 0], follow)
    # Fewer than K known tokens repeat, as a loop would.
    columns = starts[:, None] + jnp.arange(num_tokens)[None, :] % jnp.maximum(follow, 1)[:, None]
    drafts = jnp.take_along_axis(history, jnp.minimum(columns, slots - 1), axis=1)
    widths = jnp.where(follow > 0, num_tokens, 0)
    return jnp.where(widths[:, None] > 0, drafts, 0), widths


def lookup_tokens(tokens: np.ndarray, num_tokens: int, max_ngram: int) -> np.ndarray:
    """`lookup` for one sequence on the host: the drafts for `tokens` (its prompt and output, the pending token
    last), K of them, or none without a match. The server drafts this way, from the histories it holds."""
    tokens = np.asarray(tokens)
    for size in range(min(max_ngram, tokens.size - 1), 0, -1):  # the longest match wins
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], size)  # each with a token after it
        hits = np.flatnonzero((windows == tokens[-size:]).all(axis=1))
        if hits.size:
            start = hits[-1] + size
            return tokens[start + np.arange(num_tokens) % (tokens.size - start)]
    return tokens[:0]


def probabilities(logits: Float[Array, "*rows V"], sampling: Sampling) -> Float[Array, "*rows V"]:
    """The distribution `kvattn.models.sampling.sample` draws from: temperature, then top-k, then top-p."""
    shape = logits.shape
    return jax.nn.softmax(filtered(logits.reshape(-1, shape[-1]), sampling), axis=-1).reshape(shape)


def _accepts(p: Float[Array, "B K"], q: Float[Array, "B K"], uniform: Float[Array, "B K"]) -> Bool[Array, "B K"]:
    """Speculative sampling's test: keep a draft with probability min(1, p / q) (q > 0: the draft was drawn from q)."""
    return uniform * q < p


def _leading(flags: Bool[Array, "B K"]) -> Int[Array, " B"]:
    """Per row, how many of the first flags are all true."""
    return jnp.where(jnp.all(flags, axis=1), flags.shape[1], jnp.argmin(flags, axis=1)).astype(jnp.int32)


def verify(logits: Float[Array, "B K1 V"], drafts: Int[Array, "B K"], widths: Int[Array, " B"],
           q: Float[Array, "B K V"] | None, key: jax.Array, sampling: Sampling
           ) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """How many drafts each sequence keeps, and the target's token after them.

    Args:
      logits: the target's logits `(B, K + 1, V)` at the pending token and
        at each draft.
      drafts: the drafted tokens, valid up to `widths`.
      widths: drafts per sequence.
      q: the distributions the drafts were drawn from; None for a point mass
        on each draft (prompt lookup, and any greedy drafter).
      key: randomness of the acceptance tests and the last token.
      sampling: the target's sampling settings (greedy at temperature 0).

    Returns:
      `(kept, token)`: drafts kept `(B,)`, each sequence's next token `(B,)`.
    """
    drafting = jnp.arange(drafts.shape[1])[None, :] < widths[:, None]
    if sampling.temperature == 0.0:
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        kept = _leading(drafting & (best[:, :-1] == drafts))
        return kept, jnp.take_along_axis(best, kept[:, None], axis=1)[:, 0]
    p = probabilities(logits, sampling)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.ones_like(p_draft) if q is None else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    test_key, draw_key = jax.random.split(key)
    keep = drafting & _accepts(p_draft, q_draft, jax.random.uniform(test_key, p_draft.shape))
    kept = _leading(keep)
    p_next = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]
    at = jnp.minimum(kept, drafts.shape[1] - 1)[:, None]
    if q is None:
        q_next = jax.nn.one_hot(jnp.take_along_axis(drafts, at, axis=1)[:, 0], p.shape[-1], dtype=p.dtype)
    else:
        q_next = jnp.take_along_axis(q, at[:, :, None], axis=1)[:, 0]
    refused = (kept < widths)[:, None]
    residual = jnp.where(refused, jnp.maximum(p_next - q_next, 0.0), p_next)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)  # rounding only
    return kept, jax.random.categorical(draw_key, jnp.log(residual), axis=-1).astype(jnp.int32)


def verify_rows(logits: Float[Array, "R K1 V"], drafts: Int[Array, "R K"], widths: Int[Array, " R"],
                settings: RowSampling):
    """`verify` for a batch whose rows sample each with their own `RowSampling` and drafts copied (point masses).

    The token at a row's position j (its `index` + j) uses the key `sample_rows` would use for it: the
    acceptance test draws from that key folded with 1, the token after the kept drafts from the key itself,
    so a row without drafts gets exactly `sample_rows`' token.

    Returns:
      `(kept, tokens, logprobs, top_ids, top_logprobs)`: drafts kept `(R,)`; the tokens produced `(R, K + 1)`
      (the kept drafts, then the target's token, then zeros); each one's log-probability after its row's
      temperature; the `MAX_TOP_LOGPROBS` most likely tokens and their log-probabilities at each position.
    """
    rows, width, vocab = logits.shape
    at = jnp.arange(width)
    positions = RowSampling(*(jnp.repeat(field, width) for field in settings[:5]),
                            (settings.index[:, None] + at.astype(jnp.uint32)[None, :]).reshape(-1))
    scaled, candidates = scaled_rows(logits.reshape(rows * width, vocab), positions)
    scaled, candidates = scaled.reshape(logits.shape), candidates.reshape(logits.shape)
    keys = row_keys(positions).reshape(rows, width)
    drafting = at[None, :-1] < widths[:, None]
    sampling = settings.temperature > 0
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    p_draft = jnp.take_along_axis(jax.nn.softmax(candidates[:, :-1], axis=-1), drafts[..., None], axis=-1)[..., 0]
    uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys[:, :-1])
    kept = jnp.where(sampling, _leading(drafting & _accepts(p_draft, jnp.ones_like(p_draft), uniform)),
                     _leading(drafting & (best[:, :-1] == drafts)))
    # After a refused draft d, the residual (p - one_hot(d))+ is p without d.
    last = jnp.take_along_axis(candidates, kept[:, None, None], axis=1)[:, 0]
    refused = jnp.take_along_axis(drafts, jnp.minimum(kept, width - 2)[:, None], axis=1)
    last = jnp.where((kept < widths)[:, None] & (jnp.arange(vocab)[None, :] == refused), -jnp.inf, last)
    drawn = jax.vmap(jax.random.categorical)(jnp.take_along_axis(keys, kept[:, None], axis=1)[:, 0], last)
    token = jnp.where(sampling, drawn, jnp.take_along_axis(best, kept[:, None], axis=1)[:, 0]).astype(jnp.int32)
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(at[None, :] < kept[:, None], padded, jnp.where(at[None, :] == kept[:, None], token[:, None], 0))
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, vocab))
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    return kept, tokens, chosen, top_ids.astype(jnp.int32), top_logprobs
