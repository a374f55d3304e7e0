"""The transformers contenders of `python -m benchmarks --model`: its `generate` in a worker process that stays up.

torch is no kvattn dependency: the worker runs under another interpreter
(`--torch-python`), loads the checkpoint with transformers, warms every
variant up, then times one generation per request read from its stdin, so
its calls interleave with kvattn's (`benchmarks.model`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["CACHES", "COMPILED", "Transformers"]

_WORKER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
try:
    import torch, transformers
except ImportError as error:
    print(json.dumps({"unavailable": f"transformers not installed ({error})"}), flush=True)
    sys.exit(0)
torch.set_num_threads(args["threads"])
compact = args["dtype"] == "int8"
model = transformers.AutoModelForCausalLM.from_pretrained(
    args["checkpoint"], dtype=torch.float32 if compact else getattr(torch, args["dtype"]))
model.eval()
if compact:
    model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
prompts = torch.tensor(args["prompts"], dtype=torch.long)
mask = torch.ones_like(prompts)
plain = model.forward
forwards = {False: plain}
def once(name, count):
    cache, compiled = args["caches"][name]
    if compiled not in forwards:  # compiled once, kept for every later call
        forwards[compiled] = torch.compile(plain, mode="reduce-overhead", fullgraph=True)
    model.forward = forwards[compiled]
    options = dict(max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0)
    if cache:
        options["cache_implementation"] = cache
    start = time.perf_counter()
    with torch.inference_mode():
        tokens = model.generate(prompts, attention_mask=mask, **options)
    return time.perf_counter() - start, tokens[:, prompts.shape[1]:].tolist()
unavailable = {}
for name in args["caches"]:
    try:
        once(name, 1), once(name, args["new_tokens"])  # warm-up (and compilation), untimed
    except Exception as error:
        unavailable[name] = f"{type(error).__name__}: {error}"[:300]
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "unavailable": unavailable}),
      flush=True)
for line in sys.stdin:
    request = json.loads(line)
    seconds, tokens = once(request["name"], request["count"])
    print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
"""

# name: (cache_implementation, whether the forward goes through torch.compile)
CACHES = {"transformers_dynamic": (None, False), "transformers_static": ("static", False)}
COMPILED = {"transformers_static_compiled": ("static", True)}


class Transformers:
    """transformers' `generate` on the checkpoint in a worker process run by `python` (torch is no kvattn dependency).

    The worker loads the model, warms every variant up, then times one
    generation per request, so its calls interleave with kvattn's. `unavailable`
    maps a variant (or every one, when the worker cannot start) to why.
    """

    def __init__(self, python: str, checkpoint: Path, prompts, dtype: str, new_tokens: int, threads: int,
                 caches: dict):
        args = {"checkpoint": str(checkpoint), "prompts": np.asarray(prompts).tolist(), "dtype": dtype,
                "new_tokens": new_tokens, "threads": threads, "caches": caches}
        self.caches, self.versions, self.unavailable, self.process = caches, None, {}, None
        try:
            self.process = subprocess.Popen([python, "-c", _WORKER, json.dumps(args)], text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as error:
            self.unavailable = dict.fromkeys(caches, f"cannot run {python}: {error}")
            return
        ready = self._reply()
        if ready is None or "unavailable" in ready and isinstance(ready["unavailable"], str):
            reason = ready["unavailable"] if ready else f"{python} failed: {self._stderr()}"
            self.unavailable = dict.fromkeys(caches, reason)
            self.close()
            return
        self.versions = f"torch {ready['torch']}, transformers {ready['transformers']}"
        self.unavailable = ready["unavailable"]

    @property
    def variants(self) -> list[str]:
        """The variants that warmed up and can be timed."""
        return [] if self.versions is None else [name for name in self.caches if name not in self.unavailable]

    def once(self, name: str, count: int):
        self.process.stdin.write(json.dumps({"name": name, "count": count}) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        if reply is None:
            raise RuntimeError(f"the transformers worker stopped: {self._stderr()}")
        return reply["seconds"], reply["tokens"]

    def _reply(self):
        line = self.process.stdout.readline()
        return json.loads(line) if line.strip() else None

    def _stderr(self) -> str:
        """The end of what the worker wrote to stderr, once it has exited."""
        self.process.wait(timeout=60)
        return self.process.stderr.read().strip()[-300:]

    def close(self):
        """Ends the worker (its input closed, it exits) and closes its pipes."""
        if self.process is None:
            return
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.process.stderr.close()
        self.process = None
