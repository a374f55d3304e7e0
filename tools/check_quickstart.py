"""Runs the README's Quickstart section as a doctest, with only the standard library.

`make test` calls it in a virtualenv that holds nothing but a plain
`pip install -c constraints.txt .`, so a run-time import that is not a
declared dependency fails here, as it would for a user.
"""

from __future__ import annotations

import doctest
import re
import sys
from pathlib import Path

# Extras that `import kvattn` must never load. (Flax itself imports rich, so
# only what kvattn adds beyond `flax.nnx` counts.)
HEAVY = ("matplotlib", "rich", "tqdm", "pytest", "hypothesis", "torch", "transformers")


def heavy_modules() -> set[str]:
    return {m for m in sys.modules if m.split(".")[0] in HEAVY}


def quickstart(readme: Path) -> str:
    text = readme.read_text()
    match = re.search(r"^## Quickstart\n(.*?)^## ", text, flags=re.S | re.M)
    if match is None:
        raise SystemExit(f"{readme} has no '## Quickstart' section")
    return "\n".join(re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S))


def main() -> int:
    readme = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    source = quickstart(readme)
    from flax import nnx  # noqa: F401

    baseline = heavy_modules()
    test = doctest.DocTestParser().get_doctest(source, {}, "README Quickstart", str(readme), 0)
    if not test.examples:
        raise SystemExit("the Quickstart section holds no doctest examples")
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test)
    loaded = sorted(heavy_modules() - baseline)
    if loaded:
        print(f"import kvattn loaded optional modules: {loaded}")
        return 1
    failed, attempted = runner.summarize(verbose=False)
    print(f"README Quickstart in a plain install: {attempted - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
