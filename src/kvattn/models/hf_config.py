"""Reading a Hugging Face `config.json`'s values, checked: the helpers every family's translation shares.

Each refusal is an `UnsupportedConfigError` naming the key, its value and
what kvattn accepts, so a config that does not pass is never half read.
"""

from __future__ import annotations

from kvattn import errors
from kvattn.caches.base import INT32_MAX
from kvattn.errors import UnsupportedConfigError

__all__ = ["divide", "positive_int", "read", "refuse"]


def positive_int(name: str, value) -> int:
    """`value` as an int in `[1, INT32_MAX]`; refused when it is anything else (a bool, a float, out of range)."""
    return errors.positive_int(name, value, error=UnsupportedConfigError, at_most=INT32_MAX)


def read(config: dict, key: str, default=None):
    """`config[key]`, else `default`; refused when both are missing (None)."""
    value = config.get(key, default)
    if value is None and default is None:
        raise UnsupportedConfigError(f"config.json lacks {key!r}, which a {config.get('model_type')} model needs")
    return value


def refuse(config: dict, key: str, allowed) -> None:
    """Refuses `config[key]` unless it is missing or among `allowed`."""
    value = config.get(key)
    if value is not None and value not in allowed:
        raise UnsupportedConfigError(
            f"config.json has {key}={value!r}; kvattn.models supports {key} in {sorted(map(repr, allowed))}"
        )


def divide(config: dict, size_key: str, heads_key: str) -> int:
    """`config[size_key] // config[heads_key]`, refused unless both are positive ints and it divides."""
    size, heads = positive_int(size_key, read(config, size_key)), positive_int(heads_key, read(config, heads_key))
    if size % heads:
        raise UnsupportedConfigError(f"config.json has {size_key}={size}, not a multiple of {heads_key}={heads}")
    return size // heads
