"""`kvattn demo`, `kvattn generate` and `kvattn serve`: parse arguments, call the library.

Bad input never ends in a traceback: one line on stderr, `kvattn <command>:
<what was expected, what was got>`, and exit status 2 for arguments refused
before anything runs, 1 when the library refuses the checkpoint or the run.
Parsing (and so `--help` and `--version`) imports no JAX: each command
imports what it runs.
"""

from __future__ import annotations

import argparse
import errno
import functools
import math
import socket
import sys
import time
from pathlib import Path

import kvattn
from kvattn.errors import KvattnError, MissingExtraError, header_value


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with its default, except where there is none or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Version(argparse.Action):
    """`--version`: prints kvattn's version, read from the installed metadata only when asked, and exits."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {kvattn.__version__}")
        parser.exit()


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
# K + 1 is the width of the verify program, compiled for every batch bucket: a bound turns a typo such as
# ngram:99999999999 into a usage error rather than an allocation failure deep in compilation.
_SPECULATIVE_MAX = 64
_WEIGHTS = ("int8", "int4", "bfloat16")
_WEIGHTS_HELP = ("compact weights: int8 with per-output scales, int4 with a scale per 32 inputs, or bfloat16 "
                 "(on an x86 CPU with AVX2: stored in "
                 "bfloat16, computed in float32) (default: float weights in --dtype)")
_LONG_CONTEXT_HELP = "allow a context past the checkpoint's max_position_embeddings (outputs there may degrade)"


def _speculative(text: str):
    """`--speculative ngram:K[:N]`: a `PromptLookup`."""
    kind, *numbers = text.split(":")
    if kind != "ngram" or len(numbers) not in (1, 2) or not all(
            n.isdigit() and 1 <= int(n) <= _SPECULATIVE_MAX for n in numbers):
        raise argparse.ArgumentTypeError(f"expected ngram:K or ngram:K:N with K and N integers in "
                                         f"[1, {_SPECULATIVE_MAX}], got {text!r}")
    from kvattn.generation import PromptLookup

    return PromptLookup(*map(int, numbers))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvattn", description=__doc__.split("\n")[0], formatter_class=_HelpFormatter)
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, formatter_class=_HelpFormatter)

    demo = command("demo", help="decode a random stream, check it against full attention, time it")
    demo.add_argument("--in-features", type=int, default=512, help="model width D")
    demo.add_argument("--num-heads", type=int, default=8, help="query heads")
    demo.add_argument("--num-kv-heads", type=int, default=None, help="grouped-query attention (default: num-heads)")
    demo.add_argument("--max-len", type=int, default=2048, help="cache capacity")
    demo.add_argument("--tokens", type=int, default=512, help="length of the decoded stream")
    demo.add_argument("--batch-size", type=int, default=None, help="decode this many sequences at once")
    demo.add_argument("--cache-layout", choices=("slots_major", "heads_major"), default="slots_major",
                      help="the cache's axis order")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights and stream")
    demo.add_argument("--tolerance", type=float, default=1e-4, help="max abs error allowed against full attention")
    demo.set_defaults(run=_demo)

    generate = command("generate", help="generate text from a Hugging Face checkpoint directory")
    generate.add_argument("checkpoint", help="directory with config.json and model.safetensors (and tokenizer.json)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    prompt.add_argument("--prompt-ids", type=_TOKEN_ID, nargs="+", help="token ids, when there is no tokenizer.json")
    generate.add_argument("--chat", action="store_true",
                          help="send --prompt as one user message through the checkpoint's chat template")
    generate.add_argument("--max-new-tokens", type=_POSITIVE, default=64,
                          help="tokens to generate at most; generation also ends at the checkpoint's end-of-sequence "
                          "ids")
    generate.add_argument("--max-len", type=_POSITIVE, help="cache capacity (default: prompt + new tokens)")
    generate.add_argument("--allow-long-context", action="store_true", help=_LONG_CONTEXT_HELP)
    generate.add_argument("--temperature", type=_TEMPERATURE, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=_POSITIVE, default=None, help="sample among the k likeliest tokens")
    generate.add_argument("--top-p", type=_TOP_P, default=None, help="sample within this probability mass")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    generate.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="computation dtype")
    generate.add_argument("--weights", choices=_WEIGHTS, help=_WEIGHTS_HELP)
    generate.add_argument("--speculative", type=_speculative, help=_SPECULATIVE_HELP)
    generate.set_defaults(run=functools.partial(_generate, usage=generate))

    serve = command("serve", help="serve a checkpoint over the OpenAI HTTP API (continuous batching)")
    serve.add_argument("checkpoint", help="directory with config.json, model.safetensors and tokenizer.json")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=_PORT, default=8000, help="port to bind; 0: any free port")
    serve.add_argument("--model-name", help="the `model` requests name (default: the directory's name)")
    serve.add_argument("--max-len", type=_POSITIVE, help="context per sequence (default: the checkpoint's, at most "
                       "4096)")
    serve.add_argument("--allow-long-context", action="store_true", help=_LONG_CONTEXT_HELP)
    serve.add_argument("--max-batch", type=_POSITIVE, default=8, help="sequences decoded together")
    serve.add_argument("--page-size", type=_POSITIVE, default=16, help="cache slots per page")
    serve.add_argument("--num-pages", type=_POSITIVE, help="pages in the pool (default: every sequence at full "
                       "length, plus one)")
    serve.add_argument("--chunk", type=_POSITIVE, help="prefill chunk, a multiple of --page-size (default: 8 pages)")
    serve.add_argument("--prefills-per-step", type=_POSITIVE, default=1,
                       help="prefill chunks an engine step runs at most while requests decode, in one call (bounds "
                            "their time between tokens; a step with none decoding prefills every admitted prompt)")
    serve.add_argument("--step-tokens", type=_POSITIVE,
                       help="tokens a step that decodes runs at most: its decode rows and one prefill chunk of the "
                            "rest, in one call (more than --max-batch; default: chunks in calls of their own)")
    serve.add_argument("--async-scheduling", action="store_true",
                       help="dispatch a decode step's device call before reading the step ahead of it (the same "
                            "tokens; not with --step-tokens or --speculative, which run as without it)")
    serve.add_argument("--burst-gap", type=_SECONDS, default=10.0, metavar="MS",
                       help="a request arriving at an idle server waits while others follow it, each within MS "
                            "milliseconds of the one before, until they fill --max-batch (for at most 8 gaps in all), so "
                            "a burst starts and decodes as one batch; 0: no wait")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="recompute every prompt rather than reuse the cached pages of a shared prefix")
    serve.add_argument("--max-waiting", type=_POSITIVE, default=256, help="queued requests before 429")
    serve.add_argument("--chat-template", help="a jinja2 file replacing the checkpoint's chat_template")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/")
    serve.add_argument("--shutdown-timeout", type=_SECONDS, default=30.0,
                       help="on SIGTERM, seconds running requests get to finish")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="computation dtype")
    serve.add_argument("--weights", choices=_WEIGHTS, help=_WEIGHTS_HELP)
    serve.add_argument("--speculative", type=_speculative, help=_SPECULATIVE_HELP)
    serve.set_defaults(run=functools.partial(_serve, usage=serve))
    return parser


def _checkpoint(text: str, usage: argparse.ArgumentParser) -> Path:
    """The checkpoint directory named by `text`; a usage error when there is none."""
    checkpoint = Path(text)
    if not checkpoint.is_dir():
        got = "which does not exist" if not checkpoint.exists() else "a file"
        usage.error(f"expected a checkpoint directory, got {text!r}, {got}")
    return checkpoint


def _trained_context(checkpoint: Path) -> int:
    """The positions the checkpoint was trained on: its config's `max_position_embeddings` as kvattn reads it."""
    from kvattn.models import checkpoint_config

    return checkpoint_config(checkpoint).max_position_embeddings


def _check_context(length: int, what: str, context: int, args: argparse.Namespace,
                   usage: argparse.ArgumentParser) -> None:
    """Refuses `length` positions past the trained `context` unless --allow-long-context; says so when allowed."""
    if length <= context:
        return
    if not args.allow_long_context:
        usage.error(f"{what} is past the checkpoint's trained context of {context} positions "
                    "(max_position_embeddings); use fewer, or pass --allow-long-context to run past it anyway")
    print(f"{usage.prog}: {what} is past the checkpoint's trained context of {context} positions; "
          "--allow-long-context: outputs past it may degrade", file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace, usage: argparse.ArgumentParser) -> int:
    """Streams the text (or, without a tokenizer, the ids) as `kvattn.LLM` produces it, then the rate (stderr).

    `usage.error` refuses arguments that cannot work before anything is loaded.
    """
    checkpoint = _checkpoint(args.checkpoint, usage)
    if args.chat and args.prompt is None:
        usage.error("--chat needs --prompt (text to send as the user's message), got --prompt-ids")
    tokenizer = None
    if args.prompt is not None:
        from kvattn import extra

        path = checkpoint / "tokenizer.json"
        if not path.exists():
            usage.error(f"--prompt needs {path}, which does not exist; pass --prompt-ids instead")
        for module in ("tokenizers", "jinja2"):
            extra.require(module, extra_name="generate")
        from kvattn.serving.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_directory(checkpoint)
        if args.chat and not tokenizer.has_chat_template:
            usage.error(f"--chat needs a chat template, and {checkpoint} has none (chat_template.jinja, or "
                        "chat_template in tokenizer_config.json); drop --chat to send --prompt as it is")
        if args.chat:  # the template writes the special tokens itself, as the chat endpoint encodes it
            ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": args.prompt}]),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(args.prompt)
    else:
        ids = args.prompt_ids
    needed = len(ids) + args.max_new_tokens
    if args.max_len is not None and args.max_len < needed:
        usage.error(f"expected --max-len >= {needed} ({len(ids)} prompt tokens + --max-new-tokens "
                     f"{args.max_new_tokens}), got {args.max_len}")
    _check_context(needed, f"{len(ids)} prompt tokens + --max-new-tokens {args.max_new_tokens} = {needed}",
                   _trained_context(checkpoint), args, usage)
    from kvattn.generation import SamplingParams
    from kvattn.serving.llm import LLM

    llm = LLM(checkpoint, weights=args.weights, dtype=args.dtype, max_len=args.max_len or needed,
              allow_long_context=args.allow_long_context, max_batch=1, speculative=args.speculative, seed=args.seed)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    started = first = time.perf_counter()
    if llm.tokenizer is not None:
        for count, delta in enumerate(llm.stream(ids, params), start=1):
            if count == 1:
                first = time.perf_counter()  # the first text carries the compilation and the prefill
            print(delta, end="", flush=True)
    else:  # ids only: printed as they all arrive
        [output] = llm.generate([ids], params, progress=False)
        print(*output.outputs[0].token_ids, end="")
    now, stats = time.perf_counter(), llm.engine.stats
    count = stats.generated_tokens
    rate = (count - 1) / (now - first) if count > 1 and now > first and llm.tokenizer is not None else None
    steady = f"; {rate:.1f} tokens/s after the first" if rate else ""
    print(f"\n{count} tokens in {now - started:.2f} s, compilation included{steady}", file=sys.stderr)
    if args.speculative is not None:
        kept = f"kept {stats.accepted_tokens} of {stats.drafted_tokens} drafts" if stats.drafted_tokens else \
            "drafted nothing (no earlier occurrence of the latest tokens)"
        print(f"speculative decoding {kept}", file=sys.stderr)
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` and listening, before anything is loaded: a port in use fails in a moment."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: a port left in TIME_WAIT by a previous server is reusable at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()  # listening holds the port: with SO_REUSEADDR, a socket only bound would not
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is in use ({error.strerror}): stop what holds it, "
                          "or pass another --port") from None
        raise OSError(f"cannot listen on {host} port {port}: {error.strerror}") from None
    return sock


def _serve(args: argparse.Namespace, usage: argparse.ArgumentParser) -> int:
    """Takes the port, loads and compiles everything, then serves until SIGTERM; exits 0 after a graceful stop."""
    checkpoint = _checkpoint(args.checkpoint, usage)
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            usage.error(f"expected --chat-template to name a file, got {args.chat_template!r}")
        template = path.read_text()
    if args.api_key is not None:
        try:
            header_value("--api-key", args.api_key)
        except ValueError as error:
            usage.error(str(error))
    from kvattn.serving.server import DEFAULT_CHUNK_PAGES

    chunk = args.chunk or DEFAULT_CHUNK_PAGES * args.page_size
    if chunk % args.page_size:
        usage.error(f"expected --chunk to be a multiple of --page-size {args.page_size}, got {chunk}")
    if args.step_tokens is not None and args.step_tokens <= args.max_batch:
        usage.error(f"expected --step-tokens to exceed --max-batch {args.max_batch}, got {args.step_tokens}")
    if args.step_tokens is not None and args.speculative is not None:
        usage.error("expected --step-tokens or --speculative, not both (a speculative round is not budgeted)")
    with _listen(args.host, args.port) as sock:
        return _load_and_serve(args, usage, checkpoint, template, chunk, sock)


def _load_and_serve(args: argparse.Namespace, usage: argparse.ArgumentParser, checkpoint: Path, template: str | None,
                    chunk: int, sock: socket.socket) -> int:
    """`_serve` once the port is held: the context refused or allowed, then `kvattn.serving.openai.launch.serve`."""
    from kvattn import extra

    for module in ("fastapi", "uvicorn", "jinja2", "prometheus_client", "tokenizers"):
        extra.require(module, extra_name="serve")
    from kvattn.serving.openai import launch

    context = _trained_context(checkpoint)
    max_len = args.max_len or min(context, 4096)
    _check_context(max_len, f"--max-len {max_len}", context, args, usage)
    return launch.serve(checkpoint, sock=sock, max_len=max_len, max_batch=args.max_batch, page_size=args.page_size,
                        num_pages=args.num_pages, chunk=chunk, prefills_per_step=args.prefills_per_step,
                        step_tokens=args.step_tokens, async_scheduling=args.async_scheduling,
                        burst_gap_s=args.burst_gap / 1000,
                        prefix_caching=args.prefix_caching, speculative=args.speculative, dtype=args.dtype,
                        weights=args.weights, chat_template=template, model_name=args.model_name, api_key=args.api_key,
                        max_waiting=args.max_waiting, shutdown_seconds=args.shutdown_timeout)


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
