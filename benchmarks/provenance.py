"""Where the figures come from: the machine, its load, the package versions and the measured source revision."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

import kvattn

__all__ = ["load_average", "machine_info", "source_revision", "versions"]


def machine_info() -> dict[str, Any]:
    """The CPU model, core count, OS and the JAX device the figures come from."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "jax_backend": jax.default_backend(),
        "jax_device": str(jax.devices()[0]),
    }


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: a busy machine shows in every figure."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def source_revision() -> dict[str, Any]:
    """The git commit of the measured kvattn source and whether it had uncommitted changes.

    Both None outside a git checkout (an installed wheel) or without git.
    """
    package = Path(kvattn.__file__).parent  # the measured library, wherever it is imported from

    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, check=False)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--", ".")
    return {"commit": commit, "dirty": None if commit is None else bool(changes)}


def versions() -> dict[str, str]:
    """Versions of Python and the packages measured."""
    packages = ("kvattn", "jax", "jaxlib", "flax", "numpy")
    return {"python": platform.python_version(), **{name: metadata.version(name) for name in packages}}
