"""Every error kvattn raises on purpose, in one place and one hierarchy.

```
KvattnError                         catch this for any refusal of kvattn's own
├── CacheOverflowError  (ValueError)     a step or prefill would pass max_len
├── InvalidStateError   (ValueError)     a sequence's pos is outside [0, capacity]
├── OutOfPagesError     (RuntimeError)   a request needs more pages or slots than can be had
├── SnapshotError       (ValueError)     a snapshot file cannot be loaded into these layers
├── UnsupportedConfigError (ValueError)  a model config kvattn does not run, or not valid
├── CheckpointError     (ValueError)     a checkpoint's files do not fit its config
└── MissingExtraError   (ImportError)    a module of an optional extra is not installed
```

Each also derives from the built-in error it has always been, so code that
catches `ValueError` (or `RuntimeError`, `ImportError`) keeps working.
Every one is raised before any state changes: the layer, the model, the
page manager or the file on disk is left exactly as it was. Bad arguments of
the wrong type or shape raise plain `TypeError` / `ValueError` naming what
was expected and what was got.
"""

from __future__ import annotations

__all__ = [
    "CacheOverflowError",
    "CheckpointError",
    "InvalidStateError",
    "KvattnError",
    "MissingExtraError",
    "OutOfPagesError",
    "SnapshotError",
    "UnsupportedConfigError",
    "header_value",
    "positive_int",
]


class KvattnError(Exception):
    """The base of every error kvattn raises on purpose."""


class CacheOverflowError(KvattnError, ValueError):
    """A step or prefill would write past `max_len`; nothing was changed."""


class InvalidStateError(KvattnError, ValueError):
    """The layer's `pos` is out of range (e.g. left by an out-of-range index under `jit`); nothing was changed."""


class OutOfPagesError(KvattnError, RuntimeError):
    """A request needs more pages, slots or positions than can be had; nothing was changed."""


class SnapshotError(KvattnError, ValueError):
    """A snapshot file cannot be loaded into these layers; they were not changed."""


class UnsupportedConfigError(KvattnError, ValueError):
    """A checkpoint's configuration asks for something kvattn.models does not implement, or is not valid."""


class CheckpointError(KvattnError, ValueError):
    """A checkpoint's files are not what its config describes; nothing was built."""


class MissingExtraError(KvattnError, ImportError):
    """A module of an optional extra (`bench`, `generate`) is not installed."""


def positive_int(name: str, value, *, error: type[Exception] | None = None, at_most: int | None = None) -> int:
    """`value` as a Python int, if it is an integer >= 1 (NumPy and 0-d integer arrays included, never a bool).

    With `at_most`, also at most that. Raises `error` if given, else
    `TypeError` for a value that is not an integer and `ValueError` for one
    out of range: the check every refusal of a size shares, so it lives
    with the errors.
    """
    import numpy as np  # here, not at the top: `import kvattn.errors` (the CLI's --help) loads no NumPy

    bound = "" if at_most is None else f" of at most {at_most}"
    if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
        raise (error or TypeError)(f"{name} must be a positive int{bound}, got {value!r}")
    if int(value) < 1 or (at_most is not None and int(value) > at_most):
        raise (error or ValueError)(f"{name} must be a positive int{bound}, got {value!r}")
    return int(value)


def header_value(name: str, value: str) -> str:
    """`value` if an HTTP header can carry it as it is (printable ASCII, no surrounding spaces), else `ValueError`.

    A secret such as an API key that no header can carry could never match.
    """
    if not (value and value.isascii() and value.isprintable() and value.strip() == value):
        raise ValueError(f"expected {name} to be printable ASCII without surrounding spaces (an HTTP header "
                         f"carries it), got {value.encode('ascii', 'backslashreplace').decode()!r}")
    return value


def _is_integer(value) -> bool:
    import numpy as np

    if isinstance(value, (int, np.integer)):
        return True
    return getattr(value, "shape", None) == () and np.issubdtype(getattr(value, "dtype", np.float32), np.integer)
