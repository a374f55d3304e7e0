"""Checkpoint tensors read in place: memory-mapped views of safetensors files, and a fused parameter's parts joined
lazily, each read a slice at a time.

Loading must not hold the model twice. A tensor is a NumPy view of the
file's memory map (`MappedFiles.view`): nothing is read until a slice of it
is, and what a slice read brought in is handed back to the page cache
right after (`MappedFiles.release`), so the process holds a slice of the
checkpoint at a time, not the largest tensor. A family's conversions
(transposes, reshapes, splits; `kvattn.models.table`) stay views of it. The
layers then store each weight a slice of outputs at a time
(`kvattn.models.layers.stored_form`) from a `Joined` kernel, whose slices
are in memory and whose pages are released once read.
"""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import jax.numpy as jnp
import numpy as np

__all__ = ["DTYPES", "SLICE_BYTES", "Joined", "MappedFiles"]

# Read, checked or converted at a time while a checkpoint loads: the float32 bytes of one slice.
SLICE_BYTES = 16 << 20

# safetensors' floating dtypes as NumPy reads them (little-endian; bfloat16 as JAX's, from ml_dtypes).
DTYPES = {"F16": np.dtype("<f2"), "BF16": jnp.dtype(jnp.bfloat16), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}


def data_offsets(file: Path) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file that the safetensors library has already opened (and so checked).

    The format: an 8-byte little-endian header length, the JSON header
    (`data_offsets` relative to the end of the header), then the data.
    """
    with open(file, "rb") as opened:
        length = int.from_bytes(opened.read(8), "little")
        header = json.loads(opened.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


class MappedFiles:
    """Read-only memory maps of safetensors files, opened once each; tensors come out as NumPy views of them."""

    def __init__(self):
        self._maps: dict[Path, tuple[mmap.mmap, dict[str, int]]] = {}

    def _map(self, file: Path) -> tuple[mmap.mmap, dict[str, int]]:
        if file not in self._maps:
            with open(file, "rb") as opened:
                self._maps[file] = mmap.mmap(opened.fileno(), 0, access=mmap.ACCESS_READ), data_offsets(file)
        return self._maps[file]

    def view(self, file: Path, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` of `file` (a float `dtype` of `DTYPES`), a read-only view of the map: nothing read yet."""
        mapped, offsets = self._map(file)
        return np.frombuffer(mapped, DTYPES[dtype], count=math.prod(shape), offset=offsets[name]).reshape(shape)

    def release(self) -> None:
        """Drops every mapped page from this process (the page cache keeps them: reading one again costs no disk)."""
        if hasattr(mmap, "MADV_DONTNEED"):  # elsewhere than Linux and macOS, pages stay until the map closes
            for mapped, _ in self._maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)


class Joined:
    """A float array held as views (of mapped tensors) joined along `axis`: read whole, or a slice of axis 1 at a time.

    A fused parameter's parts arrive as separate tensors (Llama's query, key
    and value heads in one `(D, N + 2K, H)` kernel): joining them with
    `np.concatenate` would copy the whole kernel before its form is built.
    A `Joined` copies only what is read, a slice (of several parts,
    `kernel[:, start:stop]`: the slice of outputs
    `kvattn.models.layers.stored_form` asks for) or all of it
    (`np.asarray`), and calls `release` after each read.
    """

    def __init__(self, parts, axis: int = 0, release=lambda: None):
        self.parts, self.axis, self._release = tuple(parts), axis, release
        shape = list(self.parts[0].shape)
        shape[axis] = sum(part.shape[axis] for part in self.parts)
        self.shape, self.dtype, self.ndim = tuple(shape), self.parts[0].dtype, len(shape)

    @property
    def T(self) -> Joined:  # noqa: N802 (NumPy's name)
        """The transpose of a 2-D array held as one part (an embedding table read as the head's kernel)."""
        if len(self.parts) != 1 or self.ndim != 2:
            raise ValueError(f"only one 2-D part transposes, got {len(self.parts)} parts of {self.ndim} axes")
        return Joined((self.parts[0].T,), 1 - self.axis, self._release)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self.parts, axis=self.axis) if len(self.parts) > 1 else np.array(self.parts[0])
        self._release()
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key) -> np.ndarray:
        """A slice, in memory: any of one part; of several, `[:, start:stop]` (the parts' slices, joined)."""
        if len(self.parts) == 1:
            read = np.array(self.parts[0][key])
        elif not (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
                  and key[1].step in (None, 1)):
            raise TypeError(f"parts joined read [:, start:stop] only, got {key!r}")
        elif self.axis != 1:
            read = np.concatenate([part[key] for part in self.parts], axis=self.axis)
        else:
            start, stop, _ = key[1].indices(self.shape[1])
            pieces, at = [], 0
            for part in self.parts:
                low, high = max(start - at, 0), min(stop - at, part.shape[1])
                if low < high:
                    pieces.append(part[:, low:high])
                at += part.shape[1]
            read = np.concatenate(pieces, axis=1) if pieces else np.array(self.parts[0][:, :0])
        self._release()
        return read
