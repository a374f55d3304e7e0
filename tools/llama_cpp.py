"""llama.cpp, the CPU peer the benchmarks time kvattn against: built from the `llama-cpp-python` sdist, cached.

`build` downloads the `llama-cpp-python` source distribution from the
package registry (pip, no binaries), and builds the llama.cpp tree it
vendors with cmake (Release, `GGML_NATIVE`: this CPU's own instructions,
AVX-512, VNNI and BF16 here) into a cache folder named by the sdist's
version: `llama-server`, `llama-bench`, `llama-cli` and `llama-quantize`.
About 20 minutes on 2 cores, once; never in CI. It prints the folder of
the binaries.

`convert` turns a Hugging Face checkpoint folder into GGUF files with the
vendored `convert_hf_to_gguf.py` (its `gguf` package from the same tree;
it needs torch, transformers and sentencepiece): F32, BF16 and Q8_0
directly, Q4_0 by `llama-quantize` from the F32 file. It prints each
file's path. A tokenizer the converter does not recognise (the benchmarks'
own BPE) needs `--pre-tokenizer default`.

    python -m tools.llama_cpp build [--version 0.3.36] [--jobs 2]
    python -m tools.llama_cpp convert CHECKPOINT_DIR [--types f32 q8_0] [--pre-tokenizer default] [--python PY]

The benchmarks take the binaries' folder (`python -m benchmarks --model
--llama-cpp PATH`, `python -m benchmarks.serve --llama-server PATH`) and
check that llama.cpp's greedy tokens equal kvattn's before timing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

__all__ = ["BINARIES", "DEFAULT_VERSION", "build", "cache_root", "convert"]

DEFAULT_VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench", "llama-cli", "llama-quantize")
# What convert_hf_to_gguf.py writes itself; q4_0 is quantized from f32 by llama-quantize.
DIRECT_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZED_TYPES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


def cache_root() -> pathlib.Path:
    """Where builds and GGUF files are kept: `$KVATTN_CACHE` or `~/.cache/kvattn`, then `llama.cpp`."""
    return pathlib.Path(os.environ.get("KVATTN_CACHE", pathlib.Path.home() / ".cache" / "kvattn")) / "llama.cpp"


def _run(command: list[str], **kwargs) -> None:
    print("+", " ".join(map(str, command)), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, **kwargs)


def source(version: str) -> pathlib.Path:
    """The vendored llama.cpp tree of `llama-cpp-python==version`, downloaded and unpacked once."""
    root = cache_root() / version
    tree = root / "source" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "-d", scratch, f"llama-cpp-python=={version}"])
        (archive,) = pathlib.Path(scratch).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(archive) as sdist:
            sdist.extractall(root / "source", filter="data")
    if not (tree / "CMakeLists.txt").exists():
        raise RuntimeError(f"llama-cpp-python {version}'s sdist has no vendored llama.cpp at {tree}")
    return tree


def build(version: str = DEFAULT_VERSION, jobs: int | None = None) -> pathlib.Path:
    """The folder holding `BINARIES`, built once per version (Release, native CPU flags)."""
    bin_dir = cache_root() / version / "build" / "bin"
    if all((bin_dir / name).exists() for name in BINARIES):
        return bin_dir
    tree = source(version)
    build_dir = bin_dir.parent
    _run(["cmake", "-S", str(tree), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
          "-DBUILD_SHARED_LIBS=OFF"])
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1),
          "--target", *BINARIES])
    missing = [name for name in BINARIES if not (bin_dir / name).exists()]
    if missing:
        raise RuntimeError(f"the build finished without {missing} in {bin_dir}")
    return bin_dir


# Runs the vendored converter with its BPE pre-tokenizer named rather than recognised by hash (a tokenizer
# trained here, as the benchmarks' is, has a hash the converter does not know).
_NAMED_PRE_TOKENIZER = """
import runpy, sys
tree, name, *argv = sys.argv[1:]
sys.path.insert(0, tree)
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: name
sys.argv = [tree + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(checkpoint: str | os.PathLike, types=("f32", "q8_0"), version: str = DEFAULT_VERSION,
            python: str = sys.executable, pre_tokenizer: str | None = None) -> dict[str, pathlib.Path]:
    """GGUF files of a Hugging Face checkpoint folder, one per type, cached beside the build by the folder's name.

    `pre_tokenizer` names the BPE pre-tokenizer llama.cpp records (`"default"`, llama.cpp's plain split)
    where the converter would otherwise refuse a tokenizer it does not recognise; the benchmarks send
    llama.cpp token ids, never text, so it only shapes how llama.cpp would split text it is sent. The files
    are kept under the folder's name and a hash of its config and weights' size and time, so a rewritten
    checkpoint is converted again.
    """
    checkpoint = pathlib.Path(checkpoint).resolve()
    unknown = [kind for kind in types if kind not in DIRECT_TYPES and kind not in QUANTIZED_TYPES]
    if unknown:
        raise ValueError(f"types must be among {[*DIRECT_TYPES, *QUANTIZED_TYPES]}, got {unknown}")
    tree = source(version)
    stamp = hashlib.sha256((checkpoint / "config.json").read_bytes())
    for weights in sorted(checkpoint.glob("*.safetensors")):
        stamp.update(f"{weights.name} {weights.stat().st_size} {weights.stat().st_mtime_ns}".encode())
    out_dir = cache_root() / version / "gguf" / f"{checkpoint.name}-{stamp.hexdigest()[:12]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")])))
    paths = {}
    for kind in types:
        path = out_dir / f"{checkpoint.name}-{kind}.gguf"
        if not path.exists():
            partial = path.with_suffix(".partial")  # renamed once whole: an interrupted run leaves no file to reuse
            if kind in DIRECT_TYPES:
                arguments = [str(checkpoint), "--outtype", kind, "--outfile", str(partial)]
                if pre_tokenizer is None:
                    _run([python, str(tree / "convert_hf_to_gguf.py"), *arguments], env=env)
                else:
                    _run([python, "-c", _NAMED_PRE_TOKENIZER, str(tree), pre_tokenizer, *arguments], env=env)
            else:
                full = convert(checkpoint, ("f32",), version, python, pre_tokenizer)["f32"]
                _run([str(build(version) / "llama-quantize"), str(full), str(partial), QUANTIZED_TYPES[kind]])
            partial.replace(path)
        paths[kind] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    built = commands.add_parser("build", help="build llama.cpp's binaries (cached)")
    built.add_argument("--version", default=DEFAULT_VERSION)
    built.add_argument("--jobs", type=int)
    converted = commands.add_parser("convert", help="a checkpoint folder as GGUF files (cached)")
    converted.add_argument("checkpoint")
    converted.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    converted.add_argument("--version", default=DEFAULT_VERSION)
    converted.add_argument("--python", default=sys.executable,
                           help="an interpreter with torch, transformers and sentencepiece")
    converted.add_argument("--pre-tokenizer", help="the BPE pre-tokenizer to record (default) for a tokenizer "
                           "the converter does not recognise")
    args = parser.parse_args()
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed: apt-get install cmake, or pip install cmake")
    if args.command == "build":
        print(build(args.version, args.jobs))
    else:
        for kind, path in convert(args.checkpoint, args.types, args.version, args.python,
                                  args.pre_tokenizer).items():
            print(kind, path)


if __name__ == "__main__":
    main()
