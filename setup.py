"""Builds kvattn's native kernels (`kvattn.kernels.native.compiled`) beside the pure-Python package.

Everything else is declared in pyproject.toml. The extension is optional: where
it cannot be compiled (no C++ compiler, another platform) the package installs
without it and XLA runs what the kernels would (`kvattn.kernels.native`). It compiles against
the XLA FFI headers that jaxlib ships (a build requirement, not imported).
"""

import concurrent.futures
import glob
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_headers() -> str:
    """jaxlib's include directory (what `jax.ffi.include_dir()` returns), found without importing jax."""
    (location,) = importlib.util.find_spec("jaxlib").submodule_search_locations
    return os.path.join(location, "include")


class ParallelBuildExt(build_ext):
    """Compiles the kernels' files side by side, one per core: each is seconds of C++, and `make test` builds
    the extension twice (in place, and in the plain install's wheel)."""

    def build_extensions(self):
        compile_one = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                done = pool.map(lambda source: compile_one([source], *args, **kwargs), sources)
                return [obj for objects in done for obj in objects]

        self.compiler.compile = compile_all
        super().build_extensions()


setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=[
        Extension(
            "kvattn.kernels.native.compiled",
            # Every kernel is one .cc file that registers itself (native.h, `KVATTN_KERNEL`).
            sources=sorted(glob.glob("src/kvattn/kernels/native/*.cc")),
            include_dirs=["src", ffi_headers()],  # kvattn/kernels/native/native.h, xla/ffi/api/ffi.h
            depends=["src/kvattn/kernels/native/native.h"],
            extra_compile_args=["-O3", "-std=c++17"],
            language="c++",
            optional=True,
        )
    ]
)
