"""Loading Hugging Face checkpoints (config.json + safetensors) into `CausalLM`, without torch.

Each family's weights map as a table read top to bottom: a checkpoint
tensor's name (`{i}` for a layer's index, without the base model's prefix
`model.` / `transformer.`), the kvattn parameters it fills, its stored
shape in named sizes, and the conversion. torch `Linear` weights `(out,
in)` are transposed to `(in, out)`; GPT-2's `Conv1D` weights are already
`(in, out)`; attention projections are split into heads (`(D, N, H)` for
query/key/value, `(N, H, D)` for out). A tensor that fills one part of a
fused parameter names it with `Part`: Llama's query, key and value
projections are the three parts of `attention/qkv` along its heads axis,
its gate and up projections the two halves of `mlp/gate_up`; GPT-2's
`c_attn` is already fused. The model stores each assembled float weight in
its own form (`CausalLM.load_weight`: its dtype, or int8 with scales).

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
  4. Only then is the model built, and each tensor read, checked finite,
     converted and assigned, one at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

from kvattn.config import CACHE_DTYPES
from kvattn.errors import CheckpointError
from kvattn.models.decoder import WEIGHTS, CausalLM
from kvattn.models.model_config import ModelConfig, from_hf_config

__all__ = ["WEIGHTS_BACKENDS", "Part", "Row", "from_pretrained", "load_safetensors", "locate"]

_FLOATS = {"F16", "BF16", "F32", "F64"}
_MAX_JSON_BYTES = 64 << 20  # config.json and the shard index are a few KB; refuse anything absurd unread


# ------------------------------------------------------------------ the tables


class Part(NamedTuple):
    """A share of a fused parameter: piece `index` of the pieces, sized `sizes`, joined along `axis`."""

    path: str
    """The fused parameter's path (`{i}` as in `Row.source`)."""
    axis: int
    sizes: tuple[str, ...]
    """Every piece's extent along `axis`, in named sizes (see `_sizes`), in order."""
    index: int

    def located(self, config: ModelConfig) -> tuple[str, tuple[slice, ...]]:
        """The parameter's path and the index of this part within it (as the float weight lays it out)."""
        sizes = _sizes(config)
        start = sum(sizes[name] for name in self.sizes[: self.index])
        where = (slice(None),) * self.axis + (slice(start, start + sizes[self.sizes[self.index]]),)
        return self.path, where


class Row(NamedTuple):
    """One checkpoint tensor: where it goes, the shape it must have, how it converts."""

    source: str
    """Its name without the base prefix; `{i}` stands for a layer index."""
    targets: tuple[str | Part, ...]
    """The kvattn parameter paths (or parts of one) it fills (`{i}` as in `source`); () for a buffer, left unread."""
    shape: tuple[str, ...] | None
    """Its stored shape in named sizes (see `_sizes`); None: any (buffers only)."""
    convert: Callable = lambda w, config: (w,)
    """Stored array -> one array per target."""
    when: Callable = lambda config: True
    """Whether the config has this tensor at all."""
    optional: bool = False
    """Whether a checkpoint may leave it out (buffers only)."""


def _sizes(config: ModelConfig) -> dict[str, int]:
    return {
        "V": config.vocab_size, "D": config.hidden_size, "I": config.intermediate_size,
        "P": config.max_position_embeddings, "Q": config.num_heads * config.head_dim,
        "KV": config.num_kv_heads * config.head_dim, "H": config.head_dim, "3Q": 3 * config.num_heads * config.head_dim,
        "N": config.num_heads, "K": config.num_kv_heads,
    }


def _transpose(w, config):
    return (w.T,)


def _heads_in(heads: str):
    """torch `Linear` `(heads * H, D)` -> `(D, heads, H)`; `heads` names the config field."""
    return lambda w, c: (w.T.reshape(c.hidden_size, getattr(c, heads), c.head_dim),)


def _heads_bias(heads: str):
    return lambda b, c: (b.reshape(getattr(c, heads), c.head_dim),)


def _heads_out(w, config):
    """torch `Linear` `(D, N * H)` -> `(N, H, D)`."""
    return (w.T.reshape(config.num_heads, config.head_dim, config.hidden_size),)


def _conv_heads_out(w, config):
    """GPT-2 `Conv1D` `(N * H, D)` -> `(N, H, D)`."""
    return (w.reshape(config.num_heads, config.head_dim, config.hidden_size),)


def _conv_qkv(w, config):
    """GPT-2's fused `c_attn` `(D, 3 * N * H)` -> `(D, 3N, H)`: query, key and value heads side by side."""
    return (w.reshape(config.hidden_size, 3 * config.num_heads, config.head_dim),)


def _qkv_bias(b, config):
    return (b.reshape(3 * config.num_heads, config.head_dim),)


def _untied(config):
    return not config.tie_embeddings


def _biased(config):
    return config.attention_bias


def _qk_norm(config):
    return config.qk_norm


_ATTENTION = "blocks/{i}/attention/"
# The fused projections' parts: query, key and value heads along the heads axis of `qkv` (kernel
# `(D, N + 2K, H)`, bias `(N + 2K, H)`); gate and up along the features of `gate_up` `(D, 2I)`.
_QKV = ("N", "K", "K")


def _qkv(param: str, index: int) -> Part:
    return Part(_ATTENTION + "qkv/" + param, 1 if param == "kernel" else 0, _QKV, index)


def _gate_up(index: int) -> Part:
    return Part("blocks/{i}/mlp/gate_up/kernel", 1, ("I", "I"), index)


LLAMA = ("model.", (
    Row("embed_tokens.weight", ("embed",), ("V", "D")),
    Row("norm.weight", ("final_norm/weight",), ("D",)),
    Row("lm_head.weight", ("lm_head/kernel",), ("V", "D"), _transpose, when=_untied),
    Row("layers.{i}.input_layernorm.weight", ("blocks/{i}/attention_norm/weight",), ("D",)),
    Row("layers.{i}.post_attention_layernorm.weight", ("blocks/{i}/mlp_norm/weight",), ("D",)),
    Row("layers.{i}.self_attn.q_proj.weight", (_qkv("kernel", 0),), ("Q", "D"), _heads_in("num_heads")),
    Row("layers.{i}.self_attn.k_proj.weight", (_qkv("kernel", 1),), ("KV", "D"), _heads_in("num_kv_heads")),
    Row("layers.{i}.self_attn.v_proj.weight", (_qkv("kernel", 2),), ("KV", "D"), _heads_in("num_kv_heads")),
    Row("layers.{i}.self_attn.q_proj.bias", (_qkv("bias", 0),), ("Q",), _heads_bias("num_heads"), _biased),
    Row("layers.{i}.self_attn.k_proj.bias", (_qkv("bias", 1),), ("KV",), _heads_bias("num_kv_heads"), _biased),
    Row("layers.{i}.self_attn.v_proj.bias", (_qkv("bias", 2),), ("KV",), _heads_bias("num_kv_heads"), _biased),
    Row("layers.{i}.self_attn.o_proj.weight", (_ATTENTION + "out/kernel",), ("D", "Q"), _heads_out),
    Row("layers.{i}.self_attn.q_norm.weight", (_ATTENTION + "query_ln/scale",), ("H",), when=_qk_norm),
    Row("layers.{i}.self_attn.k_norm.weight", (_ATTENTION + "key_ln/scale",), ("H",), when=_qk_norm),
    Row("layers.{i}.mlp.gate_proj.weight", (_gate_up(0),), ("I", "D"), _transpose),
    Row("layers.{i}.mlp.up_proj.weight", (_gate_up(1),), ("I", "D"), _transpose),
    Row("layers.{i}.mlp.down_proj.weight", ("blocks/{i}/mlp/down/kernel",), ("D", "I"), _transpose),
))

GPT2 = ("transformer.", (
    Row("wte.weight", ("embed",), ("V", "D")),
    Row("wpe.weight", ("positions",), ("P", "D")),
    Row("ln_f.weight", ("final_norm/weight",), ("D",)),
    Row("ln_f.bias", ("final_norm/bias",), ("D",)),
    Row("lm_head.weight", ("lm_head/kernel",), ("V", "D"), _transpose, when=_untied),
    Row("h.{i}.ln_1.weight", ("blocks/{i}/attention_norm/weight",), ("D",)),
    Row("h.{i}.ln_1.bias", ("blocks/{i}/attention_norm/bias",), ("D",)),
    Row("h.{i}.attn.c_attn.weight", (_ATTENTION + "qkv/kernel",), ("D", "3Q"), _conv_qkv),
    Row("h.{i}.attn.c_attn.bias", (_ATTENTION + "qkv/bias",), ("3Q",), _qkv_bias),
    Row("h.{i}.attn.c_proj.weight", (_ATTENTION + "out/kernel",), ("Q", "D"), _conv_heads_out),
    Row("h.{i}.attn.c_proj.bias", (_ATTENTION + "out/bias",), ("D",)),
    Row("h.{i}.ln_2.weight", ("blocks/{i}/mlp_norm/weight",), ("D",)),
    Row("h.{i}.ln_2.bias", ("blocks/{i}/mlp_norm/bias",), ("D",)),
    Row("h.{i}.mlp.c_fc.weight", ("blocks/{i}/mlp/up/kernel",), ("D", "I")),
    Row("h.{i}.mlp.c_fc.bias", ("blocks/{i}/mlp/up/bias",), ("I",)),
    Row("h.{i}.mlp.c_proj.weight", ("blocks/{i}/mlp/down/kernel",), ("I", "D")),
    Row("h.{i}.mlp.c_proj.bias", ("blocks/{i}/mlp/down/bias",), ("D",)),
    # Non-parameter buffers some GPT-2 checkpoints keep (the causal mask): allowed, never read.
    Row("h.{i}.attn.bias", (), None, optional=True),
    Row("h.{i}.attn.masked_bias", (), None, optional=True),
))

FAMILIES = {"llama": LLAMA, "gpt2": GPT2}


class _Expected(NamedTuple):
    row: Row
    targets: tuple[str | Part, ...]
    shape: tuple[int, ...] | None


def expected_tensors(config: ModelConfig) -> dict[str, _Expected]:
    """The checkpoint names (without the base prefix) a config's model is loaded from, and what each must be."""
    _, rows = FAMILIES[config.family]
    sizes = _sizes(config)
    expected = {}
    for row in rows:
        if not row.when(config):
            continue
        shape = None if row.shape is None else tuple(sizes[size] for size in row.shape)
        for i in range(config.num_layers) if "{i}" in row.source else (None,):
            targets = tuple(t._replace(path=t.path.format(i=i)) if isinstance(t, Part) else t.format(i=i)
                            for t in row.targets)
            expected[row.source.format(i=i)] = _Expected(row, targets, shape)
    return expected


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
    prefix, _ = FAMILIES[config.family]
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
    try:
        with safetensors.safe_open(header.file, framework="numpy") as opened:
            return opened.get_tensor(header.name)
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
                    cache_dtype=None, num_pages: int | None = None, page_size: int | None = None) -> CausalLM:
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
        by int8 (`CausalLM`, `kvattn.quant`); `"bfloat16"`, bfloat16 weights
        and computation, only where the backend has fast bfloat16 dots (not
        on CPU: see `WEIGHTS_BACKENDS`).
      cache_dtype: the caches' storage; defaults to `dtype`.
      num_pages, page_size: paged caches instead of contiguous ones (see
        `CausalLM` and `kvattn.serving`).

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
        raise ValueError(f"dtype={dtype.name} cannot be the caches' storage, which defaults to dtype: use a dtype among "
                         f"{sorted(CACHE_DTYPES)}, or pass cache_dtype= one of them")
    path = Path(path)
    config = checkpoint_config(path)
    pairs = match_headers(config, read_headers(*checkpoint_files(path)))
    model = CausalLM(config, max_len=max_len, batch_size=batch_size, dtype=dtype, weights=weights,
                     cache_dtype=cache_dtype, num_pages=num_pages, page_size=page_size)
    params = {"/".join(map(str, key)) for key, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    filled = {locate(target, config)[0] for _, want in pairs.values() for target in want.targets}
    # An int8 parameter's scales are stored with it.
    unfilled = {name for name in params - filled if not name.endswith("_scale")}
    assert not unfilled, f"the {config.family} table leaves parameters unfilled: {sorted(unfilled)}"
    # One tensor at a time, so the host holds at most one beside the model (and the parts of a fused
    # parameter until its last one arrives); the model is returned only once every tensor has passed,
    # so a refused checkpoint leaves nothing behind.
    pieces: dict[str, list] = {}
    for name, (header, want) in pairs.items():
        if not want.targets:
            continue
        value = _read(header)
        if not np.isfinite(value).all():
            raise CheckpointError(f"{header.file.name}: tensor {name} holds NaN or infinity")
        for target, part in zip(want.targets, want.row.convert(value, config), strict=True):
            if isinstance(target, Part):
                held = pieces.setdefault(target.path, [None] * len(target.sizes))
                held[target.index] = part
                if any(piece is None for piece in held):
                    continue
                target, part = target.path, np.concatenate(pieces.pop(target.path), axis=target.axis)
            model.load_weight(target, part)
    assert not pieces, f"fused parameters left incomplete: {sorted(pieces)}"
    return model


# Backends whose dots in bfloat16 are faster than in float32. On CPU (jaxlib 0.10) a one-row bfloat16
# dot runs on XLA's generic loop emitter, many times slower than float32's (benchmarks/dots.py).
WEIGHTS_BACKENDS = {"bfloat16": ("gpu", "tpu")}


def _storage(dtype, weights) -> tuple[jnp.dtype, str | None]:
    """`from_pretrained`'s `(dtype, weights)` as `CausalLM` takes them, after refusing what would run slower."""
    if weights == "bfloat16":
        backend = jax.default_backend()
        if backend not in WEIGHTS_BACKENDS["bfloat16"]:
            raise ValueError(
                f"weights='bfloat16' needs fast bfloat16 dots, which the {backend} backend lacks: decoding would be "
                "slower than in float32. Use weights='int8' for compact weights here, or dtype=jnp.bfloat16 to run "
                "in bfloat16 all the same"
            )
        if dtype is not None and jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"weights='bfloat16' computes in bfloat16; got dtype={jnp.dtype(dtype).name}")
        return jnp.dtype(jnp.bfloat16), None
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {[*WEIGHTS, 'bfloat16']}, got {weights!r}")
    return jnp.dtype(dtype or jnp.float32), weights


def locate(target: str | Part, config: ModelConfig) -> tuple[str, tuple]:
    """A table target's parameter path and the index of what it fills there (all of it, or a `Part`'s slice)."""
    return target.located(config) if isinstance(target, Part) else (target, (Ellipsis,))
