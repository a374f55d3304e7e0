"""`kvattn demo` and `kvattn bench`: parse arguments, call the library by keyword."""

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

    bench = commands.add_parser("bench", help="benchmark decoding against Flax and recompute baselines")
    bench.add_argument("--in-features", type=int, default=512)
    bench.add_argument("--num-heads", type=int, default=8)
    bench.add_argument("--max-len", type=int, default=2048)
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    bench.add_argument("--filled", type=int, nargs="+", default=[128, 512, 1024, 2048], help="filled lengths T")
    bench.add_argument("--layouts", nargs="+", default=["slots_major", "heads_major"])
    bench.add_argument("--dtype", default="float32", help="cache storage dtype")
    bench.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median reported)")
    bench.add_argument("--out-dir", default="bench-results", help="where the JSON and PNG files go")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
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
    from kvattn.bench import run

    run(
        in_features=args.in_features,
        num_heads=args.num_heads,
        max_len=args.max_len,
        batch_sizes=tuple(args.batch_sizes),
        filled=tuple(args.filled),
        layouts=tuple(args.layouts),
        dtype=args.dtype,
        repeats=args.repeats,
        out_dir=args.out_dir,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
