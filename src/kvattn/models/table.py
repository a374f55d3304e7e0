"""The rows of a weight table: how one checkpoint tensor maps onto a `CausalLM`'s parameters.

A family's table (`kvattn.models.families`) is a tuple of `Row`s read top to
bottom: a checkpoint tensor's name (`{i}` for a layer's index, without the
base model's prefix), the kvattn parameters it fills, its stored shape in
named sizes (`sizes`), and the conversion. A tensor that fills one share of
a fused parameter names it with a `Part`. `kvattn.models.hf` reads the
tables; nothing here touches a file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Part", "Row", "sizes", "transpose"]


def sizes(config) -> dict[str, int]:
    """The named sizes a table's shapes use, for a `ModelConfig`."""
    return {
        "V": config.vocab_size, "D": config.hidden_size, "I": config.intermediate_size,
        "P": config.max_position_embeddings, "Q": config.num_heads * config.head_dim,
        "KV": config.num_kv_heads * config.head_dim, "H": config.head_dim, "3Q": 3 * config.num_heads * config.head_dim,
        "N": config.num_heads, "K": config.num_kv_heads,
        "QKV": (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, "2I": 2 * config.intermediate_size,
    }


class Part(NamedTuple):
    """A share of a fused parameter: piece `index` of the pieces, sized `sizes`, joined along `axis`."""

    path: str
    """The fused parameter's path (`{i}` as in `Row.source`)."""
    axis: int
    sizes: tuple[str, ...]
    """Every piece's extent along `axis`, in named sizes (see `sizes`), in order."""
    index: int

    def located(self, config) -> tuple[str, tuple[slice, ...]]:
        """The parameter's path and the index of this part within it (as the float weight lays it out)."""
        named = sizes(config)
        start = sum(named[name] for name in self.sizes[: self.index])
        where = (slice(None),) * self.axis + (slice(start, start + named[self.sizes[self.index]]),)
        return self.path, where


class Row(NamedTuple):
    """One checkpoint tensor: where it goes, the shape it must have, how it converts."""

    source: str
    """Its name without the base prefix; `{i}` stands for a layer index."""
    targets: tuple[str | Part, ...]
    """The kvattn parameter paths (or parts of one) it fills (`{i}` as in `source`); () for a buffer, left unread."""
    shape: tuple[str, ...] | None
    """Its stored shape in named sizes (see `sizes`); None: any (buffers only)."""
    convert: Callable = lambda w, config: (w,)
    """Stored array -> one array per target."""
    when: Callable = lambda config: True
    """Whether the config has this tensor at all."""
    optional: bool = False
    """Whether a checkpoint may leave it out (buffers only)."""


def transpose(w, config):
    """torch `Linear` `(out, in)` -> `(in, out)`."""
    return (w.T,)
