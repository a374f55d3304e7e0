"""Reading a Hugging Face `config.json`'s values, checked: the helpers every family's translation shares.

Each refusal is an `UnsupportedConfigError` naming the key, its value and
what kvattn accepts, so a config that does not pass is never half read.
"""

from __future__ import annotations

from kvattn import errors
from kvattn.caches.base import INT32_MAX
from kvattn.rotary import RoPE
from kvattn.errors import UnsupportedConfigError

__all__ = ["divide", "positive_int", "read", "refuse", "rope"]


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


def rope(config: dict, head_dim: int, parameters: dict | None = None, *, theta_key: str = "rope_theta",
         scaling_key: str | None = "rope_scaling") -> RoPE:
    """The rotary settings of a config, refused by name when kvattn cannot compute them.

    transformers 5 writes `rope_parameters` (the theta inside); earlier
    versions `rope_theta` and `rope_scaling` at the top level, which are
    read where `parameters` leaves them out (`theta_key`, `scaling_key`:
    Gemma 3's sliding layers read `rope_local_base_freq` and no scaling).
    `parameters` defaults to the config's `rope_parameters`.
    """
    parameters = (config.get("rope_parameters") or {}) if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise UnsupportedConfigError(f"config.json has rope_parameters={parameters!r}; expected an object")
    parameters = dict(parameters)
    theta = parameters.pop("rope_theta", None)
    theta = config.get(theta_key, 10000.0) if theta is None else theta
    rotary = parameters.pop("partial_rotary_factor", None)
    rotary = config.get("partial_rotary_factor") if rotary is None else rotary
    if parameters.get("rope_type", "default") != "default":
        scaling = parameters
    else:
        scaling = config.get(scaling_key) if scaling_key else None
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su"):
        scaling = _longrope(config, scaling)
    rotary_dim = None
    if rotary is not None and rotary != 1.0:
        if isinstance(rotary, bool) or not isinstance(rotary, (int, float)) or not 0 < rotary <= 1:
            raise UnsupportedConfigError(
                f"config.json has partial_rotary_factor={rotary!r}; expected a number in (0, 1]"
            )
        rotary_dim = int(positive_int("head_dim", head_dim) * rotary)
    try:
        return RoPE(theta=theta, scaling=scaling, rotary_dim=rotary_dim)
    except (TypeError, ValueError) as error:
        raise UnsupportedConfigError(f"config.json has rope settings kvattn cannot use: {error}") from None


def _longrope(config: dict, scaling: dict) -> dict:
    """Phi-3's longrope settings as transformers completes them: the switch from the config's top level where the
    scaling leaves it out, and `factor` (which sets the attention factor) from the two lengths; "su" is its old
    name."""
    scaling = {key: value for key, value in scaling.items() if key not in ("type", "rope_type")}
    original = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
    if scaling.get("factor") is None and isinstance(original, int) and original > 0 \
            and isinstance(config.get("max_position_embeddings"), int):
        scaling["factor"] = config["max_position_embeddings"] / original
    return scaling
