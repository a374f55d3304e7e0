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


def require(module: str, extra_name: str = "bench") -> ModuleType:
    """Imports `module`, part of an extra (`bench` by default; `generate` for the tokenizer).

    Raises:
      MissingExtraError: when it is not installed; the message names the
        extra and the command that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        users = "kvattn bench and kvattn demo need" if extra_name == "bench" else f"kvattn {extra_name} needs"
        install = INSTALL if extra_name == "bench" else f"pip install 'kvattn[{extra_name}]'"
        raise MissingExtraError(f"{users} the {extra_name} extra, which provides {package}: {install}") from error
