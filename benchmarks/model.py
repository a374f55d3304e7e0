"""`python -m benchmarks --model`: a Llama-shaped checkpoint decoded by kvattn, transformers and a plain cache.

One run writes a Llama-shaped Hugging Face checkpoint with random weights
(config.json + model.safetensors, written with numpy, no torch), then times,
for every batch size and dtype, on one random prompt:

  kvattn.generation.generate  the whole generation as one compiled program
  kvattn.generation.stream    at B=1: the same tokens yielded one by one, one
                          compiled call per token
  plain_cache             the same weights in the decoder that model
                          collections hand-roll: per layer a `(B, S, K, H)`
                          buffer written with `dynamic_update_slice` and read
                          whole, one jitted (cache-donated) step per token
                          called from Python (float dtypes only)
  transformers_dynamic    transformers' `generate` (torch, CPU), greedy, its
  transformers_static     dynamic cache / `cache_implementation="static"`,
                          run by `torch_python` in a subprocess (torch is not
                          a kvattn dependency); reported as unavailable when
                          that interpreter cannot import it
  transformers_static_compiled
                          with `torch_compile`: the static cache, its forward
                          under `torch.compile(mode="reduce-overhead")`
                          (float dtypes only)
  llama.cpp               with `llama_cpp` (the folder of its binaries,
                          `python -m tools.llama_cpp build`): `llama-server`
                          on the same checkpoint as GGUF (F32, BF16, Q8_0 for
                          float32, bfloat16, int8), B slots, the same
                          prompts as token ids, greedy; its tokens compared
                          with kvattn's like every contender's
                          (`benchmarks.llama_cpp_contender`)
  limit                   bytes one decode step must read (every weight but
                          the embedding table, plus the K/V filled on
                          average over the generation) over the bandwidth of
                          a native streaming read of as many bytes
                          (`baselines.Calibration`), timed at the start of
                          every repeat, beside the contenders

The dtype `"bfloat16"` is, on a CPU where kvattn's bfloat16 dot runs,
`from_pretrained(weights="bfloat16")`: bfloat16 weights (half the bytes a
step reads), float32 computation and caches, against transformers and
llama.cpp in bfloat16 (BF16 GGUF); elsewhere bfloat16 everywhere.

The dtype `"int8"` is compact weights with float32 computation: kvattn's
`from_pretrained(weights="int8")` (int8 by int8 dots, per-output weight
scales, per-row activation scales) against transformers' float32 model under
`torch.ao.quantization.quantize_dynamic` of its `Linear` layers (qint8, the
same scheme in FBGEMM; its embedding stays float32), and the bytes of int8
weights, their scales and the float32 K/V as its limit. Greedy agreement of
an int8 contender is counted against kvattn's float32 tokens when they were
measured (the quantization's own drift), else against kvattn int8's. The
dtype `"int4"` is `weights="int4"` (`kvattn.math.int4`: 4-bit values, a
bfloat16 scale per 32 inputs, kvattn's native 4-bit dot), against
llama.cpp's Q4_0 (the same group size and rounding) with `--llama-cpp`;
transformers has no CPU int4 contender.

`XLA_FLAGS` as the run found it is recorded with the results: the library
sets no XLA flag, and neither does this benchmark.

Generation contenders are timed end to end, after an untimed warm-up, as
`t(n)`, the median over `repeats` of one call producing `n` new tokens; each
repeat takes every contender in turn (transformers' calls go to a worker
process that stays up), so a shared machine's load falls on all of them:
decode time per token is `(t(new_tokens) - t(1)) / (new_tokens - 1)` and the
time to first token is `t(1)` (the prompt and the sample). kvattn's
`generate` and `stream` also step each token into the caches; the step for
the last one is under way when the tokens are ready, and is waited for
untimed (before the caches are emptied for the next call). The
plain cache steps the prompt in token by token (untimed) and is timed
directly over the `new_tokens - 1` steps after its first. Every contender decodes greedily,
and its tokens are compared with kvattn's ("greedy agreement": the share of
positions equal to kvattn's up to each sequence's first difference).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import llama_cpp_contender, plain_cache, transformers_contender
from benchmarks.baselines import Calibration
from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import finished_rows, model_markdown, target, write

__all__ = ["COMPACT", "LLAMA_125M", "greedy_agreement", "run_model", "write_llama_checkpoint"]

# The dtypes that are compact weights under float32 computation (`from_pretrained(weights=...)`).
COMPACT = ("int8", "int4")

# About 125M parameters, Llama-shaped with grouped queries.
LLAMA_125M = {
    "vocab_size": 32000, "hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4,
    "intermediate_size": 2048,
}
QUICK_MODEL = {
    "vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
}


def write_llama_checkpoint(directory: str | os.PathLike, *, vocab_size: int, hidden_size: int, num_layers: int,
                           num_heads: int, num_kv_heads: int, intermediate_size: int, max_position_embeddings: int,
                           seed: int = 0) -> Path:
    """Writes a Llama checkpoint with random float32 weights (normal, std 0.02; norms ones), in transformers' names.

    Returns:
      The directory, holding `config.json` and `model.safetensors`.
    """
    import safetensors.numpy

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "intermediate_size": intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden_size),
               "model.norm.weight": np.ones(hidden_size, np.float32),
               "lm_head.weight": normal(vocab_size, hidden_size)}
    for i in range(num_layers):
        layer = f"model.layers.{i}."
        tensors[layer + "input_layernorm.weight"] = np.ones(hidden_size, np.float32)
        tensors[layer + "post_attention_layernorm.weight"] = np.ones(hidden_size, np.float32)
        # torch Linear weights are (out, in).
        tensors[layer + "self_attn.q_proj.weight"] = normal(num_heads * head_dim, hidden_size)
        tensors[layer + "self_attn.k_proj.weight"] = normal(num_kv_heads * head_dim, hidden_size)
        tensors[layer + "self_attn.v_proj.weight"] = normal(num_kv_heads * head_dim, hidden_size)
        tensors[layer + "self_attn.o_proj.weight"] = normal(hidden_size, num_heads * head_dim)
        tensors[layer + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[layer + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[layer + "mlp.down_proj.weight"] = normal(hidden_size, intermediate_size)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    return directory


class _Kvattn:
    """kvattn from empty caches, the caches emptied untimed: `once(count)` and `streamed(count)` are `(seconds, tokens)`."""

    def __init__(self, model, prompts):
        self.model, self.prompts = model, prompts

    def _emptied(self):
        import jax
        from flax import nnx

        jax.block_until_ready(nnx.state(self.model, nnx.Cache))  # the last call's caches, finished untimed
        self.model.reset()
        jax.block_until_ready(nnx.state(self.model, nnx.Cache))  # every emptied buffer, not only pos

    def once(self, count: int):
        """`kvattn.generation.generate`, timed to its tokens.

        Every new token goes into the caches, one step each; the step that
        appends the last one runs in a program of its own after the tokens
        are ready (nothing reads its output), and is waited for untimed.
        """
        import jax

        from kvattn import generation

        self._emptied()
        started = time.perf_counter()
        tokens = jax.block_until_ready(generation.generate(self.model, self.prompts, count).tokens)
        return time.perf_counter() - started, np.asarray(tokens).tolist()

    def streamed(self, count: int):
        """`kvattn.generation.stream` of the first sequence (B=1), timed to the last token it yields.

        With `count` 1 that is the time to the first token as a streaming
        caller sees it: the prefill and its sample; the step that puts the
        token in the caches is under way when it is yielded, and is waited
        for untimed.
        """
        import jax
        from flax import nnx

        from kvattn import generation

        self._emptied()
        started = time.perf_counter()
        tokens = list(generation.stream(self.model, self.prompts[0], count))
        elapsed = time.perf_counter() - started
        jax.block_until_ready(nnx.state(self.model, nnx.Cache))
        return elapsed, [tokens]

    @staticmethod
    def compiled_programs() -> int:
        """Programs in the jit caches of `generate` (`kvattn.models` re-exports the function, not the module)."""
        module = sys.modules["kvattn.generation.generate"]
        return module._program._cache_size() + module._append._cache_size()


def _step_bytes(config, batch: int, prompt_len: int, new_tokens: int, dtype: str, bf16_weights: bool = False) -> int:
    """Bytes a decode step reads: every weight but the embedding table, and the K/V filled on average.

    `"int4"`: half a byte per weight of the projections and the head, two
    per 32 weights (their scales), float32 norms and K/V.
    `"int8"`: one byte per weight of the projections and the head, four per
    output channel (their scales) and per norm weight, float32 K/V.
    `bf16_weights`: two bytes per weight of the projections and the head,
    float32 norms and K/V.
    """
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    inner, vocab = config.intermediate_size, config.vocab_size
    projections = config.num_layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                                       + 3 * hidden * inner) + hidden * vocab
    outputs = config.num_layers * ((heads + 2 * kv_heads) * head_dim + 3 * hidden + 2 * inner) + vocab
    norms = config.num_layers * 2 * hidden + hidden
    filled = prompt_len + (new_tokens + 1) / 2
    kv = 2 * config.num_layers * batch * filled * kv_heads * head_dim
    if dtype == "int8":
        return int(projections + 4 * (outputs + norms + kv))
    if dtype == "int4":  # half a byte a weight, a bfloat16 scale per 32
        return int(projections / 2 + projections / 16 + 4 * (norms + kv))
    if bf16_weights:
        return int(2 * projections + 4 * (norms + kv))
    itemsize = np.dtype(dtype).itemsize
    return int((projections + norms + kv) * itemsize)


def _interleaved(contenders: dict, new_tokens: int, repeats: int,
                 calibration: Calibration) -> tuple[dict[str, dict[str, Any]], float]:
    """`t(1)` and `t(new_tokens)` of every contender, taken in turn within each repeat: medians and last tokens.

    Each repeat also times `calibration` first, so the bandwidth limit is
    measured beside the contenders: returns the rows and its median bytes per
    second.
    """
    firsts, wholes, tokens = ({name: [] for name in contenders} for _ in range(3))
    speeds = []
    for _ in range(repeats):
        speeds.append(calibration.bytes_per_second())
        for name, once in contenders.items():
            firsts[name].append(once(1)[0])
            elapsed, tokens[name] = once(new_tokens)
            wholes[name].append(elapsed)
    rows = {}
    for name in contenders:
        first, whole = statistics.median(firsts[name]), statistics.median(wholes[name])
        rows[name] = {"first_token_ms": 1e3 * first, "whole_ms": 1e3 * whole,
                      "decode_ms_per_token": 1e3 * (whole - first) / (new_tokens - 1), "tokens": tokens[name]}
    return rows, statistics.median(speeds)


def greedy_agreement(tokens, reference) -> float:
    """Fraction of positions where two greedy generations agree, up to their first difference per sequence."""
    tokens, reference = np.asarray(tokens), np.asarray(reference)
    same = np.cumprod(tokens == reference, axis=1)
    return float(same.mean())


def measure_model(*, checkpoint: Path, batch_sizes, dtypes, prompt_len: int, new_tokens: int, repeats: int,
                  torch_python: str, torch_threads: int, torch_compile: bool = False, seed: int = 0,
                  llama_cpp: tuple[Path, dict[str, Path]] | None = None, progress=None) -> dict[str, Any]:
    """Every row of the model benchmark (see the module docstring); `progress(rows)` after each contender.

    `llama_cpp` is the folder of llama.cpp's binaries and its GGUF file per dtype.
    """

    from kvattn import models
    from kvattn.kernels import route

    rows, notes, float_tokens = [], [], {}
    caches = dict(transformers_contender.CACHES, **(transformers_contender.COMPILED if torch_compile else {}))
    rng = np.random.default_rng(seed)
    # float32 first, so the int8 and int4 contenders' agreement is counted against its tokens.
    for dtype in sorted(dtypes, key=lambda d: d in COMPACT):
        for batch in batch_sizes:
            compact = dtype in COMPACT
            # bfloat16 on a CPU where kvattn's bfloat16 dot runs: bfloat16 weights, float32 computation.
            bf16_weights = dtype == "bfloat16" and route.bfloat16_weights()
            weights = dtype if compact else "bfloat16" if bf16_weights else None
            model = models.from_pretrained(checkpoint, max_len=prompt_len + new_tokens, batch_size=batch,
                                           dtype="float32" if weights else dtype, weights=weights)
            prompts = rng.integers(0, model.config.vocab_size, (batch, prompt_len)).astype(np.int32)
            step_bytes = _step_bytes(model.config, batch, prompt_len, new_tokens, dtype, bf16_weights)
            calibration = Calibration(step_bytes)
            base = {"dtype": dtype, "batch_size": batch}
            # transformers has no 4-bit weights on the CPU: int4 meets llama.cpp's Q4_0 only.
            wanted = {} if dtype == "int4" else {name: how for name, how in caches.items() if not (compact and how[1])}
            theirs = transformers_contender.Transformers(torch_python, checkpoint, prompts, dtype, new_tokens,
                                                         torch_threads, wanted) if wanted else None
            ours = _Kvattn(model, prompts)
            ours.once(1), ours.once(new_tokens)  # compile both programs, untimed
            compiled = ours.compiled_programs()
            contenders = {"kvattn.generation.generate": ours.once}
            if batch == 1:  # stream takes one sequence
                ours.streamed(2)  # compile its prefill and step, untimed
                contenders["kvattn.generation.stream"] = ours.streamed
            if theirs is not None:
                contenders.update({name: functools.partial(theirs.once, name) for name in theirs.variants})
            server = None
            if llama_cpp is not None:
                bin_dir, ggufs = llama_cpp
                server = llama_cpp_contender.LlamaServer(bin_dir, ggufs[dtype], prompts, new_tokens, torch_threads)
                contenders["llama.cpp"] = server.once
                notes.append(f"llama.cpp {server.version} ({Path(ggufs[dtype]).name})")
            try:
                timed, limit = _interleaved(contenders, new_tokens, repeats, calibration)
            finally:
                if theirs is not None:
                    theirs.close()
                if server is not None:
                    server.close()
            rows.append(dict(base, contender="limit", decode_ms_per_token=1e3 * step_bytes / limit,
                             step_bytes=step_bytes, bandwidth_gbs=limit / 1e9, read=calibration.method))
            del calibration
            timed["kvattn.generation.generate"]["compiles_while_timed"] = ours.compiled_programs() - compiled
            # An int8 contender agrees with kvattn's float32 tokens, when measured: its drift from float32.
            tokens = timed["kvattn.generation.generate"]["tokens"]
            reference = float_tokens.get(batch, tokens) if compact else float_tokens.setdefault(batch, tokens)
            for name, row in timed.items():
                if row["tokens"] is not reference:
                    row["agrees_with_kvattn"] = greedy_agreement(row["tokens"], reference)
                rows.append(dict(base, contender=name, **row))
            for name in wanted:
                if name in theirs.unavailable:
                    rows.append(dict(base, contender=name, unavailable=theirs.unavailable[name]))
            if theirs is not None and theirs.versions:
                notes.append(theirs.versions)
            if progress:
                progress(rows)
            if weights is None:
                plain = plain_cache.time_plain(model, prompts, new_tokens, repeats)
                plain["agrees_with_kvattn"] = greedy_agreement(plain["tokens"], tokens)
                rows.append(dict(base, contender="plain_cache", **plain))
                if progress:
                    progress(rows)
            del model
    return {"rows": finished_rows(rows), "targets": _targets(rows), "notes": sorted(set(notes))}


def _targets(rows) -> list[dict[str, Any]]:
    """Issue #23's targets for kvattn.generation.generate: ratios of times (None where the other is unavailable).

    float32: decode at B=1 >= 85% of the bandwidth limit and >= 1.1x
    transformers' best, at B>1 >= 1.3x; the first token no slower than
    transformers' best. int8: at B>1 >= 2x transformers' best float32 and
    >= 1.2x transformers' best int8, at B=1 no slower than kvattn's float32.
    No compilation while timed, for every dtype.
    """

    def figure(dtype, batch, contenders, field="decode_ms_per_token"):
        """The best (smallest) `field` among `contenders` at (dtype, batch), or None."""
        found = [row[field] for row in rows if (row["dtype"], row["batch_size"]) == (dtype, batch)
                 and row["contender"] in contenders and row.get(field) is not None]
        return min(found) if found else None

    def ratio(other, ours):
        return None if other is None or ours is None else other / ours

    ours_name = ("kvattn.generation.generate",)
    theirs_names = (*transformers_contender.CACHES, *transformers_contender.COMPILED)
    targets = []
    for dtype, batch in sorted({(r["dtype"], r["batch_size"]) for r in rows}):
        ours, context = figure(dtype, batch, ours_name), {"dtype": dtype, "batch_size": batch}
        theirs = figure(dtype, batch, theirs_names)
        llama = figure(dtype, batch, ("llama.cpp",))
        if llama is not None:  # #36 at B=1: float32 against F32 >= 1.1x, int8 against Q8_0 >= 1.3x; #35 bfloat16
            wanted = {"float32": 1.1, "int8": 1.3, "bfloat16": 1.1, "int4": 1.0}[dtype] if batch == 1 else None
            targets.append(target("speedup over llama.cpp", ratio(llama, ours), ">=", wanted, **context))
            targets.append(target("first token: llama.cpp / kvattn",
                                  ratio(figure(dtype, batch, ("llama.cpp",), "first_token_ms"),
                                        figure(dtype, batch, ours_name, "first_token_ms")), ">=", None, **context))
        if dtype == "int4":
            targets.append(target("speedup over kvattn int8", ratio(figure("int8", batch, ours_name), ours),
                                  ">=", None, **context))
        elif dtype == "int8":
            targets.append(target("speedup over kvattn float32", ratio(figure("float32", batch, ours_name), ours),
                                  ">=", 1.0 if batch == 1 else None, **context))
            if batch > 1:
                targets.append(target("speedup over transformers' best float32",
                                      ratio(figure("float32", batch, theirs_names), ours), ">=", 2.0, **context))
            targets.append(target("speedup over transformers' best int8", ratio(theirs, ours), ">=",
                                  1.2 if batch > 1 else None, **context))
        else:
            wanted = None if dtype != "float32" else 1.1 if batch == 1 else 1.3
            targets.append(target("speedup over transformers' best", ratio(theirs, ours), ">=", wanted, **context))
            if batch == 1:
                targets.append(target("share of the bandwidth limit", ratio(figure(dtype, batch, ("limit",)), ours),
                                      ">=", 0.85 if dtype == "float32" else None, **context))
            else:
                targets.append(target("speedup over plain_cache", ratio(figure(dtype, batch, ("plain_cache",)), ours),
                                      ">=", None, **context))
            first = ratio(figure(dtype, batch, theirs_names, "first_token_ms"),
                          figure(dtype, batch, ours_name, "first_token_ms"))
            targets.append(target("first token: transformers' best / kvattn", first, ">=",
                                  1.0 if dtype == "float32" else None, **context))
            streamed = figure(dtype, batch, ("kvattn.generation.stream",), "first_token_ms")
            if streamed is not None:
                targets.append(target("first token: transformers' best / kvattn stream",
                                      ratio(figure(dtype, batch, theirs_names, "first_token_ms"), streamed), ">=",
                                      None, **context))
        compiles = next(r["compiles_while_timed"] for r in rows
                        if (r["dtype"], r["batch_size"], r["contender"]) == (dtype, batch, ours_name[0]))
        targets.append(target("compilations while timed", compiles, "<=", 0, **context))
    return targets


def _partial(path: Path, rows) -> None:
    """The rows measured so far, so a long run shows its progress (removed when the run ends)."""
    path.write_text(json.dumps(finished_rows(rows), indent=2) + "\n")
    last = rows[-1]
    print(f"measured {last['contender']} (B={last['batch_size']}, {last['dtype']})", file=sys.stderr, flush=True)


def run_model(*, batch_sizes=(1, 8), dtypes=("float32",), prompt_len: int = 128, new_tokens: int = 128,
              repeats: int = 3, num_layers: int | None = None, torch_python: str | None = None,
              torch_threads: int = 2, torch_compile: bool = False, out_dir: str | os.PathLike = "bench-results",
              quick: bool = False, llama_cpp: str | os.PathLike | None = None,
              checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """Writes the random Llama checkpoint, measures every contender and writes `model.json` and `model.md`.

    Args:
      batch_sizes: batch sizes to measure.
      dtypes: "float32" and/or "bfloat16" (weights, compute and caches), and/or
        "int8" (int8 weights, float32 computation and caches).
      prompt_len, new_tokens: prompt length and tokens generated per sequence.
      repeats: timed runs per figure (median reported).
      num_layers: fewer layers than `LLAMA_125M`'s 12, when time is short.
      torch_python: the interpreter that runs transformers (default: this one).
      torch_threads: `torch.set_num_threads` for transformers.
      torch_compile: also time transformers' static cache with its forward
        under `torch.compile(mode="reduce-overhead", fullgraph=True)`.
      out_dir: where the checkpoint (`checkpoint/`), `model.json` and `model.md` go.
      quick: tiny sizes (a smoke test).
      llama_cpp: the folder of llama.cpp's binaries (`python -m tools.llama_cpp build`), to time `llama-server`
        beside kvattn; the checkpoint then carries the serving benchmark's tokenizer, which the GGUF
        converter (run by `torch_python`) needs.
      checkpoint: a Llama-family checkpoint directory to decode instead of writing the random 125M one
        (`python -m tools.make_checkpoint llama-1b` makes a 1B-class one); with `llama_cpp` it needs a
        tokenizer the converter takes.

    Returns:
      The results, as written to `model.json`.
    """
    sizes = dict(QUICK_MODEL if quick else LLAMA_125M)
    if quick:
        prompt_len, new_tokens, repeats = min(prompt_len, 8), min(new_tokens, 16), 1
    if num_layers is not None:
        sizes["num_layers"] = num_layers
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (decode time is t(new_tokens) - t(1)), got {new_tokens}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ggufs = None
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        given = json.loads((checkpoint / "config.json").read_text())
        sizes = {"checkpoint": str(checkpoint), "vocab_size": given["vocab_size"], "hidden_size": given["hidden_size"],
                 "num_layers": given["num_hidden_layers"]}
    elif llama_cpp is None:
        checkpoint = write_llama_checkpoint(out / "checkpoint", max_position_embeddings=prompt_len + new_tokens,
                                            **sizes)
    else:
        from benchmarks.serve_checkpoint import write_serve_checkpoint

        checkpoint = out / "checkpoint"
        write_serve_checkpoint(checkpoint, sizes=sizes, max_position_embeddings=prompt_len + new_tokens)
    if llama_cpp is not None:
        from tools import llama_cpp as build

        kinds = build.convert(checkpoint, [llama_cpp_contender.GGUF_TYPES[d] for d in dtypes],
                              python=torch_python or sys.executable, pre_tokenizer="default")
        ggufs = {dtype: kinds[llama_cpp_contender.GGUF_TYPES[dtype]] for dtype in dtypes}
    from kvattn.kernels import native

    started = time.perf_counter()
    load = load_average()
    measured = measure_model(checkpoint=checkpoint, batch_sizes=tuple(batch_sizes), dtypes=tuple(dtypes),
                             prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
                             torch_python=torch_python or sys.executable, torch_threads=torch_threads,
                             torch_compile=torch_compile,
                             llama_cpp=None if llama_cpp is None else (Path(llama_cpp), ggufs),
                             progress=lambda rows: _partial(out / "model.partial.json", rows))
    results = {
        "xla_flags": os.environ.get("XLA_FLAGS"),
        # Which int8 dot kvattn's int8 rows ran: its native one on tiled kernels, or XLA's (kvattn.math.quant).
        "int8_dot": "kvattn.kernels.native (tiled kernels)" if native.available(native.INT8_DOT) else "XLA (YNNPACK)",
        "config": dict(sizes, batch_sizes=list(batch_sizes), dtypes=list(dtypes), prompt_len=prompt_len,
                       new_tokens=new_tokens, repeats=repeats, torch_threads=torch_threads,
                       torch_compile=torch_compile, llama_cpp=None if llama_cpp is None else str(llama_cpp)),
        "machine": machine_info(), "versions": versions(), "source": source_revision(),
        "load_average": {"before": load, "after": load_average()}, **measured,
        "elapsed_s": time.perf_counter() - started,
    }
    write(out, "model", results, model_markdown(results))
    (out / "model.partial.json").unlink(missing_ok=True)
    return results
