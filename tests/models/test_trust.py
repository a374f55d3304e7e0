"""Nothing silently wrong at model level: token ids, sampling settings, configs and checkpoint files.

Every entry refuses bad input with a clear error before any state changes;
under the caller's own `jit` a sequence holding a bad token id writes nothing
and gets NaN logits. Checkpoints are checked against their config from the
safetensors headers before a model is built or a tensor read, and a mutation
fuzz checks that every mutated checkpoint is refused or loads exactly what its
files hold.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvattn import generation, models, serving
from kvattn.kernels import native
from kvattn.generation import SamplingParams
from kvattn.models import CheckpointError, UnsupportedConfigError
from tests.helpers import FIXTURES

VOCAB = 97  # every fixture's vocab_size


@pytest.fixture(scope="module")
def llama():
    return models.from_pretrained(FIXTURES / "llama", max_len=32, batch_size=2)


def cache_bits(model) -> dict:
    return {"/".join(map(str, k)): np.array(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Cache))}


def assert_unchanged(model, before):
    after = cache_bits(model)
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name].tobytes() == before[name].tobytes(), name


# ------------------------------------------------------------------ token ids

BAD_IDS = [
    (VOCAB, ValueError, r"in \[0, 97\), got 97 at"),
    (-1, ValueError, r"got -1 at"),
    (2**32 + 5, ValueError, r"got 4294967301 at"),  # an int64 that int32 would wrap onto 5
]


@pytest.mark.parametrize("bad, error, message", BAD_IDS)
def test_every_entry_refuses_out_of_range_ids_before_any_state_changes(llama, bad, error, message):
    llama.reset()
    llama.prefill(np.array([[1, 2], [3, 4]]))
    before = cache_bits(llama)
    prompts = np.array([[1, 2, 3], [4, 5, bad]], np.int64)
    calls = {
        "generate": lambda: generation.generate(llama, prompts, 2),
        "prefill": lambda: llama.prefill(prompts),
        "step": lambda: llama.step(prompts[:, 2]),
        "forward": lambda: llama(prompts),
    }
    for name, call in calls.items():
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(llama, before)


@pytest.mark.parametrize("tokens, error, message", [
    (np.array([[1.0, 2.0], [3.0, 4.0]]), TypeError, "integer token ids, got dtype float64"),
    (np.array([[True, False], [True, True]]), TypeError, "dtype bool"),
    ([[1, True], [2, 3]], TypeError, "a bool among them"),
    (np.array([1, 2]), ValueError, r"shape \(2, T\), got \(2,\)"),
    (np.zeros((3, 2), np.int32), ValueError, r"shape \(2, T\), got \(3, 2\)"),
])
def test_prompts_of_the_wrong_kind_are_named(llama, tokens, error, message):
    with pytest.raises(error, match=message):
        generation.generate(llama, tokens, 2)


def test_generate_refuses_non_integer_lengths(llama):
    with pytest.raises(ValueError, match="lengths must be int"):
        generation.generate(llama, np.ones((2, 3), np.int32), 2, lengths=[2.5, 1.0])


def test_stop_tokens_are_ids_in_the_vocabulary(llama):
    for stops, error in (([1.5], TypeError), ([VOCAB], ValueError), ([True], TypeError)):
        with pytest.raises(error, match="stop_tokens"):
            generation.generate(llama, np.ones((2, 3), np.int32), 2, stop_tokens=stops)


def test_a_bad_id_under_jit_writes_nothing_and_gives_nan_logits(llama):
    """The layer's contract where nothing can raise: the bad sequence is left as it was, the other decodes."""
    llama.reset()
    llama.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    before = cache_bits(llama)

    @nnx.jit
    def step(model, tokens):
        return model.step(tokens)

    logits = step(llama, jnp.array([7, VOCAB + 3]))
    assert np.isnan(np.asarray(logits[1])).all() and np.isfinite(np.asarray(logits[0])).all()
    assert np.asarray(llama.pos).tolist() == [4, 3]
    after = cache_bits(llama)
    for name in before:  # sequence 1's keys and values are exactly what they were
        if name.endswith("pos"):
            continue
        np.testing.assert_array_equal(after[name][1], before[name][1], err_msg=name)
    # Sequence 0 decoded as an eager step of the same token does.
    llama.reset()
    llama.prefill(np.array([[1, 2, 3], [4, 5, 6]]))
    eager = llama.step(np.array([7, 8]))
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(eager[0]), rtol=1e-5, atol=1e-5)


def test_gpt2_refuses_max_len_past_its_learned_positions():
    n_positions = json.loads((FIXTURES / "gpt2" / "config.json").read_text())["n_positions"]
    with pytest.raises(ValueError, match=f"max_len={n_positions + 1} exceeds the {n_positions} learned positions"):
        models.from_pretrained(FIXTURES / "gpt2", max_len=n_positions + 1)


# ------------------------------------------------------------------ sampling

BAD_SAMPLING = [
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=-0.5), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
    (dict(top_p=-0.5), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=0), ValueError, "top_k must be a positive int"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(top_k=VOCAB + 1), ValueError, "at most the vocabulary size 97"),
    (dict(temperature=1.0), ValueError, "needs rng"),
]


@pytest.mark.parametrize("settings_, error, message", BAD_SAMPLING)
def test_sampling_settings_are_checked_at_every_entry(llama, settings_, error, message):
    with pytest.raises(error, match=message):
        generation.generate(llama, np.ones((2, 3), np.int32), 2, **settings_)
    with pytest.raises(error, match=message):
        generation.Sampling(**{k: v for k, v in settings_.items()}).check_vocab(VOCAB).check_rng(None)


@pytest.fixture(scope="module")
def paged():
    return models.from_pretrained(FIXTURES / "llama", max_len=32, batch_size=2, num_pages=9, page_size=8)


@pytest.mark.parametrize("settings_, error, message", BAD_SAMPLING[:4] + BAD_SAMPLING[7:])
def test_the_server_and_stream_check_sampling_too(paged, settings_, error, message):
    if "rng" not in message:  # the engine draws a seed for a request without one
        with pytest.raises(error, match=message):
            serving.Server(paged, chunk=8).submit([1, 2], SamplingParams(max_tokens=2, **settings_))
    single = models.CausalLM(paged.config, max_len=8, rngs=nnx.Rngs(0))
    with pytest.raises(error, match=message):
        generation.stream(single, [1, 2], 2, **settings_)  # refused at the call, before iteration


def test_server_submit_refuses_without_taking_an_index(paged):
    server = serving.Server(paged, chunk=8)
    refused = [
        (np.array([1.0, 2.0]), TypeError),
        (np.array([True, False]), TypeError),
        (np.array([[1, 2], [3, 4]]), ValueError),  # 2-D
        ([1, VOCAB], ValueError),
        ([-1], ValueError),
        ([], ValueError),
    ]
    for prompt, error in refused:
        with pytest.raises(error):
            server.submit(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(max_tokens=2, stop_token_ids=[2.0])
    with pytest.raises(ValueError, match="stop_tokens must be token ids in"):
        server.submit([1, 2], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB]))
    with pytest.raises(ValueError, match="stop_tokens must be token ids in"):
        server.submit([1, 2], SamplingParams(max_tokens=2), eos_token_ids=[VOCAB + 1])
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=2.0)
    assert server.submit([1, 2], SamplingParams(max_tokens=2)) == 0  # no refused call took an index
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        serving.Server(paged, chunk=8.0)


# ------------------------------------------------------------------ configs


def write_checkpoint(directory: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        safetensors.numpy.save_file(tensors, directory / "model.safetensors")
        return directory
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        safetensors.numpy.save_file(part, directory / file)
        weight_map.update({name: file for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def fixture(family: str) -> tuple[dict, dict]:
    return (json.loads((FIXTURES / family / "config.json").read_text()),
            safetensors.numpy.load_file(FIXTURES / family / "model.safetensors"))


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 4_000_000, r"model.embed_tokens.weight has shape \(97, 64\), expected \(4000000, 64\)"),
    ("vocab_size", 10**12, "vocab_size must be a positive int of at most 2147483647"),
    ("num_hidden_layers", 10**6, "1000000 layers, but the checkpoint holds only"),
    ("hidden_size", 0, "hidden_size must be a positive int of at most 2147483647, got 0"),
    ("head_dim", 10**12, "head_dim must be a positive int of at most 2147483647"),  # found by the wide fuzz
    ("head_dim", 2**20, "head_dim must be at most 65536, got 1048576"),
    ("hidden_size", 64.0, "hidden_size must be a positive int of at most 2147483647, got 64.0"),
    ("num_attention_heads", 3, "not a multiple of num_attention_heads=3|num_heads=3 must be a multiple"),
    ("num_key_value_heads", 3, "must be a multiple of num_kv_heads=3"),
    ("num_key_value_heads", 0, "num_kv_heads must be a positive int of at most 2147483647, got 0"),
    ("rms_norm_eps", -1.0, "norm_eps must be a positive finite number"),
    ("rms_norm_eps", "small", "norm_eps"),
    ("max_position_embeddings", None, "lacks 'max_position_embeddings'"),
    ("tie_word_embeddings", "no", "tie_embeddings must be a bool"),
])
def test_absurd_configs_are_refused_quickly_without_building_anything(tmp_path, monkeypatch, field, value, message):
    config, tensors = fixture("llama")
    directory = write_checkpoint(tmp_path / "ckpt", {**config, field: value}, tensors)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was checked")

    monkeypatch.setattr(models.hf, "CausalLM", no_model)
    start = time.perf_counter()
    with pytest.raises((UnsupportedConfigError, CheckpointError), match=message):
        models.from_pretrained(directory, max_len=16)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("rope, message", [
    ({"rope_theta": 0}, "theta must be a number > 1"),
    ({"rope_theta": 1.0, "rope_type": "default"}, "theta"),
    ({"rope_theta": 500.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
      "beta_fast": 0.0}, "rope settings"),
    ({"rope_theta": 500.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
      "beta_slow": -1.0}, "rope settings"),
    ({"rope_theta": 500.0, "rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 16},
     "factor must be positive"),
])
def test_rope_settings_are_checked_when_the_config_is_read(rope, message):
    config, _ = fixture("llama")
    with pytest.raises(UnsupportedConfigError, match=message):
        models.from_hf_config({**config, "rope_parameters": rope})


# ------------------------------------------------------------------ files


def load_params(directory) -> dict:
    return weight_values(models.from_pretrained(directory, max_len=8))


def weight_values(model) -> dict:
    """Every parameter by path, in the layout the loader is given it (`CausalLM.weight_value`)."""
    paths = ("/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return {path: np.array(model.weight_value(path)) for path in paths}


@pytest.fixture(scope="module")
def reference_params():
    return load_params(FIXTURES / "llama")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"].T}),
     r"k_proj.weight has shape \(64, 32\), expected \(32, 64\)"),
    (lambda t: t.update({"model.layers.1.self_attn.o_proj.weight":
                         t["model.layers.1.self_attn.o_proj.weight"].reshape(32, 128)}),
     r"o_proj.weight has shape \(32, 128\), expected \(64, 64\)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"].ravel()}),
     r"q_proj.weight has shape \(4096,\)"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int8)}), "is I8; weights must be"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int32)}), "is I32"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"] > 0}), "is BOOL"),
    (lambda t: t.pop("lm_head.weight"), r"missing tensors lm_head.weight"),
    (lambda t: t.update({"extra.weight": np.ones(3, np.float32), "model.extra2": np.ones(3, np.float32)}),
     r"unexpected tensors extra.weight, model.extra2"),
    (lambda t: t.update({"norm.weight": t["model.norm.weight"]}), "are the same tensor"),
])
def test_tensors_that_do_not_fit_are_refused_by_name(tmp_path, change, message):
    config, tensors = fixture("llama")
    change(tensors)
    with pytest.raises(CheckpointError, match=message):
        models.from_pretrained(write_checkpoint(tmp_path / "c", config, tensors), max_len=8)


def test_gpt2_mask_buffers_of_any_dtype_are_allowed_and_left_unread(tmp_path):
    """Older GPT-2 checkpoints keep the causal mask as `attn.bias` / `attn.masked_bias`: not weights, not refused."""
    config, tensors = fixture("gpt2")
    tensors["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.bool_))
    tensors["transformer.h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    model = models.from_pretrained(write_checkpoint(tmp_path / "c", config, tensors), max_len=8)
    reference = models.from_pretrained(FIXTURES / "gpt2", max_len=8)
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                      nnx.to_flat_state(nnx.state(reference, nnx.Param)), strict=True):
        np.testing.assert_array_equal(got[...], want[...], err_msg=str(path))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(tmp_path, value):
    config, tensors = fixture("llama")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    with pytest.raises(CheckpointError, match="up_proj.weight holds NaN or infinity"):
        models.from_pretrained(write_checkpoint(tmp_path / "c", config, tensors), max_len=8)


@pytest.mark.parametrize("weights", [None, "int8", "int4", "bfloat16"])
def test_a_bfloat16_checkpoint_loads_its_own_values(tmp_path, weights):
    """A checkpoint stored in bfloat16 (as most are) loads as its float32 twin holding the same values does:
    float32, int8, int4 and bfloat16 weights alike, logits to the bit."""
    if weights == "bfloat16" and not native.available(native.BF16_DOT):
        pytest.skip("kvattn's bfloat16 dot cannot run here")
    config, tensors = fixture("qwen2")
    half = {name: value.astype(jnp.bfloat16) for name, value in tensors.items()}
    widened = {name: value.astype(np.float32) for name, value in half.items()}
    stored = write_checkpoint(tmp_path / "bf16", config, half)
    header = json.loads((stored / "model.safetensors").read_bytes()[8:][: int.from_bytes(
        (stored / "model.safetensors").read_bytes()[:8], "little")])
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    models_ = [models.from_pretrained(directory, max_len=16, weights=weights)
               for directory in (stored, write_checkpoint(tmp_path / "f32", config, widened))]
    prompt = jnp.asarray([[3, 17, 29, 5, 60]])
    np.testing.assert_array_equal(*(np.asarray(model(prompt)) for model in models_))


def test_a_sharded_checkpoint_loads_exactly(tmp_path, reference_params):
    config, tensors = fixture("llama")
    got = load_params(write_checkpoint(tmp_path / "c", config, tensors, shards=3))
    assert all(got[name].tobytes() == reference_params[name].tobytes() for name in reference_params)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    config, tensors = fixture("llama")
    directory = write_checkpoint(tmp_path / "c", config, tensors, shards=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    second = safetensors.numpy.load_file(directory / sorted(set(index["weight_map"].values()))[1])
    name = sorted(safetensors.numpy.load_file(directory / first))[0]
    second[name] = np.zeros_like(safetensors.numpy.load_file(directory / first)[name])
    safetensors.numpy.save_file(second, directory / sorted(set(index["weight_map"].values()))[1])
    with pytest.raises(CheckpointError, match=f"stored in more than one file: {name}"):
        models.from_pretrained(directory, max_len=8)


@pytest.mark.parametrize("entry", ["../elsewhere/x.safetensors", "/dev/zero", "/etc/passwd", "..", "sub/x.safetensors"])
def test_an_index_may_name_only_files_inside_the_checkpoint(tmp_path, monkeypatch, entry):
    config, tensors = fixture("llama")
    directory = write_checkpoint(tmp_path / "c", config, tensors, shards=2)
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = entry
    path.write_text(json.dumps(index))
    opened = []
    monkeypatch.setattr(models.hf.safetensors, "safe_open",
                        lambda file, **kw: opened.append(file) or pytest.fail(f"opened {file}"))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        models.from_pretrained(directory, max_len=8)
    assert not opened


def test_a_symlinked_shard_inside_the_directory_loads(tmp_path, reference_params):
    """Hub caches link each file to a blob elsewhere: a plain name that is a symlink stays allowed."""
    config, tensors = fixture("llama")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    directory = write_checkpoint(tmp_path / "c", config, tensors, shards=2)
    for file in directory.glob("*.safetensors"):
        shutil.move(file, blobs / file.name)
        file.symlink_to(blobs / file.name)
    got = load_params(directory)
    assert all(got[name].tobytes() == reference_params[name].tobytes() for name in reference_params)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[]", "must hold"),
    ('{"weight_map": []}', "must hold"),
    ('{"weight_map": {"a": 3}}', "must hold"),
    ('{"metadata": {}}', "must hold"),
])
def test_a_malformed_index_is_named(tmp_path, content, message):
    config, tensors = fixture("llama")
    directory = write_checkpoint(tmp_path / "c", config, tensors, shards=2)
    (directory / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        models.from_pretrained(directory, max_len=8)


def test_a_damaged_file_is_named(tmp_path):
    config, tensors = fixture("llama")
    directory = write_checkpoint(tmp_path / "c", config, tensors)
    data = bytearray((directory / "model.safetensors").read_bytes())
    (directory / "model.safetensors").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a valid safetensors file"):
        models.from_pretrained(directory, max_len=8)
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        models.from_pretrained(directory, max_len=8)


# ------------------------------------------------------------------ the fuzz

CONFIG_VALUES = [0, -1, 1, 3, 10**12, 2.5, True, None, "x", [], 1e-300]
INTEGER_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "max_position_embeddings", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                  "attention_bias", "rope_theta"]


@st.composite
def mutations(draw):
    """One change to the llama fixture: to a tensor's shape, dtype or values, to a config field, or to the index."""
    config, tensors = fixture("llama")
    names = sorted(tensors)
    kind = draw(st.sampled_from(["transpose", "ravel", "dtype", "value", "drop", "rename", "config", "index",
                                 "exact"]))
    name = draw(st.sampled_from(names))
    shards = 1
    if kind == "transpose" and tensors[name].ndim == 2:
        tensors[name] = np.ascontiguousarray(tensors[name].T)
    elif kind == "ravel":
        tensors[name] = tensors[name].reshape(-1)
    elif kind == "dtype":
        dtype = draw(st.sampled_from([np.int8, np.int32, np.int64, np.bool_, np.uint8, np.float16,
                                      ml_dtypes.bfloat16, np.float64]))
        tensors[name] = tensors[name].astype(dtype)
    elif kind == "value":
        flat = tensors[name].reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
    elif kind == "drop":
        tensors.pop(name)
    elif kind == "rename":
        tensors[draw(st.sampled_from(["model." + name, name.replace("layers.1", "layers.2"), name + ".x"]))] = \
            tensors.pop(name)
    elif kind == "config":
        config[draw(st.sampled_from(INTEGER_FIELDS))] = draw(st.sampled_from(CONFIG_VALUES))
    elif kind == "index":
        shards = draw(st.integers(2, 3))
    else:
        shards = draw(st.integers(1, 2))
    return kind, config, tensors, shards, draw(st.sampled_from(["../x.safetensors", "/etc/passwd", None]))


@settings(max_examples=40)
@given(mutations())
def test_fuzz_every_mutated_checkpoint_is_refused_clearly_or_loads_what_its_files_hold(tmp_path_factory, mutation):
    kind, config, tensors, shards, bad_entry = mutation
    directory = write_checkpoint(tmp_path_factory.mktemp("fuzz"), config, tensors, shards)
    if kind == "index" and bad_entry is not None:
        path = directory / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        index["weight_map"][sorted(index["weight_map"])[0]] = bad_entry
        path.write_text(json.dumps(index))
    try:
        model = models.from_pretrained(directory, max_len=8)
    except (CheckpointError, UnsupportedConfigError) as error:
        assert str(error) and "\n" not in str(error)
        return
    # It loaded: every parameter is exactly what the files hold (in float32), and finite.
    loaded = weight_values(model)
    assert all(np.isfinite(value).all() for value in loaded.values())
    want = models.hf.expected_tensors(model.config)
    for short, (_, targets, _) in want.items():
        if not targets:
            continue
        stored = tensors.get("model." + short, tensors.get(short))
        parts = want[short].row.convert(np.asarray(stored, np.float32), model.config)
        for target, part in zip(targets, parts, strict=True):
            path, where = models.hf.locate(target, model.config)  # a fused parameter's part is a slice of it
            assert loaded[path][where].tobytes() == part.astype(np.float32).tobytes(), target
