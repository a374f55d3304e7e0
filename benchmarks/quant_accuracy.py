"""`python -m benchmarks.quant_accuracy`: how far compact weights move a model from float32, on transformers' fixtures.

For every tiny checkpoint in `tests/fixtures/hf` (made by transformers with
deliberately high-gain weights, so that rounding shows: transformers' own
bfloat16 run is off its float32 run by up to half the largest logit), and
for kvattn's `weights="int8"`, `weights="int4"` and `dtype=bfloat16` against
kvattn's float32:

  logit error   the largest |logit - float32 logit| over every position of
                the fixture's prompts, as a share of the largest float32
                logit of that prompt (the worst prompt);
  agreement     greedy decoding of `NEW_TOKENS` tokens after each prompt
                (fewer for GPT-2, whose learned positions end at 128): the
                share of positions equal to float32's up to each sequence's
                first difference, and where that first difference falls.

The same for transformers, run by `--torch-python` in a subprocess (torch is
not a kvattn dependency): its float32 model under
`torch.ao.quantization.quantize_dynamic(model, {Linear}, qint8)`, against
its own float32 run (GPT-2's projections are `Conv1D`, which that leaves in
float32: only its head is quantized), and its bfloat16 logits as the
fixture stores them. Writes `quant_accuracy.json` and `quant_accuracy.md`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import torch_worker
from benchmarks.provenance import source_revision, versions
from benchmarks.report import table, write

__all__ = ["FIXTURES", "NEW_TOKENS", "measure"]

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
NEW_TOKENS = 128


def _new_tokens(want: dict, family: str) -> int:
    return NEW_TOKENS if family != "gpt2" else min(NEW_TOKENS, 128 - want["prompts"].shape[1])


def _agreement(tokens, reference) -> tuple[float, list[int]]:
    same = np.cumprod(np.asarray(tokens) == np.asarray(reference), axis=1)
    return float(same.mean()), [int(row.sum()) for row in same]


def _logit_error(logits, reference, lengths) -> float:
    return max(float(np.abs(logits[row, :n] - reference[row, :n]).max() / np.abs(reference[row, :n]).max())
               for row, n in enumerate(lengths))


def _kvattn(family: str) -> dict[str, Any]:
    import jax.numpy as jnp
    from flax import nnx

    from kvattn import generation, models

    want = dict(np.load(FIXTURES / family / "expected.npz"))
    count = _new_tokens(want, family)
    prompts, lengths = want["prompts"], want["lengths"]
    forward = nnx.jit(lambda model, tokens: model(tokens))
    out, reference = {}, None
    for name, options in (("float32", {}), ("int8", {"weights": "int8"}), ("int4", {"weights": "int4"}),
                          ("bfloat16", {"dtype": jnp.bfloat16})):
        model = models.from_pretrained(FIXTURES / family, max_len=prompts.shape[1] + count, batch_size=len(lengths),
                                       **options)
        logits = np.asarray(forward(model, jnp.asarray(prompts)), np.float32)
        tokens = np.asarray(generation.generate(model, prompts, count, lengths=lengths).tokens)
        if reference is None:
            reference = (logits, tokens)
            continue
        share, first = _agreement(tokens, reference[1])
        out[name] = {"logit_error": _logit_error(logits, reference[0], lengths), "agreement": share,
                     "first_difference": first}
    return {"new_tokens": count, **out}


_TORCH_SCRIPT = r"""
import numpy as np
want = dict(np.load(args["checkpoint"] + "/expected.npz"))
full = transformers.AutoModelForCausalLM.from_pretrained(args["checkpoint"], dtype=torch.float32).eval()
compact = torch.ao.quantization.quantize_dynamic(full, {torch.nn.Linear}, dtype=torch.qint8)
prompts, lengths = want["prompts"], want["lengths"]
out = {"torch": torch.__version__, "transformers": transformers.__version__, "logits": [], "tokens": []}
with torch.inference_mode():
    for model in (full, compact):
        logits, tokens = [], []
        for row, n in enumerate(lengths):
            prompt = torch.tensor(prompts[row : row + 1, :n])
            logits.append(model(prompt).logits[0].tolist())
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args["count"],
                                       min_new_tokens=args["count"], do_sample=False, pad_token_id=0)
            tokens.append(generated[0, n:].tolist())
        out["logits"].append(logits)
        out["tokens"].append(tokens)
print(json.dumps(out))
"""


def _transformers(family: str, count: int, python: str, threads: int) -> dict[str, Any]:
    args = {"checkpoint": str(FIXTURES / family), "count": count, "threads": threads}
    result = torch_worker.run(python, _TORCH_SCRIPT, args, ("torch", "transformers"))
    if "unavailable" in result:
        return result
    want = dict(np.load(FIXTURES / family / "expected.npz"))
    full, compact = ([np.asarray(rows, np.float32) for rows in result["logits"][i]] for i in range(2))
    errors = [float(np.abs(c - f).max() / np.abs(f).max()) for c, f in zip(compact, full, strict=True)]
    share, first = _agreement(result["tokens"][1], result["tokens"][0])
    half = [float(np.abs(want["logits_bf16"][row, :n] - want["logits"][row, :n]).max()
                  / np.abs(want["logits"][row, :n]).max()) for row, n in enumerate(want["lengths"])]
    return {"versions": f"torch {result['torch']}, transformers {result['transformers']}",
            "int8": {"logit_error": max(errors), "agreement": share, "first_difference": first},
            "bfloat16": {"logit_error": max(half)}}


def measure(torch_python: str | None = None, threads: int = 2) -> dict[str, Any]:
    """Every family's rows (module docstring)."""
    families = {}
    for family in FAMILIES:
        ours = _kvattn(family)
        theirs = _transformers(family, ours["new_tokens"], torch_python or sys.executable, threads)
        families[family] = {"kvattn": ours, "transformers": theirs}
    return {"families": families, "versions": versions(), "source": source_revision()}


def markdown(results: dict[str, Any]) -> str:
    def cell(entry: dict | None, field: str) -> str:
        if not entry or field not in entry:
            return "n/a"
        value = entry[field]
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    rows = []
    for family, found in results["families"].items():
        ours, theirs = found["kvattn"], found["transformers"]
        for kind in ("int8", "int4", "bfloat16"):
            rows.append([family, kind, ours["new_tokens"], cell(ours[kind], "logit_error"),
                         cell(theirs.get(kind), "logit_error"), cell(ours[kind], "agreement"),
                         cell(theirs.get(kind), "agreement"), cell(ours[kind], "first_difference"),
                         cell(theirs.get(kind), "first_difference")])
    header = ["fixture", "weights", "new tokens", "logit error kvattn", "logit error transformers",
              "agreement kvattn", "agreement transformers", "first difference kvattn",
              "first difference transformers"]
    return "\n".join(table(header, rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quant_accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--torch-python", help="the Python that runs transformers (default: this one)")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--out-dir", default="bench-results")
    args = parser.parse_args(argv)
    results = measure(args.torch_python, args.torch_threads)
    write(args.out_dir, "quant_accuracy", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
