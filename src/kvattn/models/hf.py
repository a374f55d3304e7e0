"""Loading Hugging Face checkpoints (config.json + safetensors) into `CausalLM`, without torch.

Each family's weights map as a table read top to bottom (its file in
`kvattn.models.families`, its rows `kvattn.models.table.Row`): a checkpoint
tensor's name (`{i}` for a layer's index, without the base model's prefix
`model.` / `transformer.`), the kvattn parameters it fills (or the `Part`
of a fused one), its stored shape in named sizes, and the conversion. The
model stores each assembled float weight in its own form
(`CausalLM.load_weight`: its dtype, or int8 with scales).

Loading checks before it converts or allocates:
  1. `config.json` becomes a checked `ModelConfig` (sizes, heads, rope).
  2. The files: `model.safetensors`, or the shards that
     `model.safetensors.index.json` lists, each a plain file name inside the
     checkpoint directory (a symlink there, as hub caches use, is followed)
     and a regular file.
  3. Every file's safetensors header (read and bounded by the safetensors
     library; no tensor data) is compared with the table: the stored shape
     exactly (no reshape that happens to fit), a floating dtype, each name
     once across all files; every missing, unexpected and duplicated tensor
     is named.
  4. Only then is the model built, its parameters as shapes only
     (`CausalLM.shapes_only`), and each tensor read in place from the
     memory-mapped file (`kvattn.models.tensors`), checked finite,
     converted and stored, one at a time and a slice at a time: loading
     peaks near the loaded model's own bytes (`tools/load_memory.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

from kvattn.caches.base import CACHE_DTYPES
from kvattn.errors import CheckpointError
from kvattn.kernels import native, route
from kvattn.models.decoder import WEIGHTS, CausalLM
from kvattn.models.families import FAMILIES
from kvattn.models.model_config import ModelConfig, from_hf_config
from kvattn.models.table import Part, Row, sizes
from kvattn.models import tensors
from kvattn.models.tensors import Joined, MappedFiles

__all__ = ["WEIGHTS_BACKENDS", "filled_parameters", "from_pretrained", "load_safetensors", "locate", "parameter_paths"]

_FLOATS = {"F16", "BF16", "F32", "F64"}
_MAX_JSON_BYTES = 64 << 20  # config.json and the shard index are a few KB; refuse anything absurd unread


# ------------------------------------------------------------------ the tables


class _Expected(NamedTuple):
    row: Row
    targets: tuple[str | Part, ...]
    shape: tuple[int, ...] | None


def expected_tensors(config: ModelConfig) -> dict[str, _Expected]:
    """The checkpoint names (without the base prefix) a config's model is loaded from, and what each must be."""
    named = sizes(config)
    expected = {}
    for row in FAMILIES[config.family].table:
        if not row.when(config):
            continue
        shape = None if row.shape is None else tuple(named[size] for size in row.shape)
        for i in range(config.num_layers) if "{i}" in row.source else (None,):
            targets = tuple(t._replace(path=t.path.format(i=i)) if isinstance(t, Part) else t.format(i=i)
                            for t in row.targets)
            expected[row.source.format(i=i)] = _Expected(row, targets, shape)
    return expected


def filled_parameters(config: ModelConfig) -> set[str]:
    """The parameter paths a config's table fills: all of its model's (`parameter_paths`) but the int8 scales."""
    return {locate(target, config)[0] for want in expected_tensors(config).values() for target in want.targets}


def parameter_paths(model: CausalLM) -> set[str]:
    """A model's parameter paths as `nnx.state` names them, e.g. `"blocks/0/mlp/down/kernel"`."""
    return {"/".join(map(str, key)) for key, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ------------------------------------------------------------------ the files


class _Header(NamedTuple):
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]


def _read_json(path: Path) -> object:
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file")
    size = path.stat().st_size
    if size > _MAX_JSON_BYTES:
        raise CheckpointError(f"{path} holds {size} bytes; a checkpoint's JSON files hold at most {_MAX_JSON_BYTES}")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory, and the index's tensor -> file map (None unsharded)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        content = _read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index} must hold {{\"weight_map\": {{tensor name: file name}}}}")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if n in ("", ".", "..") or "/" in n or "\\" in n or n != os.path.basename(n)]
        if outside:
            raise CheckpointError(
                f"{index} names files {outside[:4]} outside the checkpoint directory; an index may list only plain "
                "file names inside it"
            )
        return [directory / name for name in names], weight_map
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"], None
    raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")


def read_headers(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, _Header]:
    """Every tensor's file, dtype and shape, from the headers alone; duplicates across files refused."""
    headers: dict[str, _Header] = {}
    duplicated = []
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file} is not a regular file")
        try:
            with safetensors.safe_open(file, framework="numpy") as opened:
                for name in opened.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                    view = opened.get_slice(name)
                    if name in headers:
                        duplicated.append(f"{name} ({headers[name].file.name}, {file.name})")
                    headers[name] = _Header(file, name, view.get_dtype(), tuple(view.get_shape()))
        except safetensors.SafetensorError as error:
            raise CheckpointError(f"{file} is not a valid safetensors file: {error}") from None
    if duplicated:
        raise CheckpointError(f"tensors stored in more than one file: {_some(duplicated)}")
    if weight_map is not None:
        misplaced = [f"{name} (index: {weight_map.get(name)}, found in {header.file.name})"
                     for name, header in headers.items() if weight_map.get(name) != header.file.name]
        unlisted = sorted(set(weight_map) - set(headers))
        if misplaced or unlisted:
            raise CheckpointError(
                f"the index disagrees with the files: {_some(misplaced + [f'{n} (in no file)' for n in unlisted])}"
            )
    return headers


def _some(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" ... ({len(names)} in all)" if len(names) > most else "")


def match_headers(config: ModelConfig, headers: dict[str, _Header]) -> dict[str, tuple[_Header, _Expected]]:
    """Pairs every header with its table row, after checking names, dtypes and shapes; names every mismatch."""
    prefix = FAMILIES[config.family].prefix
    # Each layer needs several tensors: a config claiming more layers than the files hold tensors is
    # refused before its table is even spelled out.
    if config.num_layers > len(headers):
        raise CheckpointError(
            f"config.json has {config.num_layers} layers, but the checkpoint holds only {len(headers)} tensors"
        )
    expected = expected_tensors(config)
    found: dict[str, _Header] = {}
    problems = []
    for name, header in headers.items():
        short = name.removeprefix(prefix)
        if short in found:
            problems.append(f"{name} and {found[short].name} are the same tensor")
        found[short] = header
    unexpected = sorted(found[short].name for short in set(found) - set(expected))
    missing = sorted(short for short, want in expected.items() if short not in found and not want.row.optional)
    if unexpected:
        problems.append(f"unexpected tensors {_some(unexpected)}")
    if missing:
        problems.append(f"missing tensors {_some(missing)}")
    pairs = {}
    for short, header in sorted(found.items()):
        want = expected.get(short)
        if want is None:
            continue
        if want.targets and header.dtype not in _FLOATS:  # a buffer read past (GPT-2's mask) may be anything
            problems.append(f"{header.name} is {header.dtype}; weights must be one of {sorted(_FLOATS)}")
        elif want.shape is not None and header.shape != want.shape:
            problems.append(f"{header.name} has shape {header.shape}, expected {want.shape}")
        pairs[header.name] = (header, want)
    if problems:
        raise CheckpointError(f"the checkpoint does not fit its config.json ({config.family}): " + "; ".join(problems))
    return pairs


# ------------------------------------------------------------------ public


def load_safetensors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, `model.safetensors` or the index's shards, checked as loading is.

    Refuses what `from_pretrained` refuses of the files (index entries
    outside the directory, duplicates, files that disagree with the index),
    but not against a config.
    """
    files, weight_map = checkpoint_files(Path(directory))
    headers = read_headers(files, weight_map)
    tensors = {}
    for header in headers.values():
        tensors[header.name] = _read(header)
    return tensors


def _read(header: _Header) -> np.ndarray:
    """One tensor as a NumPy array in its stored dtype (bfloat16 as `ml_dtypes`' bfloat16, which JAX's is)."""
    # safetensors' NumPy reader has no bfloat16; its JAX reader does, and the array comes back to the host.
    framework = "flax" if header.dtype == "BF16" else "numpy"
    try:
        with safetensors.safe_open(header.file, framework=framework) as opened:
            return np.asarray(opened.get_tensor(header.name))
    except safetensors.SafetensorError as error:
        raise CheckpointError(f"{header.file}: tensor {header.name} cannot be read: {error}") from None


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """A checkpoint directory's `config.json` as a checked `ModelConfig` (its trained context included).

    Raises:
      FileNotFoundError: no `config.json`.
      CheckpointError, UnsupportedConfigError: as `from_pretrained`.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass a Hugging Face checkpoint directory")
    return from_hf_config(_read_json(path / "config.json"))


def eos_token_ids(path: str | os.PathLike) -> frozenset[int]:
    """A checkpoint's end-of-sequence ids from its configs: `generation_config.json`'s, else `config.json`'s.

    Raises:
      CheckpointError: a file that is not JSON, or an `eos_token_id` that is not an id or a list of them.
    """
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        config = _read_json(file) if file.is_file() else {}
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else value
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise CheckpointError(f"{file}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
        return frozenset(ids)
    return frozenset()


def from_pretrained(path: str | os.PathLike, *, max_len: int, batch_size: int = 1, dtype=None, weights=None,
                    cache_dtype=None, num_pages: int | None = None, page_size: int | None = None,
                    spare_slots: int = 0, on_tensor=None) -> CausalLM:
    """A `CausalLM` holding a Hugging Face checkpoint's weights, after checking everything (module docstring).

    Args:
      path: a directory with `config.json` and `model.safetensors` (or a
        sharded `model.safetensors.index.json`).
      max_len: cache capacity per sequence (prompt plus new tokens); at most
        the learned position table's length for GPT-2.
      batch_size: sequences decoded together.
      dtype: computation and weight dtype; defaults to float32.
      weights: None for float weights in `dtype`; `"int8"` for compact
        weights, every projection int8 with per-output scales, its dots int8
        by int8 (`CausalLM`, `kvattn.math.quant`); `"int4"`, 4-bit values with
        a scale per group of 32 inputs (`kvattn.math.int4`); `"bfloat16"`, bfloat16
        weights: on a CPU where kvattn's bfloat16 dot runs (AVX2 and FMA), stored
        in bfloat16 and computed in float32, each weight widened exactly (a
        bfloat16 checkpoint's values at half float32's bytes); on a GPU or
        TPU, bfloat16 weights and computation (`WEIGHTS_BACKENDS`); refused
        elsewhere.
      cache_dtype: the caches' storage; defaults to `dtype`.
      num_pages, page_size: paged caches instead of contiguous ones (see
        `CausalLM` and `kvattn.serving`).
      spare_slots: slots a sliding window's ring keeps past the window, so
        speculative decoding can roll it back (`CausalLM`).
      on_tensor: called as `on_tensor(done, total)` after each of the
        checkpoint's tensors is stored (a progress bar's update).

    Raises:
      UnsupportedConfigError: the configuration asks for something kvattn
        does not run, or is not valid (the message names the field and its value).
      CheckpointError: the files do not fit the config: tensors missing,
        unexpected, duplicated, of another shape or a non-float dtype, or
        holding NaN or infinity; an index naming files outside the directory.
      FileNotFoundError: no `config.json`, or no weights.
      ValueError: `weights` is not one of the above, `"bfloat16"` on a CPU
        backend, or with a `dtype` other than bfloat16; a `dtype` the caches
        cannot store, without a `cache_dtype`.
    """
    dtype, weights = _storage(dtype, weights)
    if cache_dtype is None and dtype.name not in CACHE_DTYPES:  # the caches would default to it
        raise ValueError(f"dtype={dtype.name} cannot be the caches' storage, which defaults to dtype: use a dtype "
                         f"among {sorted(CACHE_DTYPES)}, or pass cache_dtype= one of them")
    path = Path(path)
    config = checkpoint_config(path)
    pairs = match_headers(config, read_headers(*checkpoint_files(path)))
    model = CausalLM.shapes_only(config, max_len=max_len, batch_size=batch_size, dtype=dtype, weights=weights,
                                 cache_dtype=cache_dtype, num_pages=num_pages, page_size=page_size,
                                 spare_slots=spare_slots)
    # An int8 parameter's scales are stored with it.
    unfilled = {name for name in parameter_paths(model) - filled_parameters(config) if not name.endswith("_scale")}
    assert not unfilled, f"the {config.family} table leaves parameters unfilled: {sorted(unfilled)}"
    # One tensor at a time, read in place from the memory-mapped files a slice at a time (`kvattn.models.tensors`):
    # the process holds the parameters stored so far and a slice, never a whole tensor beside its stored form.
    # A fused parameter's parts are joined as they are read, once the last one arrives. The model is returned
    # only once every tensor has passed, so a refused checkpoint leaves nothing behind.
    files = MappedFiles()
    pieces: dict[str, list] = {}
    for done, (name, (header, want)) in enumerate(pairs.items(), start=1):
        if want.targets:
            view = files.view(header.file, header.name, header.dtype, header.shape)
            if not _finite(view, files.release):
                raise CheckpointError(f"{header.file.name}: tensor {name} holds NaN or infinity")
            for target, part in zip(want.targets, want.row.convert(view, config), strict=True):
                if isinstance(target, Part):
                    held = pieces.setdefault(target.path, [None] * len(target.sizes))
                    held[target.index] = part
                    if any(piece is None for piece in held):
                        continue
                    target, part = target.path, Joined(pieces.pop(target.path), target.axis, files.release)
                else:
                    part = Joined((part,), 0, files.release)
                model.load_weight(target, part)
        if on_tensor is not None:
            on_tensor(done, len(pairs))
    assert not pieces, f"fused parameters left incomplete: {sorted(pieces)}"
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(nnx.state(model))), "parameters left unstored"
    return model


def _finite(view: np.ndarray, release) -> bool:
    """Whether a mapped tensor holds no NaN nor infinity, read a slice at a time (each slice's pages released)."""
    flat = view.reshape(-1)  # a view: a mapped tensor is contiguous
    step = max(tensors.SLICE_BYTES // flat.itemsize, 1)
    for start in range(0, flat.size, step):
        finite = bool(np.isfinite(flat[start : start + step]).all())
        release()
        if not finite:
            return False
    return True


# Backends whose dots in bfloat16 are faster than in float32. On CPU (jaxlib 0.10) a one-row bfloat16
# dot runs on XLA's generic loop emitter, many times slower than float32's (benchmarks/dots.py).
WEIGHTS_BACKENDS = {"bfloat16": ("gpu", "tpu")}


def _storage(dtype, weights) -> tuple[jnp.dtype, str | None]:
    """`from_pretrained`'s `(dtype, weights)` as `CausalLM` takes them, after refusing what would run slower."""
    if weights == "bfloat16":
        backend = jax.default_backend()
        if route.bfloat16_weights():
            # kvattn's bfloat16 dot: weights stored in bfloat16, widened exactly, the model computing in float32.
            if dtype is not None and jnp.dtype(dtype) != jnp.float32:
                raise ValueError(f"weights='bfloat16' on the CPU computes in float32 (kvattn's bfloat16 dot widens "
                                 f"each weight exactly); got dtype={jnp.dtype(dtype).name}")
            return jnp.dtype(jnp.float32), "bfloat16"
        if backend not in WEIGHTS_BACKENDS["bfloat16"]:
            raise ValueError(
                f"weights='bfloat16' needs fast bfloat16 dots, which the {backend} backend lacks here "
                f"({native.unavailable_reason(native.BF16_DOT) or 'not a CPU'}): decoding would be slower than in "
                "float32. Use weights='int8' for compact weights here, or dtype=jnp.bfloat16 to run in bfloat16 "
                "all the same"
            )
        if dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"weights='bfloat16' computes in bfloat16; got dtype={jnp.dtype(dtype).name}")
        return jnp.dtype(jnp.bfloat16), None
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    return jnp.dtype(dtype or jnp.float32), weights


def locate(target: str | Part, config: ModelConfig) -> tuple[str, tuple]:
    """A table target's parameter path and the index of what it fills there (all of it, or a `Part`'s slice)."""
    return target.located(config) if isinstance(target, Part) else (target, (Ellipsis,))
