"""Input checks shared by the layer and the drivers: one function, and one message, per failure.

Every check runs before any state changes and raises a `ValueError` or
`TypeError` (`CacheOverflowError` for capacity) naming what was expected and
what was got. Integer arguments are range-checked on the caller's own values,
before any cast to int32, so an int64 can never wrap onto a valid index.
Under `jit` the values are traced and only shapes and dtypes can be checked;
the in-graph contracts of `kvattn.layer.forward` and `kvattn.caches.contiguous` take over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from kvattn import errors
from kvattn.config import AttentionConfig
from kvattn.errors import CacheOverflowError, InvalidStateError

__all__ = [
    "capacity",
    "free_tokens",
    "host",
    "is_traced",
    "ints",
    "keep_counts",
    "lead",
    "mask",
    "nonempty",
    "per_sequence_ints",
    "positive_int",
    "require_batched",
    "sequence_index",
    "state",
    "tokens",
    "which",
]


def is_traced(*arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def host(value) -> np.ndarray:
    """A NumPy copy of `value` as every process can see it.

    A global array that spans devices of other processes (JAX
    multi-controller) cannot be fetched directly: it is all-gathered, a
    collective that every process reaches in the same order, as it runs
    the same calls.
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def lead(config: AttentionConfig) -> int:
    """Leading batch axes of the layer's per-call arrays: 1 for a batched layer, else 0."""
    return 0 if config.cache.batch_size is None else 1


def require_batched(config: AttentionConfig, name: str) -> None:
    if config.cache.batch_size is None:
        raise ValueError(f"{name} is only for layers built with batch_size; this layer holds one sequence")


def tokens(config: AttentionConfig, x, name: str, rank: int) -> jax.Array:
    """Floating tokens of rank `rank` per sequence (plus the batch axis of a batched layer), ending in D."""
    x = _floating(config, x, name, (rank + lead(config),))
    rows = config.cache.rows
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} must have batch_size={rows} rows, got shape {x.shape}")
    return x


def free_tokens(config: AttentionConfig, xs, name: str = "xs") -> jax.Array:
    """Floating tokens `(..., T, D)` with any leading batch axes, T >= 1: the uncached forward's input."""
    xs = xs if isinstance(xs, jax.Array) else jnp.asarray(xs)
    if xs.ndim < 2:
        raise ValueError(f"{name} must have rank >= 2 (..., T, D={config.in_features}), got shape {xs.shape}")
    xs = _floating(config, xs, name, (xs.ndim,))
    nonempty(xs, name)
    return xs


def _floating(config: AttentionConfig, x, name: str, ranks: tuple[int, ...]) -> jax.Array:
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.ndim not in ranks:
        expected = " or ".join(f"rank {r}" for r in ranks)
        raise ValueError(f"{name} must have {expected} (..., D={config.in_features}), got shape {x.shape}")
    if x.shape[-1] != config.in_features:
        raise ValueError(f"{name} must end in in_features={config.in_features}, got shape {x.shape}")
    return x


def nonempty(xs: jax.Array, name: str = "xs") -> None:
    if xs.shape[-2] == 0:
        raise ValueError(f"{name} needs at least one token, got shape {xs.shape}")


def mask(config: AttentionConfig, value, name: str, batch: int | None = None) -> jax.Array:
    """A bool `(B,)` mask (`batch` rows, by default the layer's `batch_size`)."""
    require_batched(config, name)
    batch = config.cache.batch_size if batch is None else batch
    value = jnp.asarray(value)
    if value.dtype != jnp.bool_ or value.shape != (batch,):
        raise ValueError(f"{name} must be bool ({batch},), got {value.dtype} {value.shape}")
    return value


def ints(value, name: str, shapes: tuple, lower: int, upper: int, half_open: bool = False) -> jax.Array | np.ndarray:
    """Integers of one of `shapes`, each in `[lower, upper]` unless traced: int32 (NumPy when eager).

    `half_open` only changes how the message writes the range: `[lower, upper + 1)` for indices.
    """
    traced = is_traced(value)
    array = value if traced or isinstance(value, jax.Array) else np.asarray(value)
    expected = " or ".join(str(s) for s in shapes)
    integer = array.dtype != object and np.issubdtype(array.dtype, np.integer)
    if not integer or array.shape not in shapes:
        raise ValueError(f"{name} must be int {expected}, got {array.dtype} {array.shape}")
    if traced:
        return array.astype(jnp.int32)
    values = host(array)
    if np.any((values < lower) | (values > upper)):
        interval = f"[{lower}, {upper + 1})" if half_open else f"[{lower}, {upper}]"
        raise ValueError(f"{name} must lie in {interval}, got {values.tolist()}")
    return values.astype(np.int32)


def positive_int(value, name: str) -> int:
    """A count the caller passes (`max_new_tokens`, `chunk`): `kvattn.errors.positive_int`, refused with a `ValueError`."""
    return errors.positive_int(name, value, error=ValueError)


def per_sequence_ints(config: AttentionConfig, value, name: str, upper: int, batch: int | None = None) -> jax.Array:
    """Int `(B,)` (`batch` rows, by default `batch_size`), each in `[0, upper]` when not traced, as int32."""
    require_batched(config, name)
    return jnp.asarray(ints(value, name, ((config.cache.batch_size if batch is None else batch,),), 0, upper))


def sequence_index(config: AttentionConfig, value, name: str) -> jax.Array:
    """One sequence index in `[0, B)`, as an int32 scalar."""
    require_batched(config, name)
    return jnp.asarray(ints(value, name, ((),), 0, config.cache.batch_size - 1, half_open=True))


def keep_counts(config: AttentionConfig, value, pos: np.ndarray | jax.Array) -> jax.Array:
    """`truncate`'s counts: an int or int `(B,)`, `0 <= keep <= pos` when not traced; int32 `(B,)`."""
    batch = pos.shape
    keep = ints(value, "keep", ((), batch), 0, config.capacity)
    if not is_traced(keep, pos):
        over = np.flatnonzero(np.broadcast_to(keep, batch) > np.asarray(pos))
        if over.size:
            raise ValueError(
                f"truncate keeps 0..pos tokens per sequence; got keep {np.broadcast_to(keep, batch)[over].tolist()} "
                f"for sequences {over.tolist()} holding {np.asarray(pos)[over].tolist()}"
            )
    return jnp.broadcast_to(jnp.asarray(keep), batch)


def which(config: AttentionConfig, value) -> jax.Array:
    """Bool mask `(B,)` of the sequences to act on, from indices or a mask; all of them for None."""
    batch = config.cache.batch_size or 1
    if value is None:
        return jnp.ones((batch,), jnp.bool_)
    require_batched(config, "which")
    if getattr(value, "dtype", None) == np.bool_ or (
        isinstance(value, (list, tuple)) and value and all(isinstance(v, (bool, np.bool_)) for v in value)
    ):
        return mask(config, value, "which")
    if isinstance(value, (list, tuple)) and not value:
        value = np.zeros((0,), np.int32)  # `[]` is float64 to NumPy: no sequence, not a type error
    size = int(np.size(value)) if not is_traced(value) else value.size
    indices = ints(value, "which indices", ((), (size,)), 0, batch - 1, half_open=True)
    # Under jit an index out of range names no sequence: dropped, never wrapped.
    indices = jnp.where((indices < 0) | (indices >= batch), batch, jnp.asarray(indices))
    return jnp.zeros((batch,), jnp.bool_).at[indices].set(True, mode="drop")


def state(config: AttentionConfig, pos) -> np.ndarray | None:
    """The layer's `pos` as int `(B,)` on the host, after checking it is a state kvattn can extend.

    Returns None under `jit`. Raises `InvalidStateError` for a `pos` outside
    `[0, capacity]`, which only an out-of-range index under `jit` (the
    documented way to poison a sequence) or a hand-written state leaves.
    """
    if is_traced(pos):
        return None
    values = host(pos).reshape(-1)
    bad = np.flatnonzero((values < 0) | (values > config.capacity))
    if bad.size:
        raise InvalidStateError(
            f"sequences {bad.tolist()} hold an invalid state: pos {values[bad].tolist()} is outside "
            f"[0, {config.capacity}] (an out-of-range fork/reorder index under jit leaves pos=-1). "
            "Call reset() on them; nothing was changed."
        )
    return values


def capacity(config: AttentionConfig, pos: np.ndarray | None, lengths) -> None:
    """Raises `CacheOverflowError` if a sequence has no room for its `lengths` new tokens (host `pos`)."""
    if pos is None or is_traced(lengths):
        return  # under jit the in-graph guard applies
    lengths = np.broadcast_to(host(lengths).astype(np.int64), pos.shape)
    over = np.flatnonzero(pos.astype(np.int64) + lengths > config.capacity)
    if over.size:
        where = "" if config.cache.batch_size is None else f" for sequences {over.tolist()}"
        max_len = config.cache.max_len
        limit = f"max_len={max_len}" if max_len is not None else f"the int32 position limit {config.capacity}"
        raise CacheOverflowError(
            f"cache overflow{where}: pos {pos[over].tolist()} + {lengths[over].tolist()} new tokens "
            f"exceeds {limit}; nothing was written. Call reset() or build the layer with a larger max_len."
        )
