"""Checkpoint tensors read in place (`kvattn.models.tensors`) and what loading holds while it reads them.

A mapped tensor is the file's bytes, read only as sliced; a `Joined` reads
its parts as `np.concatenate` would give them, a slice at a time. Loading a
checkpoint holds the weights stored so far and a slice: measured with
`tracemalloc` (NumPy reports every array it allocates to it), loading's
peak stays within a few slices of what the loaded model keeps, and what it
keeps is the arrays loading built, adopted by JAX without a copy.
"""

from __future__ import annotations

import json
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from kvattn import extra, models
from kvattn.models import hf, tensors
from tests.helpers import FIXTURES


def test_a_mapped_tensor_is_the_file_s_values_in_every_float_dtype(tmp_path):
    rng = np.random.default_rng(0)
    stored = {f"t{i}": rng.standard_normal(shape).astype(dtype) for i, (shape, dtype) in enumerate(
        [((3, 5), np.float32), ((7,), np.float16), ((2, 3, 4), jnp.bfloat16), ((4, 1), np.float64), ((0, 3), np.float32)])}
    safetensors.numpy.save_file(stored, tmp_path / "m.safetensors", metadata={"format": "np"})
    files = tensors.MappedFiles()
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", jnp.dtype(jnp.bfloat16): "BF16",
             np.dtype(np.float64): "F64"}
    for name, value in stored.items():
        view = files.view(tmp_path / "m.safetensors", name, names[value.dtype], value.shape)
        assert view.dtype == value.dtype and not view.flags.writeable
        np.testing.assert_array_equal(view, value)
        files.release()  # pages handed back are read again from the page cache
        np.testing.assert_array_equal(view, value)


def test_joined_parts_read_as_their_concatenation_a_slice_at_a_time():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((6, n, 4)).astype(np.float32) for n in (3, 1, 5)]
    whole = np.concatenate(parts, axis=1)
    released = []
    joined = tensors.Joined(parts, 1, lambda: released.append(1))
    assert joined.shape == whole.shape and joined.ndim == 3 and joined.dtype == np.float32
    for start, stop in [(0, 9), (0, 2), (2, 4), (3, 4), (4, 9), (8, 9), (5, 5)]:
        np.testing.assert_array_equal(joined[:, start:stop], whole[:, start:stop])
    np.testing.assert_array_equal(np.asarray(joined), whole)
    assert len(released) == 8  # after every read
    bias = tensors.Joined([p[0] for p in parts], 0)
    np.testing.assert_array_equal(np.asarray(bias), np.concatenate([p[0] for p in parts]))
    table = tensors.Joined([parts[0][:, 0]])
    np.testing.assert_array_equal(table.T[:, 1:4], parts[0][:, 0].T[:, 1:4])
    with pytest.raises(TypeError, match=r"read \[:, start:stop\] only"):
        joined[0]
    with pytest.raises(ValueError, match="only one 2-D part transposes"):
        joined.T


def _large_checkpoint(directory, vocab: int = 32768):
    """The Llama fixture's config with a vocabulary of `vocab` (an embedding table far larger than any other
    tensor, as a 1B model's is), random bfloat16 weights."""
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    config["vocab_size"] = vocab
    parsed = hf.from_hf_config(config)
    rng = np.random.default_rng(2)
    named = {}
    for short, want in hf.expected_tensors(parsed).items():
        named["model." + short] = (rng.standard_normal(want.shape) * 0.02).astype(jnp.bfloat16)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(named, directory / "model.safetensors")
    return directory, named


@pytest.mark.parametrize("weights", [None, "int8"])
def test_loading_holds_the_stored_weights_and_a_slice_never_a_whole_tensor_beside_them(tmp_path, monkeypatch,
                                                                                       weights):
    if jax.default_backend() != "cpu":
        pytest.skip("on the CPU, the stored arrays are the ones loading built")
    directory, named = _large_checkpoint(tmp_path / "large")
    whole = models.from_pretrained(directory, max_len=8, weights=weights)  # every tensor within one slice
    slice_bytes = 64 << 10
    monkeypatch.setattr(tensors, "SLICE_BYTES", slice_bytes)
    tracemalloc.start()
    try:
        model = models.from_pretrained(directory, max_len=8, weights=weights)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table = named["model.embed_tokens.weight"]
    params = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params >= 2 * table.nbytes  # the table, stored in float32 or int8 (each half the model's bytes or more)
    # What the model keeps is what loading built (no copy into JAX) ...
    assert held >= 0.95 * params, (held, params)
    # ... and loading held beside it a few slices, far less than the table it read, or its stored form.
    assert peak - held <= 8 * slice_bytes < table.nbytes / 4, (peak - held, table.nbytes)
    # Slices store what whole tensors do, bit for bit.
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                      nnx.to_flat_state(nnx.state(whole, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))
    np.testing.assert_array_equal(model.prefill(np.array([[1, 2, 3]])), whole.prefill(np.array([[1, 2, 3]])))


def test_loading_reports_each_tensor_and_the_bar_over_them_closes(capsys, monkeypatch):
    calls = []
    models.from_pretrained(FIXTURES / "gpt2", max_len=8, on_tensor=lambda done, total: calls.append((done, total)))
    total = len(hf.read_headers(*hf.checkpoint_files(FIXTURES / "gpt2")))
    assert calls == [(done, total) for done in range(1, total + 1)]
    for terminal in (False, True):
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal, raising=False)
        on_tensor = extra.loading_progress()
        for done in range(1, 4):
            on_tensor(done, 3)
        # tqdm's bar, on stderr when it is a terminal; nothing in a log or a captured stream
        assert ("loading" in capsys.readouterr().err) == terminal
