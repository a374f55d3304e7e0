"""`kvattn demo`, `kvattn generate` and `kvattn serve`: parse arguments, call the library.

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
_PORT = _number("int", "in [0, 65535]", lambda v: 0 <= v <= 65535)
_SECONDS = _number("float", ">= 0 and finite", lambda v: math.isfinite(v) and v >= 0)
_SPECULATIVE_HELP = ("ngram:K[:N]: draft up to K tokens per step by prompt lookup (suffixes of up to N tokens, "
                     "default 3), verified in one call; the output is unchanged")


def _speculative(text: str):
    """`--speculative ngram:K[:N]`: a `PromptLookup`."""
    kind, *numbers = text.split(":")
    if kind != "ngram" or len(numbers) not in (1, 2) or not all(n.isdigit() and int(n) >= 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected ngram:K or ngram:K:N with K, N >= 1, got {text!r}")
    from kvattn.models.speculative import PromptLookup

    return PromptLookup(*map(int, numbers))


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
    generate.add_argument("--speculative", type=_speculative, help=_SPECULATIVE_HELP)
    generate.set_defaults(run=functools.partial(_generate, usage=generate))

    serve = commands.add_parser("serve", help="serve a checkpoint over the OpenAI HTTP API (continuous batching)")
    serve.add_argument("checkpoint", help="directory with config.json, model.safetensors and tokenizer.json")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=_PORT, default=8000)
    serve.add_argument("--model-name", help="the `model` requests name (default: the directory's name)")
    serve.add_argument("--max-len", type=_POSITIVE, help="context per sequence (default: the checkpoint's, at most "
                       "4096)")
    serve.add_argument("--max-batch", type=_POSITIVE, default=8, help="sequences decoded together")
    serve.add_argument("--page-size", type=_POSITIVE, default=16)
    serve.add_argument("--num-pages", type=_POSITIVE, help="pages in the pool (default: every sequence at full "
                       "length, plus one)")
    serve.add_argument("--chunk", type=_POSITIVE, help="prefill chunk, a multiple of --page-size (default: 4 pages)")
    serve.add_argument("--prefills-per-step", type=_POSITIVE, default=2,
                       help="prefill chunks an engine step runs at most (bounds the time between tokens)")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    serve.add_argument("--max-waiting", type=_POSITIVE, default=256, help="queued requests before 429")
    serve.add_argument("--chat-template", help="a jinja2 file replacing the checkpoint's chat_template")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/")
    serve.add_argument("--shutdown-timeout", type=_SECONDS, default=30.0,
                       help="on SIGTERM, seconds running requests get to finish")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    serve.add_argument("--speculative", type=_speculative, help=_SPECULATIVE_HELP)
    serve.set_defaults(run=functools.partial(_serve, usage=serve))
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
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, rng=jax.random.key(args.seed))

    def show(token: int):
        print(tokenizer.decode([token]) if tokenizer else token, end="" if tokenizer else " ", flush=True)

    if args.speculative is not None:  # rounds produce several tokens at once: the whole output, then its text
        start = time.perf_counter()
        result = models.speculate(model, [ids], args.max_new_tokens, speculative=args.speculative, **sampling)
        tokens = result.tokens[0, : int(result.counts[0])].tolist()
        elapsed = time.perf_counter() - start
        if tokenizer:
            print(tokenizer.decode(tokens), end="")
        else:
            print(*tokens, end=" ")
        print(f"\n{len(tokens)} tokens in {elapsed:.2f} s, compilation included; {int(result.rounds)} speculative "
              f"rounds kept {result.acceptance:.0%} of their drafts, {int(result.steps)} plain steps", file=sys.stderr)
        return 0
    start, count = time.perf_counter(), 0
    for count, token in enumerate(models.stream(model, ids, args.max_new_tokens, **sampling), start=1):
        if count == 1:
            start = time.perf_counter()  # the first token carries the compilation and the prefill
        show(token)
    elapsed = time.perf_counter() - start
    rate = (count - 1) / elapsed if count > 1 and elapsed > 0 else float("nan")
    print(f"\n{count} tokens; {rate:.1f} tokens/s after the first", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace, usage: argparse.ArgumentParser) -> int:
    """Loads everything and checks it before the port opens; serves until SIGTERM; exits 0 after a graceful stop."""
    import json

    from kvattn import extra

    for module in ("fastapi", "uvicorn", "jinja2", "prometheus_client", "tokenizers"):
        extra.require(module, extra_name="serve")
    from kvattn import models
    from kvattn.serving import Server
    from kvattn.serving.engine import Engine
    from kvattn.serving.http import create_app, run
    from kvattn.serving.metrics import Metrics
    from kvattn.serving.text import Tokenizer

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        usage.error(f"expected a checkpoint directory, got {args.checkpoint!r}")
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            usage.error(f"expected --chat-template to name a file, got {args.chat_template!r}")
        template = path.read_text()
    tokenizer = Tokenizer.from_directory(checkpoint, chat_template=template)
    config = json.loads((checkpoint / "config.json").read_text())
    max_len = args.max_len or min(int(config.get("max_position_embeddings") or config.get("n_positions") or 4096),
                                  4096)
    chunk = args.chunk or 4 * args.page_size
    if chunk % args.page_size:
        usage.error(f"expected --chunk to be a multiple of --page-size {args.page_size}, got {chunk}")
    pages_per_sequence = -(-max_len // args.page_size)
    num_pages = args.num_pages or args.max_batch * pages_per_sequence + 1
    model = models.from_pretrained(checkpoint, max_len=max_len, batch_size=args.max_batch, dtype=args.dtype,
                                   num_pages=num_pages, page_size=args.page_size)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of "
                         f"{model.config.vocab_size}")
    server = Server(model, chunk=chunk, prefix_caching=args.prefix_caching, prefills_per_step=args.prefills_per_step,
                    speculative=args.speculative)
    server.warm_up()  # every program compiled before the port opens: no request waits for a compilation
    metrics = Metrics()
    engine = Engine(server, max_waiting=args.max_waiting,
                    on_step=metrics.on_step, on_error=lambda _: metrics.engine_errors.inc())
    app = create_app(engine, tokenizer, metrics, model_name=args.model_name or checkpoint.resolve().name,
                     max_len=max_len, api_key=args.api_key)
    print(f"kvattn serve: {checkpoint} on http://{args.host}:{args.port} (max_len {max_len}, batch {args.max_batch}, "
          f"{num_pages} pages of {args.page_size})", file=sys.stderr, flush=True)
    run(app, engine, host=args.host, port=args.port, shutdown_seconds=args.shutdown_timeout)
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
