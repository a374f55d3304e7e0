"""What structured outputs cost in the serving engine's decode step: a GPT-2-125M-sized model, batch 8, on CPU.

Usage, from the repository root:

    .venv/bin/python benchmarks/results-2026-12-03-grammar/mask_cost.py [--rounds 5] [--steps 40] [--json PATH]

The model: GPT-2 125M's shape (vocab 50,257, hidden 768, 12 layers, 12 heads), random weights, float32, paged
(page size 16), served by `kvattn.serving.Server`s with batch size 8. The tokenizer: the first 50,257 entries of
the 150,000-token byte-level BPE that `grammar_engines.py` trains (the 256-byte alphabet, `<|endoftext|>` = id 0 = EOS,
and the first merges), cut as that script cuts its 32k one, cached next to it in /tmp/kvattn-grammar-tokenizers.

Three contenders, each 8 requests of 16-token random prompts, greedy, `max_tokens` 64, `ignore_eos`:
  * plain: no adjustments (the server passes its cached neutral device arrays);
  * penalties: `presence_penalty=0.5` on every request (dense host adjustment arrays, no grammar);
  * structured: every request under SCHEMA (an object holding an array of 50 small objects, so no output can be
    complete within 64 tokens; the random model picks whatever the mask allows).

Each contender has its own `Server` on the same model (the weights and the compiled programs are shared; each has
its own page pools). Per round every server gets its 8 requests and steps once (admission, the 8 prefills and the
first decode, untimed); then, `--steps` times, each server runs one pure decode step of its 8 rows, the contenders
taking turns step by step in an order rotated every step (the machine is shared: its load moves within seconds);
then the requests are aborted. One warm-up round (after each server's `warm_up()`) is not counted. Per step the
script also times, with wrappers installed on the instances and classes (nothing in src/ is changed):
  * adjustments: `Server._adjustments` (host: the three dense (8, V) arrays made neutral, then each row's fill);
  * fill: `Adjuster.fill` summed over the rows; within it, `mask`: each matcher's `forbid` (llguidance's bitmask
    fill, `fill_bitmask`, plus its expansion into the row's -inf), the rest being the penalty rows;
  * device: `Runner.decode` (the compiled call, including the host-to-device copy of the adjustment arrays
    and waiting for the result);
  * accept: `Adjuster.accept` summed over the rows (the grammar's `advance`: validate + consume the token);
  * host: the step less its device call (scheduling, adjustments, appending the tokens);
  * paired: each step over the plain step of the same turn (taken just before or after it), median of those.
Figures are medians over every timed step of every counted round (`host` and `adjust+accept` are per-step sums, then
the median); the load average is read before and after. Step ratios to plain are ratios of medians; since the device
call's time moves with the machine's load far more than the host work does, the host columns are the steadier
measure of what the mask costs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from importlib.metadata import version

import numpy as np

TOKENIZER_DIR = pathlib.Path("/tmp/kvattn-grammar-tokenizers")
SOURCE_TOKENIZER = TOKENIZER_DIR / "bytelevel-bpe-150000.json"
VOCAB_SIZE = 50_257
EOS = "<|endoftext|>"

BATCH = 8
PROMPT_LEN = 16
MAX_TOKENS = 64
PAGE_SIZE = 16
GPT2_125M = {"model_type": "gpt2", "vocab_size": VOCAB_SIZE, "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
             "tie_word_embeddings": True}

SCHEMA = {
    "type": "object",
    "properties": {
        "order": {"type": "string", "maxLength": 12},
        "lines": {
            "type": "array",
            "minItems": 50,
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "note": {"type": "string", "maxLength": 16},
                },
                "required": ["sku", "qty", "note"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order", "lines"],
    "additionalProperties": False,
}
CONTENDERS = ("plain", "penalties", "structured")
PARTS = ("adjustments", "fill", "mask", "fill_bitmask", "device", "accept")


# --- tokenizer and model -------------------------------------------------------------------------------------------


def tokenizer_json() -> str:
    """The 50,257-token byte-level BPE: the 150k one's first entries and the merges among them (cached)."""
    path = TOKENIZER_DIR / f"bytelevel-bpe-{VOCAB_SIZE}.json"
    if not path.exists():
        if not SOURCE_TOKENIZER.exists():
            sys.exit(f"{SOURCE_TOKENIZER} is missing: run grammar_engines.py once to train it")
        full = json.loads(SOURCE_TOKENIZER.read_text())
        n_base = len(full["model"]["vocab"]) - len(full["model"]["merges"])  # special token + byte alphabet
        full["model"]["vocab"] = {t: i for t, i in full["model"]["vocab"].items() if i < VOCAB_SIZE}
        full["model"]["merges"] = full["model"]["merges"][: VOCAB_SIZE - n_base]
        path.write_text(json.dumps(full, ensure_ascii=False))
    return path.read_text()


def build_servers() -> dict:
    """A server per contender, all on one model: they share its weights and (equal shapes) its compiled programs."""
    from flax import nnx

    from kvattn.models import CausalLM, from_hf_config
    from kvattn.serving import Server

    max_len = PROMPT_LEN + MAX_TOKENS
    pages_per_seq = -(-max_len // PAGE_SIZE)
    model = CausalLM(from_hf_config(GPT2_125M), max_len=max_len, batch_size=BATCH,
                     num_pages=1 + BATCH * pages_per_seq, page_size=PAGE_SIZE, rngs=nnx.Rngs(0))
    servers = {c: Server(model, chunk=PAGE_SIZE, prefix_caching=False) for c in CONTENDERS}
    for server in servers.values():
        server.warm_up()
    return servers


# --- timing wrappers ------------------------------------------------------------------------------------------------


class Clock:
    """Seconds spent in each wrapped function during the current step (reset before each step)."""

    def __init__(self):
        self.spent = collections.defaultdict(float)

    def wrap(self, owner, name: str, part: str):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(servers, clock: Clock) -> None:
    import llguidance.numpy

    from kvattn.generation.adjust import Adjuster

    for server in servers:
        clock.wrap(server, "_adjustments", "adjustments")  # bound methods, on the instances
        clock.wrap(server.runner, "decode", "device")
    clock.wrap(Adjuster, "fill", "fill")
    clock.wrap(Adjuster, "accept", "accept")
    clock.wrap(llguidance.numpy, "fill_next_token_bitmask", "fill_bitmask")  # looked up at call time by forbid()


# --- one round of one contender -------------------------------------------------------------------------------------


def requests(contender: str, rng, grammar):
    from kvattn import SamplingParams
    from kvattn import StructuredOutputs

    settings = {"max_tokens": MAX_TOKENS, "ignore_eos": True}  # greedy by default
    if contender == "penalties":
        settings["presence_penalty"] = 0.5
    if contender == "structured":
        settings["structured_outputs"] = StructuredOutputs(json=SCHEMA)
    params = SamplingParams(**settings)
    return [(rng.integers(1, VOCAB_SIZE, PROMPT_LEN).tolist(), params,
             grammar if contender == "structured" else None) for _ in range(BATCH)]


def run_round(servers: dict, clock: Clock, rng, grammar, steps: int) -> dict:
    """One round: 8 requests on each contender's server, then `steps` timed decode steps each, interleaved."""
    indices = {}
    for contender, server in servers.items():
        indices[contender] = [server.submit(prompt, params, grammar=factory) for prompt, params, factory in
                              requests(contender, rng, grammar)]
        server.step()  # admission, the 8 prefills and the first decode
        assert len(server.scheduler.decoding()) == BATCH, "every request should be decoding after one step"
    rows = {c: {part: [] for part in ("step", *PARTS)} for c in servers}
    order = list(servers)
    for step in range(steps):
        for contender in order[step % 3:] + order[: step % 3]:
            clock.spent.clear()
            start = time.perf_counter()
            finished = servers[contender].step()
            rows[contender]["step"].append(time.perf_counter() - start)
            assert not finished, "a request ended inside the timed steps"
            for part in PARTS:
                rows[contender][part].append(clock.spent.get(part, 0.0))
    # How many structured matchers are still inside the document (not complete, none refused a token).
    seqs = [r for r in servers["structured"].scheduler.seqs if r is not None]
    inside = sum(not r.halted and 0 not in r.generated for r in seqs)  # id 0: EOS, all a complete grammar allows
    for contender, server in servers.items():
        for index in indices[contender]:
            server.abort(index)
        assert server.idle
    return {"rows": rows, "inside": inside}


def transfer_cost(repeats: int = 30) -> float:
    """Median seconds to copy three neutral (8, V) float32 host arrays to the device (what a step with any
    adjusting request sends, beyond the plain step)."""
    import jax

    from kvattn.generation.sampling import Adjustments

    times = []
    for _ in range(repeats):
        arrays = Adjustments.neutral((BATCH, VOCAB_SIZE))
        start = time.perf_counter()
        jax.block_until_ready([jax.device_put(a) for a in arrays])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def neutral_cost(repeats: int = 30) -> float:
    """Median seconds for `Adjustments.neutral((8, V))`: the host arrays every adjusting step allocates."""
    from kvattn.generation.sampling import Adjustments

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        Adjustments.neutral((BATCH, VOCAB_SIZE))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- main -----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=40, help=f"timed decode steps per contender per round "
                                                               f"(at most {MAX_TOKENS - 2})")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args()
    if not 1 <= args.steps <= MAX_TOKENS - 2:
        parser.error(f"--steps must be within 1..{MAX_TOKENS - 2}")

    import jax
    import tokenizers

    from kvattn import StructuredOutputs
    from kvattn.serving.structured import Grammars
    from kvattn.serving.tokenizer import Tokenizer

    load_before = os.getloadavg()
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json()), eos_token=EOS)
    assert tokenizer.vocab_size == VOCAB_SIZE, tokenizer.vocab_size
    grammars = Grammars(tokenizer)
    compiled = grammars.compile(StructuredOutputs(json=SCHEMA))

    start = time.perf_counter()
    servers = build_servers()
    print(f"model built and compiled in {time.perf_counter() - start:.1f} s", flush=True)
    clock = Clock()
    instrument(servers.values(), clock)

    def grammar():  # each request's matcher, its mask timed
        matcher = compiled()
        clock.wrap(matcher, "forbid", "mask")
        return matcher

    rng = np.random.default_rng(0)
    results = {c: collections.defaultdict(list) for c in CONTENDERS}
    inside = []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        out = run_round(servers, clock, rng, grammar, args.steps)
        if round_:
            inside.append(out["inside"])
            for contender, rows in out["rows"].items():
                for part, values in rows.items():
                    results[contender][part] += values
                results[contender]["host"] += [s - d for s, d in zip(rows["step"], rows["device"])]
                results[contender]["adjust+accept"] += [a + b for a, b in zip(rows["adjustments"], rows["accept"])]
                # Over the plain step of the same turn, taken just before or after it: steadier under a moving load.
                results[contender]["paired_ratio"] += [a / b for a, b in zip(rows["step"], out["rows"]["plain"]["step"])]
        label = f"round {round_}/{args.rounds}" if round_ else "warm-up round"
        print(f"{label}: load {os.getloadavg()[0]:.2f}; median step " + ", ".join(
            f"{c} {1e3 * statistics.median(out['rows'][c]['step']):.1f} ms" for c in CONTENDERS), flush=True)
    load_after = os.getloadavg()

    median_ms = {c: {part: 1e3 * statistics.median(values) for part, values in results[c].items()
                     if part != "paired_ratio"} for c in CONTENDERS}
    paired = {c: statistics.median(results[c]["paired_ratio"]) for c in CONTENDERS}
    plain = median_ms["plain"]["step"]
    summary = {
        "model": {"family": "gpt2", "vocab_size": VOCAB_SIZE, "hidden": 768, "layers": 12, "heads": 12,
                  "dtype": "float32", "weights": "random", "page_size": PAGE_SIZE},
        "batch": BATCH, "prompt_len": PROMPT_LEN, "max_tokens": MAX_TOKENS, "rounds": args.rounds,
        "steps_per_round": args.steps, "schema": SCHEMA,
        "median_ms": median_ms,
        "ratio_to_plain": {c: median_ms[c]["step"] / plain for c in CONTENDERS},
        "paired_ratio_to_plain": paired,
        "structured_requests_inside_grammar_at_end": inside,
        "neutral_arrays_ms": 1e3 * neutral_cost(),
        "device_put_adjustments_ms": 1e3 * transfer_cost(),
        "load_before": load_before, "load_after": load_after,
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__,
                     "llguidance": version("llguidance"), "tokenizers": tokenizers.__version__},
        "cpus": os.cpu_count(),
    }
    print()
    print("| contender | step | x plain | x plain, paired | device call | host (step - device) | _adjustments | fill (8 rows) "
          "| mask (forbid) | llguidance bitmask | accept (8 rows) | adjust+accept / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in CONTENDERS:
        m = median_ms[c]
        print(f"| {c} | {m['step']:.2f} | {m['step'] / plain:.3f} | {paired[c]:.3f} | {m['device']:.2f} | {m['host']:.2f} | "
              f"{m['adjustments']:.2f} | {m['fill']:.2f} | {m['mask']:.2f} | {m['fill_bitmask']:.2f} | "
              f"{m['accept']:.2f} | {100 * m['adjust+accept'] / m['step']:.1f}% |")
    print(f"\nneutral (8, V) host arrays: {summary['neutral_arrays_ms']:.2f} ms; device_put of them: "
          f"{summary['device_put_adjustments_ms']:.2f} ms")
    print(f"structured requests still inside the grammar after the timed steps: {inside} (of {BATCH})")
    print(f"load average before {load_before}, after {load_after}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
