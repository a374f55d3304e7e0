"""`python -m benchmarks` (`make bench`): the default contenders, or `--options`, `--model` or `--paged`.

Unset options take the defaults of `run`, `run_options`, `run_model` and `run_paged`.
"""

from __future__ import annotations

import argparse
import sys

from kvattn import extra
from kvattn.errors import MissingExtraError

MODEL_ONLY = ("dtypes", "prompt_len", "new_tokens", "num_layers", "torch_python", "torch_threads", "torch_compile",
              "llama_cpp", "checkpoint")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--in-features", type=int)
    parser.add_argument("--num-heads", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--filled", type=int, nargs="+", help="filled lengths T")
    parser.add_argument("--layouts", nargs="+")
    parser.add_argument("--dtype", help="cache storage dtype: float32, bfloat16 or int8")
    parser.add_argument("--repeats", type=int, help="timed repeats per figure (median reported)")
    parser.add_argument(
        "--generation-repeats", type=int, help="timed whole generations per contender at the smallest batch (0: none)"
    )
    parser.add_argument("--out-dir", help="where the JSON, Markdown and PNG files go (default: bench-results)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    suite = parser.add_mutually_exclusive_group()
    suite.add_argument(
        "--options",
        action="store_true",
        help="instead of the contenders, time kvattn.decode with rotary positions, QK-norm and bfloat16 compute "
        "against the plain layer (one layout; writes options.json, options.md)",
    )
    suite.add_argument(
        "--model",
        action="store_true",
        help="instead of the contenders, time whole-model decoding of a random Llama-shaped checkpoint (about 125M "
        "parameters) against transformers and a plain hand-rolled cache (writes model.json, model.md)",
    )
    suite.add_argument(
        "--paged",
        action="store_true",
        help="instead of the contenders, measure the paged cache against the contiguous one: memory, concurrency, "
        "forks, prefix-cache hits, decode steps at B=8 and host bookkeeping (writes paged.json, paged.md)",
    )
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "int8", "int4"),
                        help="--model only; int8, int4: int8 or 4-bit weights, float32 computation")
    parser.add_argument("--prompt-len", type=int, help="--model only")
    parser.add_argument("--new-tokens", type=int, help="--model only")
    parser.add_argument("--num-layers", type=int, help="--model only: fewer layers than 12")
    parser.add_argument("--torch-python", help="--model only: the Python that runs transformers (default: this one)")
    parser.add_argument("--torch-threads", type=int, help="--model only: torch.set_num_threads")
    parser.add_argument("--torch-compile", action="store_true", default=None,
                        help="--model only: also time transformers' static cache under torch.compile")
    parser.add_argument("--checkpoint", help="--model only: decode this Llama-family checkpoint directory instead "
                        "of the random 125M one (python -m tools.make_checkpoint makes 1B-class ones)")
    parser.add_argument("--llama-cpp", help="--model only: the folder of llama.cpp's binaries "
                        "(python -m tools.llama_cpp build) to time llama-server beside kvattn")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    options = {
        name: value for name, value in vars(args).items()
        if name not in ("options", "model", "paged") and value is not None
    }
    if args.paged and set(options) - {"repeats", "out_dir", "quick"}:
        parser.error(f"--paged takes --repeats, --out-dir and --quick, got {sorted(options)}")
    if args.model and set(options) - set(MODEL_ONLY) - {"batch_sizes", "repeats", "out_dir", "quick"}:
        parser.error(f"--model takes --batch-sizes, --repeats, --out-dir, --quick and the --model options, "
                     f"got {sorted(options)}")
    if not args.model and set(options) & set(MODEL_ONLY):
        parser.error(f"{sorted(set(options) & set(MODEL_ONLY))} apply only with --model")
    if args.options and "generation_repeats" in options:
        parser.error("--generation-repeats does not apply to --options")
    if args.options and len(options.get("layouts", [None])) != 1:
        parser.error(f"--options measures one layout; pass one to --layouts, got {options['layouts']}")
    try:
        for module in extra.BENCH_MODULES:
            extra.require(module)  # a missing extra fails before the measuring, not after it
    except MissingExtraError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    import benchmarks

    for name in ("batch_sizes", "filled", "layouts", "dtypes"):
        if name in options:
            options[name] = tuple(options[name])
    if args.paged:
        benchmarks.run_paged(**options)
    elif args.model:
        benchmarks.run_model(**options)
    elif args.options:
        if "layouts" in options:
            (options["layout"],) = options.pop("layouts")
        benchmarks.run_options(**options)
    else:
        benchmarks.run(**options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
