"""`python -m benchmarks.quant_llama_cpp`: compact weights beside llama.cpp's, on the same prompts and checkpoint.

The model benchmark's random 125M Llama with its tokenizer (the serve
benchmark's checkpoint, `benchmarks.serve_checkpoint`), as kvattn loads it
(`weights=None`, `"int8"`, `"int4"`) and as llama.cpp's GGUFs of it (F32,
Q8_0, Q4_0: the same group size and rounding as kvattn's int8 and int4).
One path of tokens for everyone: `--prompts` random prompts of
`--prompt-len` ids, each followed by kvattn float32's greedy continuation of
`--new-tokens`. At every continuation position each contender gives its
next-token log-probabilities after the path so far (teacher forcing:
kvattn from one forward pass; `llama-server` from `/completion` with
`n_probs`, one request a position, its prompt cache on), and each compact
form is held to its own engine's float32 at the same positions:

  top-1 agreement   the share of positions whose most likely token is the
                    float32 run's;
  log-prob error    the largest |log p - float32's log p| over the float32
                    run's `TOP` most likely tokens at every position (a
                    token outside the compact run's returned `N_PROBS`
                    counts as a miss, reported apart).

kvattn float32 against llama.cpp F32 is reported too: how far the two
engines' float32 runs are apart, the floor of any comparison between them.
Writes `quant_llama_cpp.json` and `.md`.

    python -m benchmarks.quant_llama_cpp --llama-server "$(python -m tools.llama_cpp build)" \
        --gguf-python /path/to/python-with-torch [--prompts 4 --prompt-len 32 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.llama_cpp_contender import LlamaServer
from benchmarks.provenance import load_average, source_revision, versions
from benchmarks.report import table, write

__all__ = ["compare", "measure"]

FORMS = {"float32": ("f32", None), "int8": ("q8_0", "int8"), "int4": ("q4_0", "int4")}
TOP, N_PROBS = 10, 50


def compare(got: list[dict[int, float]], reference: list[dict[int, float]]) -> dict[str, Any]:
    """Top-1 agreement, log-prob error over the reference's `TOP` tokens, and misses: per position, `{id: log p}`."""
    agree, error, misses = 0, 0.0, 0
    for mine, theirs in zip(got, reference, strict=True):
        agree += max(mine, key=mine.get) == max(theirs, key=theirs.get)
        for token in sorted(theirs, key=theirs.get, reverse=True)[:TOP]:
            if token in mine:
                error = max(error, abs(mine[token] - theirs[token]))
            else:
                misses += 1
    return {"top1_agreement": agree / len(reference), "logprob_error": error, "misses": misses,
            "positions": len(reference)}


def _kvattn(checkpoint: Path, paths: np.ndarray, prompt_len: int, weights: str | None) -> list[dict[int, float]]:
    """kvattn's top `N_PROBS` log-probabilities after each continuation prefix, from one forward pass."""
    import jax
    import jax.numpy as jnp

    from kvattn import models

    model = models.from_pretrained(checkpoint, max_len=paths.shape[1], batch_size=len(paths), weights=weights)
    logprobs = np.asarray(jax.nn.log_softmax(model(jnp.asarray(paths)), axis=-1))
    out = []
    for row in logprobs:
        for position in range(prompt_len - 1, paths.shape[1] - 1):  # predicting each continuation token
            top = np.argsort(row[position])[::-1][:N_PROBS]
            out.append({int(t): float(row[position, t]) for t in top})
    return out


def _llama_cpp(server: LlamaServer, paths: np.ndarray, prompt_len: int) -> list[dict[int, float]]:
    """llama-server's top `N_PROBS` log-probabilities after each continuation prefix."""
    out = []
    for path in paths.tolist():
        for position in range(prompt_len - 1, len(path) - 1):
            body = {"prompt": path[: position + 1], "n_predict": 1, "n_probs": N_PROBS, "temperature": 0.0,
                    "top_k": 1, "cache_prompt": True, "ignore_eos": True, "stream": False}
            request = urllib.request.Request(server.url + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                (first,) = json.load(response)["completion_probabilities"]
            out.append({int(entry["id"]): float(entry["logprob"]) for entry in first["top_logprobs"]})
    return out


def measure(bin_dir: str, gguf_python: str, prompts: int, prompt_len: int, new_tokens: int, cache_dir: Path,
            threads: int = 2) -> dict[str, Any]:
    """Every form's figures against its engine's float32 (module docstring)."""
    from benchmarks.serve_checkpoint import write_serve_checkpoint
    from kvattn import generation, models
    from tools import llama_cpp

    checkpoint = cache_dir / "checkpoint"
    write_serve_checkpoint(checkpoint, max_position_embeddings=1024)
    ggufs = llama_cpp.convert(checkpoint, [gguf for gguf, _ in FORMS.values()], python=gguf_python,
                              pre_tokenizer="default")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    start = rng.integers(3, vocab, (prompts, prompt_len)).astype(np.int32)  # past the special tokens
    reference = models.from_pretrained(checkpoint, max_len=prompt_len + new_tokens, batch_size=prompts)
    continuation = np.asarray(generation.generate(reference, start, new_tokens).tokens)
    paths = np.concatenate([start, continuation], axis=1)
    load = load_average()
    runs: dict[str, dict[str, list]] = {"kvattn": {}, "llama.cpp": {}}
    for form, (gguf, weights) in FORMS.items():
        runs["kvattn"][form] = _kvattn(checkpoint, paths, prompt_len, weights)
        server = LlamaServer(bin_dir, ggufs[gguf], [paths[0]], new_tokens=8, threads=threads)
        try:
            runs["llama.cpp"][form] = _llama_cpp(server, paths, prompt_len)
        finally:
            server.close()
    rows = {engine: {form: compare(found, by_form["float32"]) for form, found in by_form.items() if form != "float32"}
            for engine, by_form in runs.items()}
    return {"rows": rows, "engines_float32": compare(runs["llama.cpp"]["float32"], runs["kvattn"]["float32"]),
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "top": TOP, "n_probs": N_PROBS,
            "ggufs": {gguf: str(path) for gguf, path in ggufs.items()},
            "load_average": {"before": load, "after": load_average()}, "versions": versions(),
            "source": source_revision()}


def markdown(results: dict[str, Any]) -> str:
    body = []
    for engine, by_form in results["rows"].items():
        for form, row in by_form.items():
            gguf = {"int8": "Q8_0", "int4": "Q4_0"}[form]
            body.append([engine, form if engine == "kvattn" else gguf, f"{row['top1_agreement']:.3f}",
                         f"{row['logprob_error']:.3f}", f"{row['misses']} of {row['positions'] * results['top']}"])
    floor = results["engines_float32"]
    body.append(["llama.cpp F32 against kvattn float32", "float32", f"{floor['top1_agreement']:.3f}",
                 f"{floor['logprob_error']:.3f}", f"{floor['misses']} of {floor['positions'] * results['top']}"])
    header = ["engine", "weights", "top-1 agreement with its float32", f"log-prob error (nats, its float32's top "
              f"{results['top']})", "misses"]
    return "\n".join(table(header, body)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_llama_cpp", description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", required=True, help="the folder of llama.cpp's binaries")
    parser.add_argument("--gguf-python", default=sys.executable, help="an interpreter with torch and transformers")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", default="bench-results/quant-llama-cpp-cache")
    parser.add_argument("--out-dir", default="bench-results")
    args = parser.parse_args(argv)
    results = measure(args.llama_server, args.gguf_python, args.prompts, args.prompt_len, args.new_tokens,
                      Path(args.cache_dir))
    write(args.out_dir, "quant_llama_cpp", results, markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
