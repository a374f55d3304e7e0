"""The bench extra: tables, progress bars and plots, imported only where `kvattn bench` and `kvattn demo` use them.

`import kvattn` needs only the core dependencies, so every module of the
extra is imported inside the function that uses it, through `require`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL", "MODULES", "MissingExtraError", "require"]

INSTALL = "pip install 'kvattn[bench]'"
MODULES = ("rich", "matplotlib", "tqdm")


class MissingExtraError(ImportError):
    """A module of the bench extra is not installed."""


def require(module: str) -> ModuleType:
    """Imports `module`, part of the bench extra.

    Raises:
      MissingExtraError: when it is not installed; the message names the
        extra and the command that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise MissingExtraError(
            f"kvattn bench and kvattn demo need the bench extra, which provides {package}: {INSTALL}"
        ) from error
