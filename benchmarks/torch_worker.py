"""Scripts run by another Python, the one with torch (and transformers): neither is a kvattn dependency.

`run(python, body, args)` runs `body` after a preamble that reads `args`
(JSON, as `args`), imports the modules (or prints why it cannot, as
`{"unavailable": ...}`) and sets torch's threads to `args["threads"]`; the
script prints its result as JSON on its last line.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

__all__ = ["run"]

_PREAMBLE = """
import json, sys
args = json.loads(sys.argv[1])
try:
    import {modules}
except ImportError as error:
    print(json.dumps({{"unavailable": "{last} not installed (" + str(error) + ")"}}))
    sys.exit(0)
torch.set_num_threads(args["threads"])
"""


def run(python: str, body: str, args: dict[str, Any], modules: tuple[str, ...] = ("torch",)) -> dict[str, Any]:
    """The JSON `body` printed last under `python`, or `{"unavailable": why}` if it could not run or failed."""
    script = _PREAMBLE.format(modules=", ".join(modules), last=modules[-1]) + body
    try:
        done = subprocess.run([python, "-c", script, json.dumps(args)], capture_output=True, text=True, check=False)
    except OSError as error:
        return {"unavailable": f"cannot run {python}: {error}"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"unavailable": f"{python} failed ({done.returncode}): {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])
