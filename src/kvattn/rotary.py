"""Rotary position embedding's settings, `RoPE`: a frozen, hashable value a layer's config holds.

It takes a Hugging Face `rope_scaling` dict as it appears in `config.json`
(normalised: its `rope_type`, floats, longrope's factor lists as tuples), so
a checkpoint's settings pass straight in and two equal settings hash alike.
The frequencies and the rotation are `kvattn.math.rope`'s; `kvattn.config`
re-exports `RoPE` beside `AttentionConfig`, which holds one.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np

__all__ = ["RoPE"]

# The scalings and their keys: required, then optional; longrope's factor lists.
_SCALINGS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "attention_factor"),
}
_LISTS = ("short_factor", "long_factor")


@typing.no_type_check  # validated by hand in __post_init__, with the documented errors
@dataclasses.dataclass(frozen=True)
class RoPE:
    """Rotary position embedding settings.

    Args:
      theta: the frequency base (`rope_theta`).
      scaling: a Hugging Face `rope_scaling` dict, or None: `{"rope_type":
        "linear", "factor": f}`, `{"rope_type": "llama3", "factor",
        "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}` or `{"rope_type": "yarn",
        "factor", "original_max_position_embeddings", ...}` (`beta_fast`,
        `beta_slow`, `mscale`, `mscale_all_dim`, `attention_factor`,
        `truncate` as in transformers) or `{"rope_type": "longrope",
        "short_factor", "long_factor", "original_max_position_embeddings",
        ...}` (Phi-3: a factor per rotated pair, the long ones for
        sequences past `original_max_position_embeddings`; `factor`, which
        sets the attention factor as transformers does, or
        `attention_factor` itself). The older key `"type"` is accepted for
        `"rope_type"`.
      rotary_dim: how many leading dims of each head rotate (even); None for
        the whole head (GPT-NeoX and Phi rotate a part).
      interleaved: pair dims (0, 1), (2, 3)... instead of rotate-half.
      long: longrope only: True turns every position with the long factors,
        False with the short ones; None lets a layer choose by the longest
        sequence its cache holds (long when its `capacity` passes
        `original_max_position_embeddings`). One set per model, as vLLM
        chooses by `max_model_len`: transformers picks by each call's length
        and recomputes a sequence's cache when it grows past the switch;
        keys turned with one set throughout keep caches, prefix caching and
        speculation exact. A `CausalLM` sets it from its `max_len`.

    >>> RoPE(scaling={"rope_type": "linear", "factor": 2.0}).scaling_dict
    {'factor': 2.0, 'rope_type': 'linear'}
    """

    theta: float = 10000.0
    scaling: tuple | None = None
    rotary_dim: int | None = None
    interleaved: bool = False
    long: bool | None = None

    def __post_init__(self):
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float, np.number)) or not self.theta > 1:
            raise ValueError(f"RoPE theta must be a number > 1, got {self.theta!r}")
        object.__setattr__(self, "theta", float(self.theta))
        if self.rotary_dim is not None:
            if isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, (int, np.integer)):
                raise TypeError(f"RoPE rotary_dim must be an even positive int or None, got {self.rotary_dim!r}")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ValueError(f"RoPE rotary_dim must be an even positive int or None, got {self.rotary_dim!r}")
            object.__setattr__(self, "rotary_dim", int(self.rotary_dim))
        object.__setattr__(self, "interleaved", bool(self.interleaved))
        object.__setattr__(self, "scaling", _normalise_scaling(self.scaling))
        if self.long is not None:
            if not isinstance(self.long, (bool, np.bool_)):
                raise TypeError(f"RoPE long must be True, False or None, got {self.long!r}")
            if self.long_past is None:
                raise ValueError(f"RoPE long picks longrope's set of factors; this RoPE's scaling is "
                                 f"{self.scaling_dict}")
            object.__setattr__(self, "long", bool(self.long))

    @property
    def scaling_dict(self) -> dict | None:
        """`scaling` as the dict it came from (normalised: `rope_type`, floats)."""
        return None if self.scaling is None else dict(self.scaling)

    @property
    def long_past(self) -> int | None:
        """longrope's switch: sequences longer than this turn with its long factors; None for other scalings."""
        scaling = self.scaling_dict or {}
        return int(scaling["original_max_position_embeddings"]) if scaling.get("rope_type") == "longrope" else None

    def for_length(self, max_len: int | None) -> RoPE:
        """longrope with its set chosen for sequences of up to `max_len` tokens (None: unbounded); others as is."""
        if self.long_past is None or self.long is not None:
            return self
        return dataclasses.replace(self, long=max_len is None or max_len > self.long_past)

    def to_json(self) -> dict:
        return {"theta": self.theta, "scaling": self.scaling_dict, "rotary_dim": self.rotary_dim,
                "interleaved": self.interleaved, **({} if self.long is None else {"long": self.long})}

    def rotated_dims(self, head_dim: int) -> int:
        """How many dims of a `head_dim`-wide head rotate; raises if `rotary_dim` does not fit."""
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"RoPE rotary_dim ({rotary_dim}) must be even and at most head_dim ({head_dim})")
        return rotary_dim


def _normalise_scaling(scaling) -> tuple | None:
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, dict):
        raise TypeError(f"RoPE scaling must be a Hugging Face rope_scaling dict or None, got {scaling!r}")
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if kind not in _SCALINGS:
        raise ValueError(f"RoPE scaling rope_type must be one of {sorted(_SCALINGS)}, got {kind!r}")
    optional = _OPTIONAL.get(kind, ())
    missing = [key for key in _SCALINGS[kind] if scaling.get(key) is None]
    unknown = sorted(set(scaling) - set(_SCALINGS[kind]) - set(optional))
    if missing or unknown:
        raise ValueError(
            f"RoPE scaling of rope_type {kind!r} needs {list(_SCALINGS[kind])}"
            + (f" (optional: {list(optional)})" if optional else "")
            + f"; missing {missing}, unknown {unknown}"
        )
    normalised = {"rope_type": kind}
    for key, value in scaling.items():
        if value is None:
            continue
        if key == "truncate":
            normalised[key] = bool(value)
        elif key in _LISTS:
            normalised[key] = _positive_floats(key, value)
        elif isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise ValueError(f"RoPE scaling {key} must be a finite number, got {value!r}")
        else:
            normalised[key] = float(value)
    if normalised.get("factor", 1.0) <= 0:
        raise ValueError(f"RoPE scaling factor must be positive, got {normalised['factor']}")
    if kind == "longrope" and len(normalised["short_factor"]) != len(normalised["long_factor"]):
        raise ValueError(f"RoPE longrope short_factor and long_factor must be as long, got "
                         f"{len(normalised['short_factor'])} and {len(normalised['long_factor'])}")
    return tuple(sorted(normalised.items()))


def _positive_floats(key: str, value) -> tuple[float, ...]:
    """A list of positive finite numbers (longrope's factors, one per rotated pair) as a hashable tuple."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, np.ndarray)) or not len(value) \
            or any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v <= 0
                   for v in value):
        raise ValueError(f"RoPE scaling {key} must be a non-empty list of positive finite numbers, got {value!r}")
    return tuple(float(v) for v in value)
