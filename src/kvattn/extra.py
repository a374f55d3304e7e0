"""Optional extras, imported only where they are used, so `import kvattn` needs only the core dependencies.

`bench` (rich, matplotlib, tqdm) serves `kvattn demo` and the repository's
benchmarks; `generate` (tokenizers, jinja2, tqdm, llguidance) serves `kvattn
generate --prompt` and `kvattn.LLM`; `serve` (FastAPI, uvicorn, tokenizers,
jinja2, llguidance, prometheus_client) serves `kvattn serve`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvattn.errors import MissingExtraError

__all__ = ["BENCH_MODULES", "require"]

BENCH_MODULES = ("rich", "matplotlib", "tqdm")
_USERS = {"bench": "kvattn demo and the benchmarks need", "generate": "kvattn generate --prompt needs",
          "serve": "kvattn serve needs"}


def require(module: str, extra_name: str = "bench") -> ModuleType:
    """Imports `module`, part of the extra `extra_name`.

    Raises:
      MissingExtraError: when it is not installed; the message names the
        extra and the command that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise MissingExtraError(
            f"{_USERS[extra_name]} the {extra_name} extra, which provides {package}: pip install 'kvattn[{extra_name}]'"
        ) from error
