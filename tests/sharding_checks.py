"""Sharded-versus-unsharded checks on a simulated CPU mesh of 8 devices.

Run by `tests/test_sharding.py` in a subprocess, because the device count is
fixed when JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_checks.py [LAYOUT ...]

For each mesh placement and cache layout it builds one layer on the mesh and
the same layer (same seed, same weights) on one device, drives both through
eager prefill and step, `nnx.jit`, `decode` and `Decoder`, and checks that

- outputs and caches agree to float32 tolerance;
- after every call the cache arrays keep their annotated shardings;
- the compiled, donated `Decoder` step moves no cache-sized array between
  devices, still aliases its cache buffers, and communicates only twice at
  most: over data, one scalar all-reduce (the longest filled length of the
  batch, which picks the length bucket); over heads, one all-reduce of the
  `out` projection's partial sums.

Prints `PASS <case>` or `FAIL <case>: <reason>` per case, with the step's
collectives; exits 1 if any case failed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import install_import_hook

jax.config.update("jax_numpy_rank_promotion", "raise")

with install_import_hook("kvattn", "beartype.beartype"):
    import kvattn
    import kvattn.layer.forward
    from kvattn.layer.sharding import make_mesh, shard, shardings

DEVICES = 8
TOLERANCE = 1e-5
IN_FEATURES = 32
MAX_LEN = 16
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
LAYOUTS = ("heads_major", "slots_major")


@dataclasses.dataclass(frozen=True)
class Case:
    """One placement: mesh shape, cache layout and a batch and head count it divides."""

    data: int
    model: int
    layout: str
    batch_size: int
    num_heads: int
    num_kv_heads: int
    cache_dtype: str = "float32"
    modern: bool = False  # rotary positions (llama3 scaling) and per-head RMS QK-norm

    def __str__(self):
        return (
            f"data={self.data},model={self.model} {self.layout} {self.cache_dtype} "
            f"B={self.batch_size} N={self.num_heads} K={self.num_kv_heads}" + (" rope+qknorm" if self.modern else "")
        )

    def build(self, annotated: bool, eager: bool = False) -> kvattn.MultiHeadAttention:
        """The layer, annotated or not; placed as it is built only with `eager` under a mesh."""
        axes = {"data_axis": "data", "model_axis": "model"} if annotated else {}
        if self.modern:
            scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8}
            axes |= {"rope": kvattn.RoPE(scaling=scaling), "normalize_qk": "rms"}
        with nnx.use_eager_sharding(eager):  # off: annotations only, whatever mesh is current
            return kvattn.MultiHeadAttention(
                self.num_heads, IN_FEATURES, max_len=MAX_LEN, batch_size=self.batch_size,
                num_kv_heads=self.num_kv_heads, cache_layout=self.layout, cache_dtype=self.cache_dtype,
                rngs=nnx.Rngs(0), **axes,
            )


def cases(layouts, every: bool = False) -> list[Case]:
    """Batch over 8 devices; heads over 4 (MHA); both on 2 x 4 (GQA), per layout.

    The two single-axis cases run for slots-major only with `every` (the
    combined case splits both axes; CI's time is short); heads-major, the
    models' layout, always runs all three.
    """
    out = []
    for layout in layouts:
        if every or layout == "heads_major":
            out += [
                Case(data=8, model=1, layout=layout, batch_size=8, num_heads=4, num_kv_heads=2),
                Case(data=1, model=4, layout=layout, batch_size=2, num_heads=4, num_kv_heads=4),
            ]
        # Rotation and norms are per head: the split placement must need no more communication.
        out.append(Case(data=2, model=4, layout=layout, batch_size=4, num_heads=8, num_kv_heads=4,
                        modern=layout == "slots_major"))
    return out


EVERY = os.environ.get("HYPOTHESIS_PROFILE") == "wide"
"""Run every case: the profile that also runs the longer random searches (conftest.py)."""


# ------------------------------------------------------------------ checks


def assert_close(got, expected, what: str):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=TOLERANCE, atol=TOLERANCE,
        err_msg=f"{what}: sharded layer differs from the same layer on one device",
    )


def check_placement(arrays, expected, what: str):
    """Every array's sharding equals the expected `NamedSharding` (cache never resharded)."""
    for name, array, sharding in zip(_names(expected), arrays, jax.tree.leaves(expected), strict=True):
        if not array.sharding.is_equivalent_to(sharding, array.ndim):
            raise AssertionError(f"{what}: {name} is placed as {array.sharding}, expected {sharding}")


def check_working_placement(decoder, mesh, what: str):
    """The decoder's heads-major working cache `(B, K, S, H)` stays split over data and model."""
    specs = {4: P("data", "model", None, None), 3: P("data", "model", None), 1: P("data")}
    for array in jax.tree.leaves(decoder._cache):
        expected = NamedSharding(mesh, specs[array.ndim])
        if not array.sharding.is_equivalent_to(expected, array.ndim):
            raise AssertionError(f"{what}: a {array.shape} array is placed as {array.sharding}, expected {expected}")


def _names(state) -> list[str]:
    return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple[tuple[int, ...], ...]
    line: str

    @property
    def size(self) -> int:
        return max((int(np.prod(shape)) for shape in self.shapes), default=0)

    def __str__(self):
        return f"{self.op} {' '.join('[' + ','.join(map(str, s)) + ']' for s in self.shapes)}"


def collectives(hlo: str) -> list[Collective]:
    """The cross-device operations of a compiled (per-device) HLO module, with their result shapes."""
    pattern = re.compile(rf"= (\(.*?\)|\S+) ({'|'.join(COLLECTIVES)})(?:-start)?\(")
    found = []
    for line in hlo.splitlines():
        match = pattern.search(line)
        if match:
            shapes = tuple(
                tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", match[1])
            )
            found.append(Collective(match[2], shapes, line.strip()))
    return found


def check_compiled_step(case: Case, layer, decoder, x) -> str:
    """Checks the HLO of the donated `Decoder` step; returns a one-line summary of its collectives.

    No placement moves the cache: with heads split over devices the layer
    turns off the slots-major block-diagonal reading, whose `(K, H)` merge
    would make XLA all-gather the key cache over the model axis.
    """
    hlo = decoder._programs["step"].lower(decoder._weights, decoder._cache, x, None).compile().as_text()
    cache = decoder._cache.k.values
    local = cache.sharding.shard_shape(cache.shape)
    found = collectives(hlo)
    # Anything as large as one device's cache shard is the cache itself moving.
    moved = [c for c in found if c.size >= int(np.prod(local))]
    summary = f"local cache {list(local)}, {'moves the cache' if moved else 'cache stays put'}; collectives: "
    summary += "; ".join(map(str, found)) or "none"
    if moved:
        raise AssertionError(f"cache shard {list(local)} moves between devices: {moved[0].line[:240]}")
    check_in_place(hlo, len(jax.tree.leaves(decoder._cache)), "f32[" + ",".join(map(str, local)) + "]")
    check_reductions(case, found)
    return summary


def check_in_place(hlo: str, num_buffers: int, shard_type: str):
    """The step aliases every cache buffer to its output and copies no whole shard."""
    aliased = hlo.splitlines()[0].count("-alias)")
    if aliased != num_buffers:
        raise AssertionError(f"step aliases {aliased} buffers, expected all {num_buffers} cache arrays")
    copies = [line for line in hlo.splitlines() if re.search(rf"= {re.escape(shard_type)}\S* copy\(", line)]
    if copies:
        raise AssertionError(f"step copies a whole cache shard {shard_type}: {copies[0].strip()[:200]}")


def check_reductions(case: Case, found: list[Collective]):
    """Over data, one scalar all-reduce (the batch's longest fill, which picks the length bucket);
    over heads, one all-reduce of `out`'s partial sums `(B/data * T, D)`."""
    # The out projection is one matmul over the flattened (B*T, N*H) heads; a step has T = 1.
    expected = [("all-reduce", ((),))] if case.data > 1 else []
    expected += [("all-reduce", ((case.batch_size // case.data, IN_FEATURES),))] if case.model > 1 else []
    got = sorted((c.op, c.shapes) for c in found)
    if got != sorted(expected):
        raise AssertionError(f"expected collectives {expected}, got {got}")


def run_case(case: Case) -> str:
    """Drives a sharded and an unsharded copy of one layer through every path; returns the HLO summary."""
    mesh = make_mesh(data=case.data, model=case.model)
    layer, single = shard(case.build(annotated=True), mesh), case.build(annotated=False)
    for sharded, one in zip(jax.tree.leaves(nnx.state(layer, nnx.Param)),
                            jax.tree.leaves(nnx.state(single, nnx.Param)), strict=True):
        np.testing.assert_array_equal(sharded, one, err_msg="same seed, different weights")
    expected = nnx.state(shardings(layer, mesh), nnx.Cache)
    check_placement(jax.tree.leaves(nnx.state(layer, nnx.Cache)), expected, "placed by shard")

    xs = jax.random.normal(jax.random.key(1), (case.batch_size, 11, IN_FEATURES))
    jit_step = nnx.jit(lambda module, x: module.step(x))
    paths = [
        ("prefill", lambda m: m.prefill(xs[:, :3])),
        ("step", lambda m: m.step(xs[:, 3])),
        ("nnx.jit step", lambda m: jit_step(m, xs[:, 4])),
        ("decode", lambda m: kvattn.decode(m, xs[:, 5:7])),
    ]
    for what, call in paths:
        assert_close(call(layer), call(single), what)
        check_placement(jax.tree.leaves(nnx.state(layer, nnx.Cache)), expected, f"cache after {what}")

    decoder, single_decoder = kvattn.Decoder(layer), kvattn.Decoder(single)
    assert_close(decoder.prefill(xs[:, 7:9]), single_decoder.prefill(xs[:, 7:9]), "Decoder.prefill")
    check_working_placement(decoder, mesh, "Decoder cache after prefill")
    for t in (9, 10):
        assert_close(decoder.step(xs[:, t]), single_decoder.step(xs[:, t]), f"Decoder.step {t}")
        check_working_placement(decoder, mesh, f"Decoder cache after step {t}")
    for got, want in zip(jax.tree.leaves(nnx.state(decoder.sync(), nnx.Cache)),
                         jax.tree.leaves(nnx.state(single_decoder.sync(), nnx.Cache)), strict=True):
        assert_close(got, want, "final cache")
    return check_compiled_step(case, layer, decoder, xs[:, 0])


def check_built_on_mesh(layout: str) -> str:
    """Built under `jax.set_mesh`, an int8 layer is placed as `shard` places it, scales included."""
    case = Case(data=2, model=4, layout=layout, batch_size=4, num_heads=8, num_kv_heads=4, cache_dtype="int8")
    mesh = make_mesh(data=case.data, model=case.model)
    with jax.set_mesh(mesh):
        layer = case.build(annotated=True, eager=True)
    expected = shardings(layer, mesh)
    check_placement(jax.tree.leaves(nnx.state(layer)), expected, "built under set_mesh")
    scale = layer.k_scale[...].sharding.spec
    heads = ("data", None, "model") if layout == "slots_major" else ("data", "model", None)
    if tuple(scale) != heads:
        raise AssertionError(f"k_scale is placed as {scale}, expected {heads}")
    decoder = kvattn.Decoder(layer)
    decoder.step(jnp.ones((case.batch_size, IN_FEATURES)))
    check_working_placement(decoder, mesh, "int8 Decoder cache after a step")
    check_placement(jax.tree.leaves(nnx.state(decoder.sync(), nnx.Cache)), nnx.state(expected, nnx.Cache),
                    "int8 cache synced back")
    return f"k_scale {scale}"


def check_indivisible_heads() -> str:
    """One kv head cannot be split over a model axis of 4: `shard` says so before moving anything."""
    case = Case(data=1, model=4, layout="heads_major", batch_size=2, num_heads=4, num_kv_heads=1)
    try:
        shard(case.build(annotated=True), make_mesh(model=4))
    except ValueError as error:
        if "expected a multiple of 4, got 1" not in str(error):
            raise AssertionError(f"unclear error for num_kv_heads=1 over model=4: {error}") from error
        return str(error)
    raise AssertionError("shard accepted num_kv_heads=1 over a model axis of 4")


def check_paged_over_heads() -> str:
    """A paged layer's pool split over kv heads: outputs equal one device's, the pool stays put, no gather."""
    mesh = make_mesh(model=4)

    def build(**axes):
        return kvattn.MultiHeadAttention(8, IN_FEATURES, num_kv_heads=4, max_len=MAX_LEN, batch_size=2, num_pages=9,
                                         page_size=4, rngs=nnx.Rngs(0), **axes)

    layer, single = shard(build(model_axis="model"), mesh), build()
    expected = NamedSharding(mesh, P(None, None, "model", None))
    manager = kvattn.PageManager(9, 4, 2, MAX_LEN // 4)
    manager.add()
    xs = jax.random.normal(jax.random.key(1), (2, 6, IN_FEATURES))
    calls = [(xs[:, :3], np.array([3, 0], np.int32)), (xs[:, 3:4], np.ones(2, np.int32)),
             (xs[:, 4:5], np.ones(2, np.int32))]
    for index, (chunk, counts) in enumerate(calls):
        if index == 1:
            manager.fork(0, 1)  # the next call copies the shared partial page on the sharded pool
        batch = manager.reserve(counts)
        assert_close(layer.prefill(chunk, jnp.asarray(counts), pages=batch),
                     single.prefill(chunk, jnp.asarray(counts), pages=batch), f"paged call {index}")
        for array in (layer.k_pages[...], layer.v_pages[...]):
            if not array.sharding.is_equivalent_to(expected, array.ndim):
                raise AssertionError(f"pool placed as {array.sharding} after call {index}, expected {expected}")
    batch = manager.reserve(np.ones(2, np.int32))
    cache = layer.paged_cache(*(jnp.asarray(a) for a in batch))
    hlo = kvattn.layer.forward.extend.lower(layer.weights, cache, xs[:, 5:6], jnp.ones(2, jnp.int32),
                                   config=layer.config).compile().as_text()
    moved = [str(c) for c in collectives(hlo) if c.op != "all-reduce" or c.size > 2 * IN_FEATURES]
    if moved:
        raise AssertionError(f"the paged step moves more than out's partial sums: {moved}")
    return "pool split over kv heads; collectives: " + "; ".join(str(c) for c in collectives(hlo))


# -------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(jax|flax)\.")
    if jax.device_count() < DEVICES:
        print(f"FAIL setup: needs {DEVICES} devices, got {jax.device_count()}; "
              f"run with XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
        return 2
    layouts = argv or list(LAYOUTS)
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        print(f"FAIL setup: unknown layouts {unknown}, expected some of {list(LAYOUTS)}")
        return 2
    checks = [(str(case), functools.partial(run_case, case)) for case in cases(layouts, EVERY)]
    checks += [(f"int8 built on mesh {layout}", functools.partial(check_built_on_mesh, layout)) for layout in layouts]
    if "heads_major" in layouts:
        checks.append(("indivisible heads", check_indivisible_heads))
    checks.append(("paged over heads", check_paged_over_heads))
    failed = 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception as error:  # report every case, then fail
            failed += 1
            message = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
            print(f"FAIL {name}: {type(error).__name__}: {message[:600]}", flush=True)
            traceback.print_exc(file=sys.stderr)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
