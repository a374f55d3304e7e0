"""CPU figures for three grammar engines for constrained decoding: llguidance, outlines-core and xgrammar.

Usage, from the repository root:

    .venv/bin/python benchmarks/results-2026-12-03-grammar/grammar_engines.py [--engines llguidance,outlines,xgrammar]
        [--json PATH]

Vocabularies: two byte-level BPE tokenizers (HF `tokenizers` format, `<|endoftext|>` = id 0 as EOS), trained here on
the .py/.txt/.md files of the project's virtual environment and cached under /tmp/kvattn-grammar-tokenizers (made
again when absent). One 150,000-token BPE is trained; the 32,000-token one is its first 32,000 entries (the 256-byte
alphabet, the special token and the first merges), which is what training with vocab_size=32,000 on the same corpus
gives, since BPE training adds merges one at a time in a fixed order.

Per engine and vocabulary:
  * prep: the one-time tokenizer/vocabulary preparation, from the tokenizer.json text.
  * compile: grammar spec -> matcher ready for its first mask, for any-JSON object, a moderate JSON schema, a regex
    and a choice of 5 strings (median of repeats; xgrammar's compile cache is off). `first mask`: the first mask
    computation on that fresh matcher (llguidance builds its lexer lazily, so part of its compile lands there).
  * per token: the matcher is driven along DOC (valid under the schema, tokenized with the same tokenizer) and then
    EOS; each step times filling the engine's 32-bit token bitmask plus consuming the token. `cold` is the first
    pass over a fresh matcher, `warm` the later passes after reset(). Separately, the numpy cost of turning the
    bitmask into a dense float32 additive bias row of length V (0 allowed, -inf not): a gather of 8 floats per mask
    byte, and for comparison np.unpackbits followed by a gather per token.
  * fidelity: which constraints of the schema each engine enforces, from a few invalid documents.

xgrammar needs torch/transformers/triton, so it runs in its own virtual environment (XGRAMMAR_PYTHON, default
/tmp/xg-venv/bin/python) as a child process of this script; it is skipped when that interpreter is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

import numpy as np

TOKENIZER_DIR = pathlib.Path("/tmp/kvattn-grammar-tokenizers")
VOCAB_SIZES = (32_000, 150_000)
EOS = "<|endoftext|>"
CORPUS_ROOT = pathlib.Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages"
XGRAMMAR_PYTHON = os.environ.get("XGRAMMAR_PYTHON", "/tmp/xg-venv/bin/python")

COMPILE_MAX_REPEATS = 5  # compile repeats stop after this many, or once COMPILE_BUDGET_S is spent (at least one)
COMPILE_BUDGET_S = 3.0
WARM_PASSES = 10

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
REGEX = r"\d{3}-\d{4}"
GRAMMARS = {  # kind -> spec; each engine turns the spec into its own grammar form
    "any_json": {"type": "object"},
    "schema": SCHEMA,
    "regex": REGEX,
    "choice": CHOICES,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "scores": [9.5, 7.25, 8, 10.0],
    "address": {"city": "London", "zip": "10001"},
    "active": True,
}
# Documents that break one constraint each; an engine that enforces it must refuse some token (or EOS at the end).
INVALID_DOCS = {
    "maxLength": {**DOC, "name": "A" * 40},
    "maximum": {**DOC, "age": 200},
    "enum": {**DOC, "role": "owner"},
    "maxItems": {**DOC, "scores": [1, 2, 3, 4, 5, 6]},
    "pattern": {**DOC, "address": {"city": "London", "zip": "1000a"}},
    "additionalProperties": {**DOC, "extra": 1},
    "required": {k: v for k, v in DOC.items() if k != "age"},
}


def compact(doc) -> str:
    return json.dumps(doc, separators=(",", ":"))


# --- tokenizers ---------------------------------------------------------------------------------------------------


def tokenizer_path(vocab_size: int) -> pathlib.Path:
    return TOKENIZER_DIR / f"bytelevel-bpe-{vocab_size}.json"


def ensure_tokenizers() -> None:
    """Train the 150k byte-level BPE (about 35 s on 2 cores) and cut the 32k one from it, unless both are cached."""
    if all(tokenizer_path(n).exists() for n in VOCAB_SIZES):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(p) for p in CORPUS_ROOT.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
    size_mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"training byte-level BPE on {len(files)} files ({size_mb:.0f} MB) under {CORPUS_ROOT}", flush=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(VOCAB_SIZES),
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train(files, trainer)
    print(f"trained {tok.get_vocab_size()} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    full = json.loads(tok.to_str())
    n_base = len(full["model"]["vocab"]) - len(full["model"]["merges"])  # special token + byte alphabet
    for n in VOCAB_SIZES:
        cut = json.loads(json.dumps(full))
        cut["model"]["vocab"] = {t: i for t, i in full["model"]["vocab"].items() if i < n}
        cut["model"]["merges"] = full["model"]["merges"][: n - n_base]
        tokenizer_path(n).write_text(json.dumps(cut, ensure_ascii=False))


def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable-character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


# --- engines: each prepares a vocabulary, compiles a grammar kind into a matcher, and drives the matcher ------------


class Llguidance:
    name = "llguidance"

    def __init__(self):
        import llguidance

        self.llg = llguidance
        self.version = llguidance.__version__

    def prepare(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        self.tokenizer = self.llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)

    def compile(self, kind: str):
        spec = GRAMMARS[kind]
        if kind in ("any_json", "schema"):
            grammar = self.llg.LLMatcher.grammar_from_json_schema(spec)
        elif kind == "regex":
            grammar = self.llg.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = self.llg.grammar_from("choice", json.dumps(spec))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    @staticmethod
    def fill(matcher, bitmask: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    @staticmethod
    def advance(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def reset(matcher) -> None:
        matcher.reset()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self):
        import outlines_core

        self.oc = outlines_core
        self.version = version("outlines_core")

    def prepare(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        # outlines-core's Vocabulary wants token bytes -> ids, EOS left out; from_pretrained needs the hub.
        decode = byte_decoder()
        token_ids: dict[bytes, list[int]] = {}
        for token, i in json.loads(tokenizer_json)["model"]["vocab"].items():
            if i != eos:
                token_ids.setdefault(bytes(decode[c] for c in token), []).append(i)
        self.vocabulary = self.oc.Vocabulary(eos, token_ids)
        self.eos = eos

    def compile(self, kind: str):
        spec = GRAMMARS[kind]
        if kind in ("any_json", "schema"):
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        elif kind == "regex":
            regex = spec
        else:
            regex = "(" + "|".join(spec) + ")"  # the choices hold no regex metacharacters
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    @staticmethod
    def fill(guide, bitmask: np.ndarray) -> None:
        guide.write_mask_into(bitmask.ctypes.data, bitmask.size, bitmask.itemsize)

    def advance(self, guide, token: int) -> bool:
        if token == self.eos:  # the Guide has no transition on EOS; its mask allows EOS in final states only
            return guide.is_finished()
        guide.advance(token, return_tokens=False)
        return True

    @staticmethod
    def reset(guide) -> None:
        guide.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self):
        import xgrammar

        self.xgr = xgrammar
        self.version = version("xgrammar")
        self.threads = min(8, os.cpu_count() or 1)

    def prepare(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        vocab = json.loads(tokenizer_json)["model"]["vocab"]
        encoded = [""] * vocab_size
        for token, i in vocab.items():
            encoded[i] = token
        info = self.xgr.TokenizerInfo(
            encoded, self.xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos]
        )
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)

    def compile(self, kind: str):
        spec = GRAMMARS[kind]
        if kind in ("any_json", "schema"):
            compiled = self.compiler.compile_json_schema(json.dumps(spec))
        elif kind == "regex":
            compiled = self.compiler.compile_regex(spec)
        else:
            compiled = self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(matcher, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask[None, :])

    @staticmethod
    def advance(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def reset(matcher) -> None:
        matcher.reset()


ENGINES = {"llguidance": Llguidance, "outlines": OutlinesCore, "xgrammar": Xgrammar}


# --- measurements -------------------------------------------------------------------------------------------------

# Row b of BYTE_BIAS: the 8 float32 biases of the tokens whose mask bits are the bits of byte b (LSB first).
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
BYTE_BIAS = np.where(_BYTE_BITS == 1, 0.0, -np.inf).astype(np.float32)
BIT_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


def bitmask_to_bias(bitmask: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Dense float32 additive bias (0 allowed, -inf not) from a little-endian 32-bit token bitmask: one gather of 8
    floats per mask byte. out has 32 * len(bitmask) entries; the row is its first V."""
    np.take(BYTE_BIAS, bitmask.view(np.uint8), axis=0, out=out.reshape(-1, 8))
    return out


def bitmask_to_bias_unpackbits(bitmask: np.ndarray, vocab_size: int, out: np.ndarray) -> np.ndarray:
    """The same row by np.unpackbits then a gather per token (about 4x slower than bitmask_to_bias)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=vocab_size)
    return np.take(BIT_BIAS, bits, out=out)


def allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[token >> 5]) >> (token & 31)) & 1)


def us(seconds: list[float], q: float = 0.5) -> float:
    return 1e6 * float(np.quantile(seconds, q))


def time_compile(engine, kind: str) -> tuple[list[float], object]:
    times: list[float] = []
    while len(times) < COMPILE_MAX_REPEATS and (not times or sum(times) < COMPILE_BUDGET_S):
        start = time.perf_counter()
        matcher = engine.compile(kind)
        times.append(time.perf_counter() - start)
    return times, matcher


def drive(engine, matcher, tokens: list[int], vocab_size: int) -> dict:
    """One pass along tokens: per step, time mask fill + consume, and (apart) the bitmask -> bias conversions."""
    bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    bias = np.empty(32 * len(bitmask), dtype=np.float32)
    bias_unpacked = np.empty(vocab_size, dtype=np.float32)
    times: dict[str, list[float]] = {"fill": [], "step": [], "bias": [], "bias_unpackbits": []}
    for token in tokens:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        t1 = time.perf_counter()
        ok = allowed(bitmask, token) and engine.advance(matcher, token)
        t2 = time.perf_counter()
        bitmask_to_bias(bitmask, bias)
        t3 = time.perf_counter()
        bitmask_to_bias_unpackbits(bitmask, vocab_size, bias_unpacked)
        t4 = time.perf_counter()
        if not ok or bias[token] != 0.0 or not np.array_equal(bias[:vocab_size], bias_unpacked):
            raise RuntimeError(f"{engine.name} refused token {token} at step {len(times['step'])}")
        times["fill"].append(t1 - t0)
        times["step"].append(t2 - t0)
        times["bias"].append(t3 - t2)
        times["bias_unpackbits"].append(t4 - t3)
    return times


def accepts(engine, matcher, tokens: list[int], vocab_size: int) -> bool:
    """Whether the matcher allows every token of tokens (the last being EOS), by its masks."""
    engine.reset(matcher)
    bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for token in tokens:
        engine.fill(matcher, bitmask)
        if not allowed(bitmask, token) or not engine.advance(matcher, token):
            return False
    return True


def bench_engine(name: str) -> dict:
    from tokenizers import Tokenizer

    engine = ENGINES[name]()
    result = {"engine": engine.name, "version": engine.version, "vocabs": {}}
    if name == "xgrammar":
        result["threads"] = engine.threads
    for vocab_size in VOCAB_SIZES:
        tokenizer_json = tokenizer_path(vocab_size).read_text()
        tokenizer = Tokenizer.from_str(tokenizer_json)
        eos = tokenizer.token_to_id(EOS)
        row: dict = {}

        start = time.perf_counter()
        engine.prepare(tokenizer_json, vocab_size, eos)
        row["prep_s"] = time.perf_counter() - start

        bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        matchers = {}
        for kind in GRAMMARS:
            try:
                times, matcher = time_compile(engine, kind)
            except Exception as error:  # noqa: BLE001 - a grammar kind an engine cannot take is recorded
                row[f"compile_{kind}"] = {"error": f"{type(error).__name__}: {error}"}
                continue
            start = time.perf_counter()
            engine.fill(matcher, bitmask)
            first_mask = time.perf_counter() - start
            row[f"compile_{kind}"] = {"median_s": statistics.median(times), "n": len(times), "first_mask_s": first_mask}
            matchers[kind] = matcher
            print(f"  {engine.name} V={vocab_size} compile {kind}: {row[f'compile_{kind}']}", flush=True)

        tokens = tokenizer.encode(compact(DOC)).ids + [eos]
        for kind in ("any_json", "schema"):
            if kind not in matchers:
                continue
            matcher = matchers[kind]
            engine.reset(matcher)  # undo the first-mask call above (a mask computation does not advance)
            cold = drive(engine, matcher, tokens, vocab_size)
            warm: dict[str, list[float]] = {key: [] for key in cold}
            for _ in range(WARM_PASSES):
                engine.reset(matcher)
                for key, values in drive(engine, matcher, tokens, vocab_size).items():
                    warm[key] += values
            row[f"mask_{kind}"] = {
                "tokens": len(tokens),
                "cold_step_median_us": us(cold["step"]),
                "cold_total_ms": 1e3 * sum(cold["step"]),
                "warm_step_median_us": us(warm["step"]),
                "warm_step_p90_us": us(warm["step"], 0.9),
                "warm_fill_median_us": us(warm["fill"]),
                "bias_median_us": us(warm["bias"]),
                "bias_p90_us": us(warm["bias"], 0.9),
                "bias_unpackbits_median_us": us(warm["bias_unpackbits"]),
            }
            print(f"  {engine.name} V={vocab_size} mask {kind}: {row[f'mask_{kind}']}", flush=True)

        if vocab_size == min(VOCAB_SIZES) and "schema" in matchers:
            row["fidelity"] = {
                "valid": accepts(engine, matchers["schema"], tokens, vocab_size),
                **{
                    f"rejects {rule}": not accepts(
                        engine, matchers["schema"], tokenizer.encode(compact(doc)).ids + [eos], vocab_size
                    )
                    for rule, doc in INVALID_DOCS.items()
                },
            }
            print(f"  {engine.name} fidelity: {row['fidelity']}", flush=True)
        result["vocabs"][vocab_size] = row
    return result


def run_xgrammar_child() -> dict | None:
    if not os.path.exists(XGRAMMAR_PYTHON):
        print(f"xgrammar skipped: no interpreter at {XGRAMMAR_PYTHON}", flush=True)
        return None
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [XGRAMMAR_PYTHON, __file__, "--engines", "xgrammar", "--json", out.name, "--child"]
        if subprocess.run(cmd, check=False).returncode != 0:
            print("xgrammar child failed", flush=True)
            return None
        result = json.loads(pathlib.Path(out.name).read_text())["results"][0]
    result["vocabs"] = {int(k): v for k, v in result["vocabs"].items()}  # JSON made the keys strings
    return result


# --- report -------------------------------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def report(results: list[dict]) -> None:
    print("\n| engine | V | prep ms | compile ms (1st mask ms): any-JSON | schema | regex | choice |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for vocab_size, row in r["vocabs"].items():
            cells = []
            for kind in GRAMMARS:
                c = row[f"compile_{kind}"]
                if "error" in c:
                    cells.append(c["error"][:40])
                else:
                    cells.append(f"{fmt_ms(c['median_s'])} ({fmt_ms(c['first_mask_s'])})")
            print(f"| {r['engine']} | {vocab_size} | {fmt_ms(row['prep_s'])} | " + " | ".join(cells) + " |")

    print(
        "\n| engine | V | grammar | tokens | warm µs/token median | p90 | mask only median | cold median |"
        " cold pass ms | bias row median µs | (unpackbits) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for vocab_size, row in r["vocabs"].items():
            for kind in ("any_json", "schema"):
                m = row.get(f"mask_{kind}")
                if m:
                    print(f"| {r['engine']} | {vocab_size} | {kind} | {m['tokens']} | {m['warm_step_median_us']:.0f} |"
                          f" {m['warm_step_p90_us']:.0f} | {m['warm_fill_median_us']:.0f} |"
                          f" {m['cold_step_median_us']:.0f} | {m['cold_total_ms']:.2f} | {m['bias_median_us']:.0f} |"
                          f" {m['bias_unpackbits_median_us']:.0f} |")

    print("\nfidelity (V=32000):")
    for r in results:
        fid = r["vocabs"].get(min(VOCAB_SIZES), {}).get("fidelity")
        if fid:
            print(f"  {r['engine']}: " + ", ".join(f"{k}={v}" for k, v in fid.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="llguidance,outlines,xgrammar")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.engines.split(",")

    if not args.child:
        print(f"load average before: {os.getloadavg()}", flush=True)
        ensure_tokenizers()
    results = []
    for name in names:
        if name == "xgrammar" and not args.child:
            child = run_xgrammar_child()
            if child:
                results.append(child)
            continue
        print(f"{name}:", flush=True)
        results.append(bench_engine(name))

    load = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_after": load, "python": sys.version.split()[0], "results": results}, f, indent=1)
    if not args.child:
        report(results)
        print(f"\nload average after: {load}")


if __name__ == "__main__":
    main()
