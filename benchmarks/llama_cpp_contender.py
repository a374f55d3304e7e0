"""llama.cpp as a contender of `python -m benchmarks --model`: `llama-server` on the same checkpoint as GGUF.

`tools.llama_cpp` builds the binaries (from the `llama-cpp-python` sdist)
and converts the checkpoint (`GGUF_TYPES`: float32 as F32, bfloat16 as
BF16, int8 as Q8_0). One `llama-server` per (dtype, batch) stays up on
127.0.0.1 with `--parallel B` slots and the benchmark's thread count; a
timed call sends the B prompts as token ids to `/completion` at once,
greedy (`temperature` 0), without prompt caching (each call processes its
prompt, as every other contender's does) and ignoring end-of-sequence, and
returns llama.cpp's tokens, which `benchmarks.model` compares with
kvattn's before the figures mean anything. llama-bench would time the same
kernels but return no tokens to check.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["GGUF_TYPES", "LlamaServer"]

# The GGUF each benchmark dtype is compared against.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """A `llama-server` holding one GGUF with `len(prompts)` slots; `once(n)` times `n` new tokens for every prompt.

    Args:
      bin_dir: the folder of llama.cpp's binaries (`python -m tools.llama_cpp build` prints it).
      gguf: the model file.
      prompts: `(B, P)` token ids, one request each.
      new_tokens: the most tokens a call asks for (sizes the context).
      threads: llama.cpp's threads for generation and prompt processing.
      ready_timeout: seconds the server may take to load.
    """

    def __init__(self, bin_dir: str | Path, gguf: str | Path, prompts, new_tokens: int, threads: int,
                 ready_timeout: float = 300.0):
        self.prompts = [[int(t) for t in row] for row in prompts]
        batch, length = len(self.prompts), len(self.prompts[0])
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.version = None
        command = [str(Path(bin_dir) / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                   "--port", self.url.rsplit(":", 1)[1], "-t", str(threads), "-tb", str(threads),
                   "--parallel", str(batch), "-c", str(batch * (length + new_tokens + 8)), "--no-webui",
                   "--log-disable"]
        self._log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty server would fill it and stall
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.process.poll() is not None:
                self._log.seek(0)
                log = self._log.read()[-4000:]
                self._log.close()
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"llama-server was not ready within {ready_timeout} s")
            time.sleep(0.2)
        with urllib.request.urlopen(self.url + "/props", timeout=5) as response:
            props = json.load(response)
        self.version = props.get("build_info")
        self._pool = concurrent.futures.ThreadPoolExecutor(batch)
        self.once(2)  # warm-up, untimed

    def _complete(self, prompt: list[int], count: int) -> list[int]:
        body = {"prompt": prompt, "n_predict": count, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": True, "return_tokens": True, "stream": False}
        request = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            tokens = json.load(response)["tokens"]
        if len(tokens) != count:
            raise RuntimeError(f"llama-server returned {len(tokens)} tokens where {count} were asked for")
        return tokens

    def once(self, count: int):
        """Seconds for every prompt's `count` new tokens, requested at once, and the tokens `(B, count)`."""
        started = time.perf_counter()
        tokens = list(self._pool.map(lambda prompt: self._complete(prompt, count), self.prompts))
        return time.perf_counter() - started, tokens

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
