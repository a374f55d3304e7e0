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

__all__ = ["BENCH_MODULES", "loading_progress", "progress_bar", "require"]

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


def progress_bar(total: int, desc: str, unit: str, *, terminal_only: bool = False):
    """A tqdm bar over `total` things on stderr, cleared when closed; None without tqdm (a progress bar is a
    convenience, not a need: no extra is required for it). `terminal_only`: drawn only when stderr is a terminal,
    not into a log or a captured stream."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None if terminal_only else False)


def loading_progress():
    """An `on_tensor(done, total)` callback for `kvattn.models.from_pretrained` that shows a bar over the
    checkpoint's tensors on a terminal (`progress_bar`), closed after the last."""
    bar = None

    def on_tensor(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar(total, "loading", "tensor", terminal_only=True)
            if bar is None:
                return
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return on_tensor
