"""Placing a layer on a device mesh: sequences over a data axis, heads over a model axis.

A layer built with `data_axis` and/or `model_axis` records, for each of its
variables, which mesh axis splits which dimension (Flax `out_sharding`
metadata). Two placements, alone or combined:

- **data**: the batch of sequences is split, so each device holds the whole
  caches of its own sequences and a full copy of the weights; no cache or
  weight crosses devices, only one scalar per step (the batch's longest
  filled length, which picks the length bucket).
- **model** (tensor parallel): heads are split, so each device holds its
  heads' query/key/value projections, its rows of `out` and its kv heads'
  slices of every cache; a step ends with one all-reduce of the `out`
  projection's partial sums.

`shard` applies the annotations to an existing layer; a layer built under
`with jax.set_mesh(mesh):` is placed as it is built. Compiled steps then run
under the compiler's sharding propagation and hand back every cache array
with the sharding it came in with, so nothing is resharded between steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh

from kvattn.layer.attention import MultiHeadAttention

__all__ = ["DATA", "MODEL", "make_mesh", "shard", "shardings"]

DATA = "data"
MODEL = "model"


def make_mesh(*, data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `data` x `model` mesh over the first `data * model` devices, ready for `shard`.

    Both axes are `AxisType.Auto`: the layer's programs are written for the
    compiler's sharding propagation, not for explicit sharding in types.

    Args:
      data: devices that split the batch of sequences.
      model: devices that split the heads.
      devices: the devices to use; defaults to `jax.devices()`.

    Returns:
      A mesh with axes `("data", "model")`; build the layer with
      `data_axis=kvattn.layer.sharding.DATA, model_axis=kvattn.layer.sharding.MODEL`.
    """
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2, devices=devices)


def shardings(layer: MultiHeadAttention, mesh: Mesh):
    """The `NamedSharding` of every variable of `layer` on `mesh`, from its annotations.

    Args:
      layer: a layer built with `data_axis` and/or `model_axis`.
      mesh: a mesh with `Auto` axes that has every axis the layer names.

    Returns:
      An `nnx.State` shaped like `nnx.state(layer)` whose leaves are shardings.

    Raises:
      ValueError: if the layer has no annotations, the mesh has explicit
        axes or lacks a named axis, or a split dimension is not a multiple
        of its axes' size.
    """
    _check_axis_types(mesh)
    state = nnx.state(layer)
    annotated = [(path, var) for path, var in nnx.to_flat_state(state) if "out_sharding" in var.get_metadata()]
    if not annotated:
        raise ValueError(
            "the layer has no sharding annotations: build it with data_axis=... and/or model_axis=... "
            "naming axes of the mesh, e.g. MultiHeadAttention(..., data_axis='data', model_axis='model')"
        )
    for path, var in annotated:
        _check_fits(".".join(map(str, path)), var.shape, var.get_metadata()["out_sharding"], mesh)
    return nnx.get_named_sharding(state, mesh)


def shard(layer: MultiHeadAttention, mesh: Mesh) -> MultiHeadAttention:
    """Places every variable of `layer` on `mesh` as its annotations say, in place.

    Weights and caches move with their current values. To build a layer
    directly on a mesh instead, construct it under `with jax.set_mesh(mesh):`.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import kvattn
      >>> from kvattn.layer.sharding import make_mesh, shard
      >>> mesh = make_mesh(data=1, model=1)
      >>> layer = kvattn.MultiHeadAttention(  # annotated, on one device until placed
      ...     2, 8, max_len=16, batch_size=2, data_axis="data", model_axis="model", rngs=nnx.Rngs(0))
      >>> shard(layer, mesh).cache.k.values.sharding.spec
      P('data', None, 'model', None)

    Args:
      layer: a layer built with `data_axis` and/or `model_axis`.
      mesh: see `shardings`.

    Returns:
      `layer`, whose arrays now live on the mesh.
    """
    state = nnx.state(layer)
    nnx.update(layer, jax.device_put(state, shardings(layer, mesh)))
    return layer


def _check_axis_types(mesh: Mesh):
    """Raises unless every axis is `Auto`: the layer's ops carry no explicit output shardings."""
    if any(kind != AxisType.Auto for kind in mesh.axis_types):
        kinds = dict(zip(mesh.axis_names, (kind.name for kind in mesh.axis_types), strict=True))
        raise ValueError(
            f"kvattn runs on meshes whose axes are all AxisType.Auto (sharding propagated by the compiler), "
            f"got {kinds}; jax.make_mesh defaults to Explicit: build the mesh with "
            "kvattn.layer.sharding.make_mesh(...) or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * num_axes)"
        )


def _check_fits(name: str, shape: tuple[int, ...], axes: tuple, mesh: Mesh):
    """Raises unless every mesh axis in `axes` exists and evenly splits its dimension of `shape`."""
    for dim, (size, entry) in enumerate(zip(shape, axes, strict=True)):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        missing = [axis for axis in names if axis not in mesh.shape]
        if missing:
            raise ValueError(
                f"{name} is annotated with mesh axis {missing[0]!r}, but the mesh has axes "
                f"{tuple(mesh.axis_names)}; build the layer with data_axis/model_axis naming axes of this mesh"
            )
        split = math.prod(mesh.shape[axis] for axis in names)
        if size % split:
            raise ValueError(
                f"{name} of shape {shape} cannot be split over mesh axis {'x'.join(names)} of size {split} "
                f"along dimension {dim}: expected a multiple of {split}, got {size}. Heads over a model "
                "axis need num_heads and num_kv_heads divisible by its size; sequences over a data axis "
                "need batch_size divisible by its size."
            )
