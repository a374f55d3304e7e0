"""`kvattn demo`, `kvattn bench` (`--options`, `--model`) and `kvattn generate`: parse arguments, call the library."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvattn", description=__doc__)
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

    bench = commands.add_parser(
        "bench", help="benchmark decoding against Flax and recompute baselines (defaults: kvattn.bench.run's)"
    )
    bench.add_argument("--in-features", type=int)
    bench.add_argument("--num-heads", type=int)
    bench.add_argument("--max-len", type=int)
    bench.add_argument("--batch-sizes", type=int, nargs="+")
    bench.add_argument("--filled", type=int, nargs="+", help="filled lengths T")
    bench.add_argument("--layouts", nargs="+")
    bench.add_argument("--dtype", help="cache storage dtype: float32, bfloat16 or int8")
    bench.add_argument("--repeats", type=int, help="timed repeats per figure (median reported)")
    bench.add_argument(
        "--generation-repeats", type=int, help="timed whole generations per contender at the smallest batch (0: none)"
    )
    bench.add_argument("--out-dir", help="where the JSON, Markdown and PNG files go")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    bench.add_argument(
        "--options",
        action="store_true",
        help="instead of the contenders, time kvattn.decode with rotary positions, QK-norm and bfloat16 compute "
        "against the plain layer (defaults: kvattn.bench.run_options's; one layout; writes options.json, options.md)",
    )
    bench.add_argument(
        "--model",
        action="store_true",
        help="instead of the contenders, time whole-model decoding of a random Llama-shaped checkpoint (about 125M "
        "parameters) against transformers and a plain hand-rolled cache (defaults: kvattn.bench.model.run_model's; "
        "writes model.json, model.md)",
    )
    bench.add_argument(
        "--paged",
        action="store_true",
        help="instead of the contenders, measure the paged cache against the contiguous one: memory, concurrency, "
        "forks, prefix-cache hits, decode steps at B=8 and host bookkeeping (writes paged.json, paged.md)",
    )
    bench.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), help="--model only")
    bench.add_argument("--prompt-len", type=int, help="--model only")
    bench.add_argument("--new-tokens", type=int, help="--model only")
    bench.add_argument("--num-layers", type=int, help="--model only: fewer layers than 12")
    bench.add_argument("--torch-python", help="--model only: the Python that runs transformers (default: this one)")
    bench.add_argument("--torch-threads", type=int, help="--model only: torch.set_num_threads")
    bench.add_argument("--torch-compile", action="store_true", default=None,
                       help="--model only: also time transformers' static cache under torch.compile")
    generate = commands.add_parser("generate", help="generate text from a Hugging Face checkpoint directory")
    generate.add_argument("checkpoint", help="directory with config.json and model.safetensors (and tokenizer.json)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", help="token ids, when there is no tokenizer.json")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--max-len", type=int, default=None, help="cache capacity (default: prompt + new tokens)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser


def _generate(args: argparse.Namespace) -> int:
    """Streams tokens as they are produced, then prints tokens per second (stderr)."""
    import time
    from pathlib import Path

    import jax

    from kvattn import models

    tokenizer = None
    if args.prompt is not None:
        path = Path(args.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise SystemExit(f"kvattn generate: {path} does not exist; pass --prompt-ids instead of --prompt")
        from kvattn.bench import extra

        tokenizer = extra.require("tokenizers", extra_name="generate").Tokenizer.from_file(str(path))
        ids = tokenizer.encode(args.prompt).ids
    else:
        ids = args.prompt_ids
    max_len = args.max_len or len(ids) + args.max_new_tokens
    model = models.from_pretrained(args.checkpoint, max_len=max_len, dtype=args.dtype)
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from kvattn.bench import extra

    try:
        return _run(args)
    except extra.MissingExtraError as error:
        print(f"kvattn: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "demo":
        from kvattn.bench import run_demo

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
    from kvattn.bench import run, run_options

    options = {
        name: value for name, value in vars(args).items()
        if name not in ("command", "options", "model", "paged") and value is not None
    }
    if args.paged:
        from kvattn.bench.paged import run_paged

        if args.options or args.model or set(options) - {"repeats", "out_dir", "quick"}:
            raise SystemExit(f"kvattn bench --paged takes --repeats, --out-dir and --quick, got {sorted(options)}")
        run_paged(**options)
        return 0
    model_only = {"dtypes", "prompt_len", "new_tokens", "num_layers", "torch_python", "torch_threads", "torch_compile"}
    if args.model:
        from kvattn.bench.model import run_model

        if args.options or set(options) - model_only - {"batch_sizes", "repeats", "out_dir", "quick"}:
            raise SystemExit("kvattn bench --model takes --batch-sizes, --repeats, --out-dir, --quick and the "
                             f"--model options, got {sorted(options)}")
        run_model(**options)
        return 0
    if set(options) & model_only:
        raise SystemExit(f"kvattn bench: {sorted(set(options) & model_only)} apply only with --model")
    for name in ("batch_sizes", "filled", "layouts"):
        if name in options:
            options[name] = tuple(options[name])
    if not args.options:
        run(**options)
        return 0
    if "generation_repeats" in options:
        raise SystemExit("kvattn bench: --generation-repeats does not apply to --options")
    layouts = options.pop("layouts", None)
    if layouts is not None:
        if len(layouts) != 1:
            raise SystemExit(f"kvattn bench: --options measures one layout; pass one to --layouts, got {list(layouts)}")
        options["layout"] = layouts[0]
    run_options(**options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
