"""`python -m benchmarks.speculative`: speculative decoding against plain decoding and transformers' assisted generation.

One run writes the random Llama-shaped checkpoint of `benchmarks.model`
(about 125M parameters, float32) and a draft of the same family made of its
embedding, output head and first two layers, then decodes two workloads at
each batch size:

  copy-heavy  each prompt is a random start followed by the model's own
              greedy continuation of it (`prompt_len` tokens in all); the
              output is the next `new_tokens` tokens of that continuation.
              A random model settles into loops of a few tokens, so the
              output repeats spans of its prompt: drafts are kept because
              the target really produces them, for every contender alike.
  random      prompts of random tokens of the same length.

Contenders, one after another in every repeat:

  kvattn_plain          `kvattn.generation.generate`
  kvattn_prompt_lookup  `generate(..., speculative=PromptLookup(num_tokens))`
  kvattn_draft_model    `generate(..., speculative=DraftModel(draft, draft_tokens))`
  transformers_plain    transformers' `generate` (torch, CPU), greedy
  transformers_prompt_lookup
                        `prompt_lookup_num_tokens=num_tokens` (batch 1 only)
  transformers_assistant
                        `assistant_model=` the same draft weights,
                        `num_assistant_tokens=draft_tokens` (batch 1 only)

transformers runs in a subprocess of `torch_python` (torch is not a kvattn
dependency); a contender it cannot run is reported as unavailable.

Decode time per token is `(t(new_tokens) - t(1)) / (new_tokens - 1)`, `t(n)`
the median over `repeats` of one greedy generation of n tokens from empty
caches, timed with `block_until_ready` after an untimed warm-up (compilation
excluded; the count of compilations while timed is reported). Tokens per
second count every sequence of the batch. Every contender's tokens are
compared with kvattn_plain's ("agreement": the share of positions equal up
to each sequence's first difference; greedy speculative decoding must give
1.0). For kvattn's speculative contenders the run also reports the share of
drafts kept and the rounds and plain steps taken, and, per batch size, what
one verify call (a `prefill` of num_tokens + 1 tokens, rolled back with
`truncate`) and one step of the draft cost relative to one step of the
target, each timed in a compiled loop of calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.model import LLAMA_125M, QUICK_MODEL, greedy_agreement, write_llama_checkpoint
from benchmarks import torch_worker
from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import finished_rows, table, target, write
from benchmarks.timing import time_calls

__all__ = [
    "SPECULATIVE_DEFAULTS", "measure_server", "measure_speculative", "run_server", "run_speculative",
    "write_draft_checkpoint",
]

SPECULATIVE_DEFAULTS = {"batch_sizes": (1, 8), "start_len": 32, "prompt_len": 288, "new_tokens": 128,
                        "num_tokens": 4, "draft_tokens": 4, "draft_layers": 2, "repeats": 3}
QUICK = {"batch_sizes": (1, 2), "start_len": 4, "prompt_len": 24, "new_tokens": 12, "num_tokens": 4,
         "draft_tokens": 2, "draft_layers": 1, "repeats": 1}
KVATTN = ("kvattn_plain", "kvattn_prompt_lookup", "kvattn_draft_model")
TRANSFORMERS = ("transformers_plain", "transformers_prompt_lookup", "transformers_assistant")
WORKLOADS = ("copy-heavy", "random")


def write_draft_checkpoint(checkpoint: str | os.PathLike, directory: str | os.PathLike, num_layers: int) -> Path:
    """A draft of `checkpoint`: its embedding, final norm, output head and first `num_layers` layers.

    Returns:
      The directory, holding `config.json` and `model.safetensors`.
    """
    import safetensors.numpy

    checkpoint, directory = Path(checkpoint), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = safetensors.numpy.load_file(checkpoint / "model.safetensors")
    kept = {name: array for name, array in tensors.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2) + "\n")
    safetensors.numpy.save_file(kept, directory / "model.safetensors")
    return directory


def _workloads(model, batch: int, start_len: int, prompt_len: int, seed: int) -> dict[str, np.ndarray]:
    """The prompts of each workload at this batch size (see the module docstring)."""
    from kvattn import generation

    rng = np.random.default_rng(seed + batch)
    start = rng.integers(0, model.config.vocab_size, (batch, start_len))
    model.reset()
    continuation = np.asarray(generation.generate(model, start, prompt_len - start_len).tokens)
    model.reset()
    return {
        "copy-heavy": np.concatenate([start, continuation], axis=1).astype(np.int32),
        "random": rng.integers(0, model.config.vocab_size, (batch, prompt_len)).astype(np.int32),
    }


def _kvattn_calls(model, draft, sizes):
    """Each kvattn contender as `call(prompts, n)`, emptying every cache first (untimed) and returning the result."""
    from kvattn import generation

    lookup = generation.PromptLookup(num_tokens=sizes["num_tokens"])
    drafted = generation.DraftModel(draft, num_tokens=sizes["draft_tokens"])
    return {
        "kvattn_plain": lambda prompts, n: generation.generate(model, prompts, n),
        "kvattn_prompt_lookup": lambda prompts, n: generation.speculate(model, prompts, n, speculative=lookup),
        "kvattn_draft_model": lambda prompts, n: generation.speculate(model, prompts, n, speculative=drafted),
    }


_COMPILATIONS = [0]


def _count_compilation(event: str, _duration: float, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILATIONS[0] += 1


def _programs() -> int:
    """XLA compilations so far in this process (any new one while timed is a recompilation)."""
    import jax

    if not _COMPILATIONS[0] and _count_compilation not in _LISTENING:
        jax.monitoring.register_event_duration_secs_listener(_count_compilation)
        _LISTENING.append(_count_compilation)
    return _COMPILATIONS[0]


_LISTENING: list = []


def _time_kvattn(model, draft, prompts: np.ndarray, sizes: dict, repeats: int) -> dict[str, dict[str, Any]]:
    """Every kvattn contender timed at 1 and `new_tokens` tokens, one after another in each repeat."""
    import jax

    calls = _kvattn_calls(model, draft, sizes)
    new_tokens = sizes["new_tokens"]

    def empty():
        model.reset()
        draft.reset()
        jax.block_until_ready((model.pos, draft.pos))

    def once(name, count):
        timing = time_calls(lambda _: calls[name](prompts, count), 1, prepare=empty, warm_ups=0)
        return timing.ms[0], timing.last_output

    for name in calls:  # compile every program, untimed
        once(name, 1), once(name, new_tokens)
    compiled = _programs()
    firsts, wholes, outputs = {name: [] for name in calls}, {name: [] for name in calls}, {}
    for _ in range(repeats):
        for name in calls:
            firsts[name].append(once(name, 1)[0])
            elapsed, outputs[name] = once(name, new_tokens)
            wholes[name].append(elapsed)
    recompiled = _programs() - compiled
    rows = {}
    for name in calls:
        first, whole = statistics.median(firsts[name]), statistics.median(wholes[name])
        out = outputs[name]
        row = {"first_token_ms": first, "whole_ms": whole, "decode_ms_per_token": (whole - first) / (new_tokens - 1),
               "compiles_while_timed": recompiled, "tokens": np.asarray(out.tokens).tolist()}
        if hasattr(out, "acceptance"):
            drafted = int(np.sum(out.drafted))
            row.update(acceptance=out.acceptance if drafted else None, rounds=int(out.rounds), steps=int(out.steps),
                       drafted=drafted, accepted=int(np.sum(out.accepted)))
        rows[name] = row
    return rows


def _call_costs(model, draft, prompt_len: int, num_tokens: int, repeats: int, burst: int = 16) -> dict[str, float]:
    """What one verify call and one draft step cost, in steps of the target.

    Each call runs `burst` times in a compiled loop, every output summed so
    none is optimised away; the loops take turns in each repeat, and the
    ratios are medians over the repeats (the machine's load drifts).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def loop(module, call):
        graphdef, params, cache = nnx.split(module, nnx.Param, nnx.Cache)

        @jax.jit
        def run(params, cache):
            def body(_, carry):
                cache, total = carry
                held = nnx.merge(graphdef, params, cache)
                total = total + jnp.sum(call(held))
                return nnx.state(held, nnx.Cache), total

            return jax.lax.fori_loop(0, burst, body, (cache, jnp.float32(0)))

        jax.block_until_ready(run(params, cache))  # compiled, untimed
        return lambda: run(params, cache)

    batch = model.blocks[0].attention.config.batch_size
    tokens = jnp.zeros((batch,), jnp.int32)
    chunk = jnp.zeros((batch, num_tokens + 1), jnp.int32)

    def verify(held):
        start = held.pos
        logits = held.prefill(chunk)
        held.truncate(start + 1)
        return logits

    for module in (model, draft):
        module.reset()
        module.prefill(jnp.zeros((batch, prompt_len), jnp.int32))
    loops = {"step": loop(model, lambda held: held.step(tokens)), "verify": loop(model, verify),
             "draft_step": loop(draft, lambda held: held.step(tokens))}
    times = {name: [] for name in loops}
    for _ in range(repeats):
        for name, run in loops.items():
            times[name].append(time_calls(lambda _, run=run: run(), 1, warm_ups=0).ms[0] / burst)
    model.reset()
    draft.reset()
    return {
        "step_ms": statistics.median(times["step"]),
        "verify_over_step": statistics.median(v / s for v, s in zip(times["verify"], times["step"])),
        "draft_step_over_step": statistics.median(d / s for d, s in zip(times["draft_step"], times["step"])),
    }


_TRANSFORMERS_SCRIPT = r"""
import statistics, time
load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
model, draft = load(args["checkpoint"]), load(args["draft"])
draft.generation_config.num_assistant_tokens = args["draft_tokens"]
options = {
    "transformers_plain": {},
    "transformers_prompt_lookup": {"prompt_lookup_num_tokens": args["num_tokens"]},
    "transformers_assistant": {"assistant_model": draft},
}
out = {"torch": torch.__version__, "transformers": transformers.__version__, "rows": {}}
for workload, prompts in args["workloads"].items():
    prompts = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(prompts)
    def once(name, count):
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = model.generate(prompts, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                                    do_sample=False, pad_token_id=0, **options[name])
        return time.perf_counter() - start, tokens
    names = [n for n in options if n == "transformers_plain" or prompts.shape[0] == 1]
    for name in options:
        if name not in names:
            out["rows"][f"{workload}/{name}"] = {"unavailable": "transformers speculates at batch size 1 only"}
    working, firsts, wholes, tokens = [], {}, {}, {}
    for name in names:
        try:
            once(name, 1), once(name, args["new_tokens"])
            working.append(name)
        except Exception as error:
            out["rows"][f"{workload}/{name}"] = {"unavailable": f"{type(error).__name__}: {error}"[:300]}
    for _ in range(args["repeats"]):
        for name in working:
            firsts.setdefault(name, []).append(once(name, 1)[0])
            elapsed, tokens[name] = once(name, args["new_tokens"])
            wholes.setdefault(name, []).append(elapsed)
    for name in working:
        first, whole = statistics.median(firsts[name]), statistics.median(wholes[name])
        out["rows"][f"{workload}/{name}"] = {
            "first_token_ms": 1e3 * first, "whole_ms": 1e3 * whole,
            "decode_ms_per_token": 1e3 * (whole - first) / (args["new_tokens"] - 1),
            "tokens": tokens[name][:, prompts.shape[1]:].tolist(),
        }
print(json.dumps(out))
"""


def _time_transformers(python: str, checkpoint: Path, draft: Path, workloads: dict, sizes: dict, repeats: int,
                       threads: int) -> dict[str, Any]:
    """transformers' contenders on every workload, run by `python` in a subprocess; rows or `unavailable`."""
    args = {"checkpoint": str(checkpoint), "draft": str(draft), "threads": threads, "repeats": repeats,
            "new_tokens": sizes["new_tokens"], "num_tokens": sizes["num_tokens"], "draft_tokens": sizes["draft_tokens"],
            "workloads": {name: prompts.tolist() for name, prompts in workloads.items()}}
    return torch_worker.run(python, _TRANSFORMERS_SCRIPT, args, ("torch", "transformers"))


def measure_speculative(*, checkpoint: Path, draft_checkpoint: Path, sizes: dict, torch_python: str,
                        torch_threads: int, seed: int = 0, progress=None) -> dict[str, Any]:
    """Every row, the call costs and the targets (see the module docstring); `progress(text)` as it goes."""
    from kvattn import models

    rows, costs, notes = [], [], []
    for batch in sizes["batch_sizes"]:
        max_len = sizes["prompt_len"] + sizes["new_tokens"]
        model = models.from_pretrained(checkpoint, max_len=max_len, batch_size=batch)
        draft = models.from_pretrained(draft_checkpoint, max_len=max_len, batch_size=batch)
        workloads = _workloads(model, batch, sizes["start_len"], sizes["prompt_len"], seed)
        costs.append(dict(batch_size=batch, num_tokens=sizes["num_tokens"],
                          **_call_costs(model, draft, sizes["prompt_len"], sizes["num_tokens"], 2 * sizes["repeats"] + 1)))
        for workload, prompts in workloads.items():
            ours = _time_kvattn(model, draft, prompts, sizes, sizes["repeats"])
            rows += [dict(workload=workload, batch_size=batch, contender=name, **row) for name, row in ours.items()]
            if progress:
                progress(f"kvattn, {workload}, B={batch}")
        theirs = _time_transformers(torch_python, checkpoint, draft_checkpoint, workloads, sizes, sizes["repeats"],
                                    torch_threads)
        for workload in workloads:
            for name in TRANSFORMERS:
                row = theirs.get("rows", {}).get(f"{workload}/{name}", {"unavailable": theirs.get("unavailable")})
                rows.append(dict(workload=workload, batch_size=batch, contender=name, **row))
        if "torch" in theirs:
            notes.append(f"torch {theirs['torch']}, transformers {theirs['transformers']}")
        if progress:
            progress(f"transformers, B={batch}")
    for row in rows:
        if "tokens" in row:
            (reference,) = [r for r in rows if (r["workload"], r["batch_size"], r["contender"])
                            == (row["workload"], row["batch_size"], "kvattn_plain")]
            row["agreement"] = greedy_agreement(row["tokens"], reference["tokens"])
    return {"rows": finished_rows(rows), "call_costs": costs, "targets": _targets(rows), "notes": sorted(set(notes))}


def _targets(rows) -> list[dict[str, Any]]:
    """Issue #22's targets: speed-ups of decode time per token, measured side by side; greedy agreement; no recompiles."""

    def ms(workload, batch, contender):
        for row in rows:
            if (row["workload"], row["batch_size"], row["contender"]) == (workload, batch, contender):
                return row.get("decode_ms_per_token")
        return None

    def speedup(workload, batch, ours, theirs):
        mine, other = ms(workload, batch, ours), ms(workload, batch, theirs)
        return None if mine is None or other is None else other / mine

    batches = sorted({row["batch_size"] for row in rows})
    smallest, largest = batches[0], batches[-1]
    lookup, draft = KVATTN[1], KVATTN[2]
    targets = [
        target("prompt lookup over kvattn plain, copy-heavy", speedup("copy-heavy", smallest, lookup, KVATTN[0]),
               ">=", 2.0, batch_size=smallest),
        target("prompt lookup over transformers' prompt lookup, copy-heavy",
               speedup("copy-heavy", smallest, lookup, TRANSFORMERS[1]), ">=", 1.3, batch_size=smallest),
        target("prompt lookup over kvattn plain, copy-heavy", speedup("copy-heavy", largest, lookup, KVATTN[0]),
               ">=", 1.3, batch_size=largest),
    ]
    for batch in batches:
        targets += [target(f"{label} over kvattn plain, random", speedup("random", batch, name, KVATTN[0]), ">=", 0.9,
                           batch_size=batch) for name, label in ((lookup, "prompt lookup"), (draft, "draft model"))]
        targets.append(target("draft model over kvattn plain, copy-heavy", speedup("copy-heavy", batch, draft, KVATTN[0]),
                              ">=", None, batch_size=batch))
    targets.append(target("draft model over transformers' assistant, copy-heavy",
                          speedup("copy-heavy", smallest, draft, TRANSFORMERS[2]), ">=", None, batch_size=smallest))
    agreements = [row["agreement"] for row in rows if "agreement" in row]
    targets.append(target("greedy agreement with kvattn plain, every contender", min(agreements, default=None), ">=",
                          1.0))
    compiles = [row["compiles_while_timed"] for row in rows if "compiles_while_timed" in row]
    targets.append(target("kvattn compilations while timed", max(compiles, default=None), "<=", 0))
    return targets


def speculative_markdown(result: dict[str, Any]) -> str:
    """The run's contenders, call costs and targets."""
    sizes = result["config"]
    body = []
    for row in result["rows"]:
        base = [row["workload"], row["batch_size"], row["contender"]]
        if "decode_ms_per_token" not in row:
            body.append([*base, f"unavailable: {row.get('unavailable')}", "", "", "", "", ""])
            continue
        kept = "" if row.get("acceptance") is None else f"{row['acceptance']:.0%}"
        calls = f"{row['rounds']} + {row['steps']}" if "rounds" in row else ""
        body.append([*base, f"{row['decode_ms_per_token']:.2f}", f"{row['tokens_per_s']:.1f}",
                     f"{row['whole_ms']:.0f}", kept, calls, f"{row['agreement']:.2f}"])
    header = ["workload", "B", "contender", "decode ms/token", "tokens/s", "whole ms", "drafts kept",
              "rounds + steps", "agreement"]
    lines = [
        (f"Random Llama, {sizes['model']['num_layers']} layers (about 125M parameters at the defaults), float32; "
         f"draft: its first {sizes['draft_layers']} layers. Prompts of {sizes['prompt_len']} tokens, "
         f"{sizes['new_tokens']} new; prompt lookup drafts {sizes['num_tokens']}, the draft model "
         f"{sizes['draft_tokens']} (kvattn adapts it); medians of {sizes['repeats']} repeats."),
        "",
        *table(header, body),
        "",
        *table(["B", "step ms", "verify call / step", "draft step / step"],
               [[c["batch_size"], f"{c['step_ms']:.1f}", f"{c['verify_over_step']:.2f}",
                 f"{c['draft_step_over_step']:.2f}"] for c in result["call_costs"]]),
        "",
        *table(["target", "B", "value", "goal", "verdict"], [
            [t["name"], t.get("batch_size", ""), "n/a" if t["value"] is None else f"{t['value']:.3g}",
             "report" if t["threshold"] is None else f"{t['compare']} {t['threshold']:g}",
             "—" if t["met"] is None else ("met" if t["met"] else "**missed**")] for t in result["targets"]
        ]),
    ]
    if result["notes"]:
        lines += ["", "; ".join(result["notes"])]
    return "\n".join(lines) + "\n"


def run_speculative(*, out_dir: str | os.PathLike = "bench-results", checkpoint_dir: str | os.PathLike | None = None,
                    quick: bool = False, torch_python: str | None = None, torch_threads: int = 2,
                    **overrides) -> dict[str, Any]:
    """Writes the checkpoints, measures, writes `speculative.json` and `speculative.md` under `out_dir`.

    Args:
      out_dir: where the results go.
      checkpoint_dir: where the target and draft checkpoints go (default:
        `out_dir`/checkpoint and `out_dir`/draft).
      quick: tiny sizes (a smoke test).
      torch_python: the interpreter that runs transformers (default: this one).
      torch_threads: `torch.set_num_threads` for transformers.
      **overrides: any of `SPECULATIVE_DEFAULTS` (batch_sizes, start_len,
        prompt_len, new_tokens, num_tokens, draft_tokens, draft_layers, repeats).

    Returns:
      The results, as written to `speculative.json`.
    """
    sizes = dict(QUICK if quick else SPECULATIVE_DEFAULTS)
    unknown = set(overrides) - set(sizes)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; expected some of {sorted(sizes)}")
    sizes.update({name: value for name, value in overrides.items() if value is not None})
    if sizes["new_tokens"] < 2 or not 0 < sizes["start_len"] < sizes["prompt_len"]:
        raise ValueError(f"need new_tokens >= 2 and 0 < start_len < prompt_len, got {sizes}")
    model_sizes = dict(QUICK_MODEL if quick else LLAMA_125M)
    out = Path(out_dir)
    where = Path(checkpoint_dir) if checkpoint_dir is not None else out
    checkpoint = write_llama_checkpoint(where / "checkpoint", max_position_embeddings=sizes["prompt_len"]
                                        + sizes["new_tokens"], **model_sizes)
    draft = write_draft_checkpoint(checkpoint, where / "draft", sizes["draft_layers"])
    started, load = time.perf_counter(), load_average()
    measured = measure_speculative(checkpoint=checkpoint, draft_checkpoint=draft, sizes=sizes,
                                   torch_python=torch_python or sys.executable, torch_threads=torch_threads,
                                   progress=lambda text: print(f"measured {text}", file=sys.stderr, flush=True))
    result = {
        "config": dict(sizes, batch_sizes=list(sizes["batch_sizes"]), model=model_sizes, torch_threads=torch_threads),
        "machine": machine_info(), "versions": versions(), "source": source_revision(),
        "load_average": {"before": load, "after": load_average()}, **measured,
        "elapsed_s": time.perf_counter() - started,
    }
    write(out, "speculative", result, speculative_markdown(result))
    return result


def measure_server(checkpoint, sizes: dict, batch: int, repeats: int, page_size: int = 16) -> dict[str, Any]:
    """`kvattn.serving.Server` with and without prompt lookup: `batch` requests of each workload, run to the end.

    Each server is warmed up (every program compiled) before the timed runs; a run submits the workload's
    requests and times `Server.run()` to the last token (prefill included, the same for both), prefix caching
    off so that repeats do not hit it. Every request's tokens are compared with the plain server's.
    """
    from kvattn import SamplingParams, generation, models
    from kvattn.serving import Server

    max_len = sizes["prompt_len"] + sizes["new_tokens"]
    pages = batch * -(-max_len // page_size) + 1
    model = models.from_pretrained(checkpoint, max_len=max_len, batch_size=batch, num_pages=pages,
                                   page_size=page_size)
    reference = models.from_pretrained(checkpoint, max_len=max_len, batch_size=batch)
    workloads = _workloads(reference, batch, sizes["start_len"], sizes["prompt_len"], seed=0)
    del reference
    servers = {"server_plain": Server(model, chunk=4 * page_size, prefix_caching=False),
               "server_prompt_lookup": Server(model, chunk=4 * page_size, prefix_caching=False,
                                              speculative=generation.PromptLookup(num_tokens=sizes["num_tokens"]))}
    for server in servers.values():
        server.warm_up()
    compiled, rows = _programs(), []
    for workload, prompts in workloads.items():
        seconds, tokens, stats = {name: [] for name in servers}, {}, {}
        for attempt in range(repeats + 1):  # the first run untimed
            for name, server in servers.items():
                before = server.stats
                for prompt in prompts:
                    server.submit(prompt, SamplingParams(max_tokens=sizes["new_tokens"]))
                started = time.perf_counter()
                done = server.run()
                if attempt:
                    seconds[name].append(time.perf_counter() - started)
                tokens[name] = [c.tokens for c in done]
                after = server.stats
                stats[name] = (after.drafted_tokens - before.drafted_tokens, after.accepted_tokens - before.accepted_tokens)
        for name in servers:
            whole = statistics.median(seconds[name])
            drafted, accepted = stats[name]
            rows.append({"workload": workload, "batch_size": batch, "contender": name, "whole_s": whole,
                         "tokens_per_s": batch * sizes["new_tokens"] / whole,
                         "acceptance": accepted / drafted if drafted else None,
                         "agreement": float(tokens[name] == tokens["server_plain"])})
    speedups = {row["workload"]: row["whole_s"] for row in rows if row["contender"] == "server_plain"}
    for row in rows:
        row["speedup_over_plain"] = speedups[row["workload"]] / row["whole_s"]
    return {"rows": rows, "compiles_while_timed": _programs() - compiled}


def server_markdown(result: dict[str, Any]) -> str:
    config = result["config"]
    lines = [f"`Server` on the random Llama, float32, B={config['batch_size']} requests of {config['prompt_len']} "
             f"prompt tokens and {config['new_tokens']} new, greedy; prompt lookup drafts {config['num_tokens']}; "
             f"medians of {config['repeats']} runs; compilations while timed: {result['compiles_while_timed']}.", ""]
    lines += table(["workload", "contender", "whole s", "tokens/s", "speedup", "drafts kept", "same tokens"], [
        [r["workload"], r["contender"], f"{r['whole_s']:.2f}", f"{r['tokens_per_s']:.1f}",
         f"{r['speedup_over_plain']:.2f}", "" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
         "yes" if r["agreement"] == 1.0 else "**no**"] for r in result["rows"]])
    return "\n".join(lines) + "\n"


def run_server(*, out_dir: str | os.PathLike = "bench-results", checkpoint_dir: str | os.PathLike | None = None,
               batch_size: int = 8, quick: bool = False, **overrides) -> dict[str, Any]:
    """`measure_server` on the checkpoint of `run_speculative`; writes `speculative_server.json` and `.md`."""
    sizes = dict(QUICK if quick else SPECULATIVE_DEFAULTS)
    sizes.update({name: value for name, value in overrides.items() if value is not None and name in sizes})
    model_sizes = dict(QUICK_MODEL if quick else LLAMA_125M)
    where = Path(checkpoint_dir) if checkpoint_dir is not None else Path(out_dir)
    checkpoint = write_llama_checkpoint(where / "checkpoint", max_position_embeddings=sizes["prompt_len"]
                                        + sizes["new_tokens"], **model_sizes)
    started, load = time.perf_counter(), load_average()
    measured = measure_server(checkpoint, sizes, batch_size, sizes["repeats"])
    result = {"config": dict(sizes, batch_sizes=list(sizes["batch_sizes"]), batch_size=batch_size, model=model_sizes),
              "machine": machine_info(), "versions": versions(), "source": source_revision(),
              "load_average": {"before": load, "after": load_average()}, **measured,
              "elapsed_s": time.perf_counter() - started}
    write(out_dir, "speculative_server", result, server_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    for name in ("start-len", "prompt-len", "new-tokens", "num-tokens", "draft-tokens", "draft-layers", "repeats"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--out-dir", default="bench-results", help="where speculative.json and speculative.md go")
    parser.add_argument("--checkpoint-dir", help="where the checkpoints go (default: the out dir)")
    parser.add_argument("--torch-python", help="the Python that runs transformers (default: this one)")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--server", action="store_true", help="instead, time kvattn.serving.Server with and "
                        "without prompt lookup at the largest batch size (writes speculative_server.json and .md)")
    args = vars(parser.parse_args(argv))
    if args["batch_sizes"] is not None:
        args["batch_sizes"] = tuple(args["batch_sizes"])
    if args.pop("server"):
        batch = max(args.pop("batch_sizes") or SPECULATIVE_DEFAULTS["batch_sizes"])
        for name in ("torch_python", "torch_threads", "draft_tokens", "draft_layers"):
            args.pop(name)
        run_server(batch_size=batch, **args)
        return 0
    run_speculative(**args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
