# Two commands do everything from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A second environment with nothing but a plain `pip install .`, as a user gets it.
PLAIN := .venv-plain

.PHONY: demo test suite bench docs setup plain-install asan clean

setup: $(STAMP)

# Exact versions come from constraints.txt, so every clone installs the same thing. The editable
# install also compiles the native kernels in place (setup.py), again when their sources change.
# The build requirements go in first and the editable build uses them (--no-build-isolation): jaxlib
# is installed once, not again into a throwaway build environment. plain-install keeps pip's isolation.
#
# --no-compile: pip leaves each module's bytecode to its first import rather than compiling every file
# of every package at install (about 20 s of a fresh setup on two cores; most files are never imported).
$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard src/kvattn/kernels/native/*.cc src/kvattn/kernels/native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt 'setuptools>=68' wheel jaxlib
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt --no-build-isolation \
		-e '.[test,bench,generate,serve,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvattn demo

# The plain install and the docs site beside the suite (`-j2`: the plain
# install first, then the site; their pip runs wait on the disk, and the
# suite's last files leave a core idle, so they overlap well). The site runs
# no example: they are doctests in the suite. The suite runs a test file per
# core (pytest-xdist), so a file's compiled programs stay shared between its
# tests.
test: $(STAMP)
	$(MAKE) -j2 plain-install suite docs

suite: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

# The documentation site, into site/; --strict turns every warning (a broken
# link, a docstring the API pages cannot read) into a failure. Nothing is
# fetched at build time.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Built afresh every time, from a non-editable install: the README Quickstart
# must run with only the declared run-time dependencies. The wheel is built
# with .venv's build requirements (jaxlib for the native kernels' headers)
# rather than in a throwaway build environment that installs them again;
# the plain environment gets the wheel and its declared dependencies only.
plain-install: $(STAMP)
	rm -rf $(PLAIN) build/plain
	$(BIN)/python -m pip wheel --quiet --no-build-isolation --no-deps -w build/plain .
	$(PYTHON) -m venv $(PLAIN)
	$(PLAIN)/bin/python -m pip install --quiet --no-compile -c constraints.txt build/plain/kvattn-*.whl
	cd tools && ../$(PLAIN)/bin/python check_quickstart.py ../README.md

# The benchmarks live in benchmarks/ beside the package, not in the wheel; options: python -m benchmarks --help
bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The native kernels under AddressSanitizer: the working tree copied to build/asan, its extension built
# there with -fsanitize=address, and the kernel harness and the paged cache's tests run on it (libasan and
# libstdc++ preloaded: jaxlib throws C++ exceptions the sanitizer must intercept). Any report fails the run.
ASAN_FLAGS := -fsanitize=address -fno-omit-frame-pointer
asan: $(STAMP)
	rm -rf build/asan && mkdir -p build/asan
	git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C build/asan
	cd build/asan && CFLAGS="$(ASAN_FLAGS)" CXXFLAGS="$(ASAN_FLAGS)" LDFLAGS=-fsanitize=address \
		$(CURDIR)/$(BIN)/python setup.py --quiet build_ext --inplace
	cd build/asan && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so.6)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONPATH=src:. $(CURDIR)/$(BIN)/python -m pytest -q \
		-p no:cacheprovider tests/kernels/test_native.py tests/caches/test_paged.py -k "not registers_itself"

clean:
	rm -rf $(VENV) $(PLAIN) .pytest_cache .hypothesis bench-results build site src/kvattn/kernels/native/*.so
