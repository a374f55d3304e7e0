"""Greedy decoding of the committed fixtures past their stored continuations, against transformers.

The fixtures (`tests/fixtures/hf/FAMILY`, made by `tools.make_hf_fixtures`)
store 32 greedy tokens per prompt, which the suite holds kvattn to. This
runs transformers (in `--torch-python`, an interpreter with torch and
transformers) and `kvattn.generation.generate` for `--tokens` new tokens on
the same prompts and prints how far they agree. Dev-only, never in CI.

    python -m tools.long_greedy --torch-python PY [--tokens 64] [FAMILY ...]   # from the repository root
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"

_TRANSFORMERS = r"""
import sys, numpy as np, torch, transformers
path, tokens, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
want = np.load(f"{path}/expected.npz")
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rows = []
for row, length in enumerate(want["lengths"]):  # one prompt at a time: no padding
    ids = torch.tensor(want["prompts"][row, :length][None].astype(np.int64))
    with torch.no_grad():
        made = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    rows.append(made[0, length:].numpy().astype(np.int32))
np.save(out, np.stack(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=["gemma2", "gemma3_text", "phi3"])
    parser.add_argument("--torch-python", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from kvattn import generation, models

    for family in args.families:
        path = FIXTURES / family
        stored = np.load(path / "expected.npz")
        with tempfile.TemporaryDirectory() as directory:
            out = pathlib.Path(directory) / "tokens.npy"
            subprocess.run([args.torch_python, "-c", _TRANSFORMERS, str(path), str(args.tokens), str(out)],
                           check=True)
            theirs = np.load(out)
        model = models.from_pretrained(path, max_len=int(stored["lengths"].max()) + args.tokens,
                                       batch_size=len(stored["lengths"]))
        ours = np.asarray(generation.generate(model, stored["prompts"], args.tokens, lengths=stored["lengths"]).tokens)
        agree = ours == theirs
        first = [int(np.argmin(row)) if not row.all() else args.tokens for row in agree]
        print(f"{family}: {args.tokens} greedy tokens per prompt, agreement {agree.mean():.3f}, equal up to "
              f"{first} (transformers' first {stored['greedy'].shape[1]} equal to the fixture's: "
              f"{bool((theirs[:, : stored['greedy'].shape[1]] == stored['greedy']).all())})", file=sys.stdout)


if __name__ == "__main__":
    main()
