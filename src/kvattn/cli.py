"""`kvattn demo` and `kvattn generate`: parse arguments, call the library.

Bad input never ends in a traceback: one line on stderr, `kvattn <command>:
<what was expected, what was got>`, and exit status 2 for arguments refused
before anything runs, 1 when the library refuses the checkpoint or the run.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

from kvattn.errors import KvattnError, MissingExtraError


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


def _number(kind, condition: str, accept):
    """An argparse `type=` for a `kind` ("int" or "float") value for which `accept` holds, named by `condition`."""

    def parse(text: str):
        try:
            value = int(text) if kind == "int" else float(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind == 'int' else 'a number'} "
                                             f"{condition}, got {text!r}")
        return value

    return parse


_POSITIVE = _number("int", ">= 1", lambda v: v >= 1)
_TOKEN_ID = _number("int", ">= 0", lambda v: v >= 0)
_TEMPERATURE = _number("float", ">= 0 and finite (0: greedy)", lambda v: math.isfinite(v) and v >= 0)
_TOP_P = _number("float", "in (0, 1]", lambda v: 0 < v <= 1)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvattn", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="decode a random stream, check it against full attention, time it")
    demo.add_argument("--in-features", type=int, default=512, help="model width D")
    demo.add_argument("--num-heads", type=int, default=8)
    demo.add_argument("--num-kv-heads", type=int, default=None, help="grouped-query attention (default: num-heads)")
    demo.add_argument("--max-len", type=int, default=2048)
    demo.add_argument("--tokens", type=int, default=512, help="length of the decoded stream")
    demo.add_argument("--batch-size", type=int, default=None, help="decode this many sequences at once")
    demo.add_argument("--cache-layout", choices=("slots_major", "heads_major"), default="slots_major")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--tolerance", type=float, default=1e-4, help="max abs error allowed against full attention")
    demo.set_defaults(run=_demo)

    generate = commands.add_parser("generate", help="generate text from a Hugging Face checkpoint directory")
    generate.add_argument("checkpoint", help="directory with config.json and model.safetensors (and tokenizer.json)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    prompt.add_argument("--prompt-ids", type=_TOKEN_ID, nargs="+", help="token ids, when there is no tokenizer.json")
    generate.add_argument("--max-new-tokens", type=_POSITIVE, default=64)
    generate.add_argument("--max-len", type=_POSITIVE, help="cache capacity (default: prompt + new tokens)")
    generate.add_argument("--temperature", type=_TEMPERATURE, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=_POSITIVE, default=None)
    generate.add_argument("--top-p", type=_TOP_P, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    generate.set_defaults(run=functools.partial(_generate, usage=generate))
    return parser


def _generate(args: argparse.Namespace, usage: argparse.ArgumentParser) -> int:
    """Streams tokens as they are produced, then prints tokens per second (stderr).

    `usage.error` refuses arguments that cannot work before anything is loaded.
    """
    import time

    import jax

    from kvattn import extra, models

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        got = "which does not exist" if not checkpoint.exists() else "a file"
        usage.error(f"expected a checkpoint directory, got {args.checkpoint!r}, {got}")
    tokenizer = None
    if args.prompt is not None:
        path = checkpoint / "tokenizer.json"
        if not path.exists():
            usage.error(f"--prompt needs {path}, which does not exist; pass --prompt-ids instead")
        tokenizer = extra.require("tokenizers", extra_name="generate").Tokenizer.from_file(str(path))
        ids = tokenizer.encode(args.prompt).ids
    else:
        ids = args.prompt_ids
    needed = len(ids) + args.max_new_tokens
    if args.max_len is not None and args.max_len < needed:
        usage.error(f"expected --max-len >= {needed} ({len(ids)} prompt tokens + --max-new-tokens "
                     f"{args.max_new_tokens}), got {args.max_len}")
    model = models.from_pretrained(checkpoint, max_len=args.max_len or needed, dtype=args.dtype)
    start, count = time.perf_counter(), 0
    for count, token in enumerate(models.stream(
        model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        rng=jax.random.key(args.seed),
    ), start=1):
        if count == 1:
            start = time.perf_counter()  # the first token carries the compilation and the prefill
        print(tokenizer.decode([token]) if tokenizer else token, end="" if tokenizer else " ", flush=True)
    elapsed = time.perf_counter() - start
    rate = (count - 1) / elapsed if count > 1 and elapsed > 0 else float("nan")
    print(f"\n{count} tokens; {rate:.1f} tokens/s after the first", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvattn.demo import run_demo

    report = run_demo(
        in_features=args.in_features,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        max_len=args.max_len,
        num_tokens=args.tokens,
        batch_size=args.batch_size,
        cache_layout=args.cache_layout,
        seed=args.seed,
        tolerance=args.tolerance,
    )
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except MissingExtraError as error:
        print(f"kvattn {args.command}: {error}", file=sys.stderr)
        return 2
    # The library's own refusals (kvattn.errors) are ValueErrors, and OutOfPagesError a RuntimeError.
    except (KvattnError, ValueError, TypeError, OSError) as error:
        print(f"kvattn {args.command}: {' '.join(str(error).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
