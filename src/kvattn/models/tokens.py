"""Token ids: checked on the caller's own values at every entry, and guarded inside compiled programs.

Eagerly, `token_ids` refuses before any cast or state change: a non-integer
(or bool) dtype, another rank, and any id outside `[0, vocab_size)` (an int64
`2**32 + 5` is refused, never wrapped onto 5; `-1` is refused, never read as
`vocab_size - 1`). Under the caller's own `jit` nothing can raise, so the
model follows the layer's contract instead (`in_vocab`): a sequence holding
an id out of range writes nothing to any cache and gets NaN logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvattn import validation as check

__all__ = ["in_vocab", "stop_ids", "token_ids"]


def token_ids(value, vocab_size: int, name: str, shape: tuple[int | None, ...]) -> np.ndarray | jax.Array:
    """`value` as int32 of `shape` (None: any size), every id in `[0, vocab_size)`; only dtype and shape when traced.

    Args:
      value: the caller's ids (a list, NumPy or JAX array).
      vocab_size: the model's vocabulary size.
      name: what the message calls it.
      shape: the expected shape; `None` for an axis of any length.

    Raises:
      TypeError: not integers (floats, bools, objects).
      ValueError: another shape, or ids out of range (the first few named, with where they are).
    """
    if check.is_traced(value):
        array = value
    else:
        if isinstance(value, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in _flat(value)):
            raise TypeError(f"{name} must be integer token ids, got a bool among them")
        array = value if isinstance(value, jax.Array) else np.asarray(value)
        if isinstance(value, (list, tuple)) and array.size == 0:
            array = array.astype(np.int32)  # `[]` is float64 to NumPy: no ids, not a type error
    dtype = np.dtype(array.dtype) if array.dtype != object else None
    if dtype is None or dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {array.dtype}")
    sizes = ["T" if size is None else str(size) for size in shape]
    wanted = "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"
    if array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape)):
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(array.shape)}")
    if check.is_traced(array):
        return array.astype(jnp.int32)
    values = check.host(array)
    bad = np.argwhere((values < 0) | (values >= vocab_size))
    if bad.size:
        shown = ", ".join(f"{values[tuple(where)]} at {tuple(int(i) for i in where)}" for where in bad[:4])
        more = f" ({len(bad)} in all)" if len(bad) > 4 else ""
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {shown}{more}")
    return values.astype(np.int32)


def stop_ids(stop_tokens, vocab_size: int) -> tuple[int, ...]:
    """Stop tokens (one id, or any iterable of ids) as a sorted tuple of distinct ids in the vocabulary."""
    if isinstance(stop_tokens, (int, np.integer)) and not isinstance(stop_tokens, (bool, np.bool_)):
        stop_tokens = [stop_tokens]
    try:
        stop_tokens = list(stop_tokens)
    except TypeError:
        raise TypeError(f"stop_tokens must be a token id or an iterable of them, got {stop_tokens!r}") from None
    if not stop_tokens:
        return ()
    return tuple(sorted(set(token_ids(stop_tokens, vocab_size, "stop_tokens", (None,)).tolist())))


def _flat(value):
    for item in value:
        if isinstance(item, (list, tuple)):
            yield from _flat(item)
        else:
            yield item


def in_vocab(tokens: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """`(valid, safe)`: per sequence (leading axis), whether every id is in range; the ids with bad ones set to 0."""
    inside = (tokens >= 0) & (tokens < vocab_size)
    valid = jnp.all(inside.reshape(tokens.shape[0], -1), axis=-1)
    return valid, jnp.where(inside, tokens, 0)
