"""Makes tests/fixtures/sampling/processors.npz: transformers' own logits processors on random logits and histories.

Dev-only: needs torch and transformers. The output is committed, so the test
suite (tests/generation/test_adjust.py) needs neither. Run from the
repository root:

    python tools/make_sampling_fixture.py

Each case is a batch of random logits `(B, V)`, each row with a prompt and
the tokens generated so far, put through transformers' processors in the
order `generate` applies them: `SequenceBiasLogitsProcessor` (OpenAI's
`logit_bias`, one-token sequences), `RepetitionPenaltyLogitsProcessor`,
`MinNewTokensLengthLogitsProcessor`, then `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper`. Every row of
a case shares its settings (transformers takes one per batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.generation import logits_process as lp

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sampling"
ROWS, VOCAB, PROMPT, GENERATED = 3, 50, 7, 5
CASES = [  # repetition, logit_bias, min_tokens, temperature, top_k, top_p, min_p
    dict(repetition=1.3, bias={}, min_tokens=0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(repetition=0.7, bias={3: 2.5, 11: -100.0}, min_tokens=0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(repetition=1.0, bias={}, min_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(repetition=1.0, bias={}, min_tokens=0, temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
    dict(repetition=1.0, bias={}, min_tokens=0, temperature=1.3, top_k=20, top_p=0.8, min_p=0.05),
    dict(repetition=1.8, bias={0: 5.0, 7: -3.0, 49: 1.0}, min_tokens=6, temperature=0.9, top_k=12, top_p=0.9,
         min_p=0.2),
]
EOS = (1, 4)


def processors(case: dict) -> lp.LogitsProcessorList:
    chain = []
    if case["bias"]:
        chain.append(lp.SequenceBiasLogitsProcessor({(i,): b for i, b in case["bias"].items()}))
    if case["repetition"] != 1.0:
        chain.append(lp.RepetitionPenaltyLogitsProcessor(case["repetition"]))
    if case["min_tokens"]:
        chain.append(lp.MinNewTokensLengthLogitsProcessor(PROMPT, case["min_tokens"], list(EOS)))
    chain.append(lp.TemperatureLogitsWarper(case["temperature"]))
    if case["top_k"]:
        chain.append(lp.TopKLogitsWarper(case["top_k"]))
    if case["top_p"] < 1.0:
        chain.append(lp.TopPLogitsWarper(case["top_p"]))
    if case["min_p"]:
        chain.append(lp.MinPLogitsWarper(case["min_p"]))
    return lp.LogitsProcessorList(chain)


def main():
    rng = np.random.default_rng(0)
    arrays = {}
    for number, case in enumerate(CASES):
        logits = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
        history = rng.integers(0, 12, (ROWS, PROMPT + GENERATED))  # small ids: repeats are common
        out = processors(case)(torch.from_numpy(history), torch.from_numpy(logits.copy()))
        arrays |= {f"{number}/logits": logits, f"{number}/history": history, f"{number}/expected": out.numpy()}
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "processors.npz", **arrays)
    (OUT / "processors.json").write_text(json.dumps({
        "cases": [{**c, "bias": {str(k): v for k, v in c["bias"].items()}} for c in CASES],
        "prompt_tokens": PROMPT, "eos_token_ids": list(EOS),
        "made_with": {"transformers": transformers.__version__, "torch": torch.__version__}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
