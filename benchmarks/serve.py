"""`python -m benchmarks.serve`: `kvattn serve` under load, side by side with `transformers serve`, one run.

Each contender in turn is started as a subprocess on 127.0.0.1 (a free port),
waited for (`/health`, then `/v1/models` names the model), warmed up with
untimed requests, driven through every request rate, and stopped (SIGTERM,
SIGKILL after a timeout):

  kvattn            `kvattn serve` on the paged engine, prefix caching on
  kvattn-no-prefix  the same with `--no-prefix-caching`
  kvattn-int8       `kvattn serve --weights int8`, prefix caching on
  transformers      `transformers serve --continuous-batching --device cpu
                    --dtype float32`, its KV pool as many tokens as kvattn's
  llama-server      llama.cpp's `llama-server` on the checkpoint as an F32
                    GGUF, `--parallel` the batch, each slot `max_len` tokens,
                    the machine's cores as threads, its prompt cache on
  llama-server-q8_0 the same on the Q8_0 GGUF (against kvattn-int8)

The llama.cpp contenders need `--llama-server BIN_DIR` (`python -m
tools.llama_cpp build` prints it); the GGUF files are converted once and
cached (`tools.llama_cpp.convert`, with `--gguf-python`, an interpreter with
torch and transformers). Send them `--endpoint completions-ids`: each prompt
as the checkpoint tokenizer's ids of the text, so every server decodes from
the same ids whatever its own tokenizer would make of the text.

All serve the checkpoint of `benchmarks.serve_checkpoint`: `benchmarks.model`'s
random 125M Llama and a tokenizer of its vocabulary.

Workload, seeded: requests arrive as a Poisson process at each rate (`inf`:
all at once). Prompt lengths and `max_tokens` are uniform in their ranges;
the prompts are windows of the repository's text (the tokenizer's training
text, kept in the cache directory the first time: `kept_corpus`, so runs
sharing a cache send the same prompts while the repository changes) cut
to the drawn token count. A share of the requests (half by
default), chosen at random, start with one shared system prompt, so prefix
caching has something to hit. Each rate draws fresh requests (only the system
prompt repeats), so no cache can hit a whole prompt sent at an earlier rate.
Decoding is greedy. The request bodies (and for `completions-ids` the
prompts' ids) are made before a rate's first send. `max_tokens` is the length asked: a server may stop
earlier at the eos token (one id of 32000, rare for a random model), so the
output tokens counted are those the server reports in `usage`, or else the
streamed chunks that carry text.

Per request, from its stream (timed from the send): TTFT, the first chunk
with text; ITL, the gaps between chunks with text; TPOT, (end - TTFT) /
(output tokens - 1); end-to-end latency; and its finishes. It is completed
with exactly one finish and no error; failed on an HTTP error, a timeout, an
error chunk or a stream that ended without a finish (lost); duplicated with
more than one finish or `[DONE]`, or a completion id another request also
got. Per rate: those counts, output tokens per second over the rate's wall
time (the first send to the last stream's end), p50/p99 of each latency, and,
where the server's `/metrics` counts them (kvattn), the share of admitted
prompt tokens its prefix cache held. Decoding is greedy on one checkpoint, so
each contender's texts are compared with the first's: equal texts show the
servers computed the same thing.

With `--generate`, `kvattn.generation.generate` also runs the saturation
rate's requests (the same ids and `max_tokens`), `--max-batch` at a time in
fixed batches, for each kvattn contender's weights
(`benchmarks.serve_generate`, a subprocess, after the servers): #36 holds the
server's throughput at saturation to at least 0.8x of it.

Writes `serve.json` (config, machine, versions, commands, every request),
`serve.md` (the tables and the targets) and `serve.png` (TTFT, TPOT and
throughput against the rate) to `--out-dir`; the checkpoint and the servers'
logs go to `--cache-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import load_average, machine_info, source_revision, versions
from benchmarks.report import table, target, targets_table, write
from kvattn.extra import require

__all__ = [
    "LoadConfig", "Outcome", "Pool", "Request", "arrivals", "cached_share", "make_workload", "mark_agreement",
    "parse_metrics",
    "percentile", "plot_serve", "request_body", "run_serve", "serve_markdown", "summarize", "targets", "text_window",
]

CONTENDERS = ("kvattn", "kvattn-no-prefix", "kvattn-int8", "transformers", "llama-server", "llama-server-q8_0")
DEFAULT_CONTENDERS = ("kvattn", "kvattn-no-prefix", "transformers")
# The GGUF type each llama.cpp contender serves.
LLAMA_SERVER_TYPES = {"llama-server": "f32", "llama-server-q8_0": "q8_0"}
# The throughput targets at saturation: (kvattn's contender, the peer, the least ratio).
THROUGHPUT_TARGETS = (("kvattn", "transformers", 2.0), ("kvattn", "llama-server", 1.5),
                      ("kvattn-int8", "llama-server-q8_0", 1.5))
# The kvattn contenders `generate` is timed for (`--generate`), their weights, and the least ratio to it.
GENERATE_WEIGHTS = {"kvattn": None, "kvattn-int8": "int8", "kvattn-no-prefix": None}
GENERATE_TARGET = 0.8
# This machine's transformers environment (torch and `transformers[serving]`); `--transformers` names another.
DEFAULT_TRANSFORMERS = "/work/venv-hf/bin/transformers"
QUICK_MODEL = {"vocab_size": 32000, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "intermediate_size": 128}


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """The workload: request rates, counts and length ranges (inclusive), and the client's limits."""

    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, math.inf)
    num_requests: int = 32
    prompt_tokens: tuple[int, int] = (32, 256)
    output_tokens: tuple[int, int] = (16, 64)
    system_tokens: int = 512
    system_share: float = 0.5
    warmup_requests: int = 8
    endpoint: str = "chat"
    seed: int = 0
    request_timeout_s: float = 600.0
    rate_deadline_s: float = 900.0


@dataclasses.dataclass(frozen=True)
class Pool:
    """The KV pool every contender gets: kvattn's pages, and as many tokens in transformers' blocks."""

    num_pages: int = 2048
    page_size: int = 16
    max_batch: int = 32
    max_len: int = 1024
    transformers_page_size: int = 256

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def transformers_blocks(self) -> int:
        return math.ceil(self.tokens / self.transformers_page_size)


# ---- The workload -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: its user text (`user_tokens` long), whether the shared system prompt precedes it, `max_tokens`."""

    index: int
    user: str
    user_tokens: int
    system: bool
    max_tokens: int


def arrivals(num_requests: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds of a Poisson process at `rate` requests per second, the first at 0; all 0 at `inf`."""
    if rate <= 0:
        raise ValueError(f"rate must be positive (inf: all at once), got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.exponential(1.0 / rate, num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def text_window(stream: Sequence[int], length: int, encode: Callable[[str], list[int]],
                decode: Callable[[Sequence[int]], str], rng: np.random.Generator) -> tuple[str, int]:
    """A random window of `length` tokens of `stream` as text, and its token count when encoded again.

    Decoding and encoding again can split tokens at the window's edges; the
    window loses tokens from its end, one at a time, until it encodes to at
    most `length`.
    """
    if len(stream) <= length:
        raise ValueError(f"the text has {len(stream)} tokens, fewer than a {length}-token prompt needs")
    start = int(rng.integers(0, len(stream) - length))
    ids = list(stream[start : start + length])
    while True:
        text = decode(ids)
        count = len(encode(text))
        if count <= length or len(ids) == 1:
            return text, count
        ids = ids[:-1]


def make_workload(stream: Sequence[int], encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                  *, num_requests: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                  system_share: float, rng: np.random.Generator) -> list[Request]:
    """`num_requests` requests, lengths uniform in the (inclusive) ranges; `round(system_share * n)` carry the system prompt."""
    with_system = set(rng.permutation(num_requests)[: round(system_share * num_requests)].tolist())
    requests = []
    for index in range(num_requests):
        length = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        user, count = text_window(stream, length, encode, decode, rng)
        max_tokens = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        requests.append(Request(index, user, count, index in with_system, max_tokens))
    return requests


def request_body(request: Request, system: str, *, endpoint: str, model: str,
                 encode: Callable[[str], list[int]] | None = None) -> dict[str, Any]:
    """The streaming, greedy OpenAI request: chat messages; for `completions` the system text and user text joined,
    and for `completions-ids` that text as `encode` gives its ids."""
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        messages = [{"role": "system", "content": system}] if request.system else []
        return {**body, "messages": [*messages, {"role": "user", "content": request.user}]}
    text = (system if request.system else "") + request.user
    if endpoint == "completions-ids":
        if encode is None:
            raise ValueError("the completions-ids endpoint needs the tokenizer's encode")
        return {**body, "prompt": encode(text)}
    return {**body, "prompt": text}


# ---- The client -------------------------------------------------------------------------------------------------


def _http():
    """The async HTTP client library: httpx, or httpx2 (its successor, which openai 3 brings)."""
    for name in ("httpx", "httpx2"):
        with contextlib.suppress(ImportError):
            return __import__(name)
    raise ImportError("the serve benchmark needs httpx or httpx2: pip install openai (which brings one)")


@dataclasses.dataclass
class Outcome:
    """What one request got; times in seconds from its send."""

    index: int
    system: bool
    user_tokens: int
    max_tokens: int
    sent_s: float | None = None
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finishes: int = 0
    finish_reason: str | None = None
    done_markers: int = 0
    ids: list[str] = dataclasses.field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def read(self, chunk: dict[str, Any], at_s: float) -> None:
        """Takes in one streamed chunk (chat or completions), received `at_s` after the send."""
        if "error" in chunk:
            self.error = f"error chunk: {json.dumps(chunk['error'])[:300]}"
            return
        if chunk.get("id") and chunk["id"] not in self.ids:
            self.ids.append(chunk["id"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            text = (delta or {}).get("content") if "delta" in choice else choice.get("text")
            if text:
                self.chunk_s.append(at_s)
                self.text += text
                if self.ttft_s is None:
                    self.ttft_s = at_s
            if choice.get("finish_reason"):
                self.finishes += 1
                self.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.completion_tokens = usage.get("completion_tokens")


async def send(client, url: str, body: dict[str, Any], outcome: Outcome, timeout_s: float) -> None:
    """Streams one request into `outcome`; every failure becomes `outcome.error`, none is raised."""
    http = _http()
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    detail = (await response.aread())[:300].decode(errors="replace")
                    outcome.error = f"HTTP {response.status_code}: {detail}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data, at_s = line[len("data:") :].strip(), time.perf_counter() - started
                    if data == "[DONE]":
                        outcome.done_markers += 1
                    else:
                        outcome.read(json.loads(data), at_s)
        outcome.end_s = time.perf_counter() - started
        if outcome.error is None and outcome.finishes == 0:
            outcome.error = "lost: the stream ended without a finish"
    except TimeoutError:
        outcome.error = f"timed out after {timeout_s:g} s"
    except (http.HTTPError, http.StreamError, OSError, ValueError) as error:  # ValueError: a chunk that is not JSON
        outcome.error = f"{type(error).__name__}: {error}"[:300]


async def drive(base_url: str, model: str, requests: list[Request], system: str, send_at: np.ndarray, *,
                endpoint: str, request_timeout_s: float, deadline_s: float,
                encode: Callable[[str], list[int]] | None = None) -> tuple[list[Outcome], float]:
    """Sends each request at its time in `send_at`; returns the outcomes and the wall time (first send to last end).

    Requests still running at `deadline_s` are cancelled and failed.
    """
    http = _http()
    url = base_url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    bodies = [request_body(r, system, endpoint=endpoint, model=model, encode=encode) for r in requests]
    outcomes = [Outcome(r.index, r.system, r.user_tokens, r.max_tokens) for r in requests]
    limits = http.Limits(max_connections=None, max_keepalive_connections=None)
    async with http.AsyncClient(timeout=http.Timeout(request_timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(body: dict[str, Any], outcome: Outcome, at_s: float) -> None:
            await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
            outcome.sent_s = time.perf_counter() - start
            await send(client, url, body, outcome, request_timeout_s)

        tasks = [asyncio.create_task(one(b, o, float(at))) for b, o, at in zip(bodies, outcomes, send_at)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for outcome in outcomes:
        if outcome.end_s is None and outcome.error is None:
            outcome.error = f"lost: still running at the rate's deadline of {deadline_s:g} s"
    ends = [o.sent_s + o.end_s for o in outcomes if o.end_s is not None]
    return outcomes, (deadline_s if pending else max(ends, default=0.0))


# ---- The servers ------------------------------------------------------------------------------------------------


class ServerFailed(RuntimeError):
    """A contender that did not start, or died."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(name: str, *, port: int, checkpoint: Path, pool: Pool, kvattn: str, transformers: str,
                   extra_args: dict[str, list[str]], llama_server: Path | None = None,
                   ggufs: dict[str, Path] | None = None, threads: int | None = None) -> list[str]:
    """The command line that serves `checkpoint` as contender `name` on 127.0.0.1:`port`.

    The llama.cpp contenders take the folder of llama.cpp's binaries (`llama_server`), the GGUF file of each
    type (`ggufs`, keys of `LLAMA_SERVER_TYPES`' values) and the threads to run on (default: every core).
    """
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if name in ("kvattn", "kvattn-no-prefix", "kvattn-int8"):
        command = [*shlex.split(kvattn), "serve", str(checkpoint), *where, "--num-pages", str(pool.num_pages),
                   "--page-size", str(pool.page_size), "--max-batch", str(pool.max_batch),
                   "--max-len", str(pool.max_len)]
        if name == "kvattn-no-prefix":
            command.append("--no-prefix-caching")
        if name == "kvattn-int8":
            command += ["--weights", "int8"]
        return [*command, *extra_args.get("kvattn", [])]
    if name == "transformers":
        # The positional model pins the server to the directory; float32 as kvattn computes.
        return [*shlex.split(transformers), "serve", str(checkpoint), "--continuous-batching", "--device", "cpu",
                "--dtype", "float32", *where, "--cb-block-size", str(pool.transformers_page_size),
                "--cb-num-blocks", str(pool.transformers_blocks), *extra_args.get("transformers", [])]
    if name in LLAMA_SERVER_TYPES:
        if llama_server is None or ggufs is None or LLAMA_SERVER_TYPES[name] not in ggufs:
            raise ValueError(f"{name} needs the folder of llama.cpp's binaries and its {LLAMA_SERVER_TYPES[name]} "
                             "GGUF file (--llama-server)")
        threads = str(threads or os.cpu_count() or 1)
        # Each of the --parallel slots gets an equal share of the context: max_len tokens, as a kvattn sequence.
        return [str(Path(llama_server) / "llama-server"), "-m", str(ggufs[LLAMA_SERVER_TYPES[name]]), *where,
                "--parallel", str(pool.max_batch), "-c", str(pool.max_batch * pool.max_len), "-t", threads,
                "-tb", threads, "--no-webui", *extra_args.get("llama-server", [])]
    raise ValueError(f"unknown contender {name!r}; the contenders are {', '.join(CONTENDERS)}")


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident memory (VmHWM) in MB, where /proc tells it."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


@contextlib.contextmanager
def running(command: list[str], log_path: Path, stop_timeout_s: float = 60.0) -> Iterator[subprocess.Popen]:
    """Runs `command` in its own process group, output to `log_path`; SIGTERM on leaving, SIGKILL after a timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(stop_timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> str:
    """Waits for `/health` to answer 200; returns the first model `/v1/models` lists."""
    http = _http()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"exited with code {process.returncode} before it was ready")
        with contextlib.suppress(http.HTTPError):
            if http.get(base_url + "/health", timeout=60).status_code == 200:
                models = http.get(base_url + "/v1/models", timeout=60)
                try:
                    return models.json()["data"][0]["id"]
                except (ValueError, KeyError, IndexError, TypeError) as error:
                    raise ServerFailed(f"/v1/models answered {models.status_code}, no model: {models.text[:200]}") \
                        from error
        time.sleep(1.0)
    raise ServerFailed(f"not ready after {timeout_s:g} s")


def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """The server's Prometheus `/metrics` samples (histogram buckets left out), None where it has none."""
    http = _http()
    try:
        response = http.get(base_url + "/metrics", timeout=30)
    except http.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as `{name with labels: value}`, histogram buckets left out."""
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#") and "_bucket" not in name:
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


def cached_share(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """The share of admitted prompt tokens the server's prefix cache held between two scrapes, where it counts them."""
    if before is None or after is None:
        return None

    def grown(suffix: str) -> float | None:
        names = [name for name in after if name.endswith(suffix)]
        return after[names[0]] - before.get(names[0], 0.0) if len(names) == 1 else None

    cached, admitted = grown("prompt_tokens_cached_total"), grown("prompt_tokens_total")
    return None if cached is None or not admitted else cached / admitted


# ---- The figures ------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (linear interpolation, as numpy's default), None of no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def output_tokens(outcome: dict[str, Any]) -> int:
    """The tokens a request got: the server's `usage.completion_tokens`, else its chunks with text."""
    reported = outcome["completion_tokens"]
    return reported if reported is not None else len(outcome["chunk_s"])


def summarize(outcomes: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One rate's figures from its outcomes (as `dataclasses.asdict` gives them); latencies in ms."""
    id_counts = Counter(i for o in outcomes for i in o["ids"])
    duplicated = [o for o in outcomes
                  if o["finishes"] > 1 or o["done_markers"] > 1 or any(id_counts[i] > 1 for i in o["ids"])]
    completed = [o for o in outcomes if o["error"] is None and o["finishes"] == 1]
    lost = [o for o in outcomes if (o["error"] or "").startswith(("lost", "timed out"))]
    tokens = [output_tokens(o) for o in completed]
    ttft = [1e3 * o["ttft_s"] for o in completed if o["ttft_s"] is not None]
    tpot = [1e3 * (o["end_s"] - o["ttft_s"]) / (n - 1) for o, n in zip(completed, tokens)
            if n > 1 and o["ttft_s"] is not None]
    itl = [1e3 * gap for o in completed for gap in np.diff(o["chunk_s"]).tolist()]
    e2e = [1e3 * o["end_s"] for o in completed]
    summary = {
        "requests": len(outcomes), "completed": len(completed), "failed": len(outcomes) - len(completed),
        "lost": len(lost), "duplicated": len(duplicated),
        "errors": sorted(Counter(o["error"].split(":")[0] for o in outcomes if o["error"]).items()),
        "wall_s": wall_s, "output_tokens": sum(tokens),
        "output_tokens_per_s": sum(tokens) / wall_s if wall_s > 0 else None,
        "output_tokens_min": min(tokens, default=None), "output_tokens_max": max(tokens, default=None),
        "stopped_early": sum(n < o["max_tokens"] for o, n in zip(completed, tokens)),
        "usage_reported": sum(o["completion_tokens"] is not None for o in completed),
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        summary[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}
    for label, system in (("system", True), ("no_system", False)):
        summary[f"ttft_{label}_p50_ms"] = percentile(
            [1e3 * o["ttft_s"] for o in completed if o["system"] is system and o["ttft_s"] is not None], 50)
    return summary


def mark_agreement(rows: list[dict[str, Any]]) -> None:
    """Adds to each rate's summary how many requests got the same text as from the first contender that ran.

    Greedy decoding of one checkpoint: equal texts show the servers computed
    the same thing, so their times compare like for like.
    """
    ran = [row for row in rows if "rates" in row]
    if not ran:
        return
    reference = {(m["rate"], o["index"]): o["text"] for m in ran[0]["rates"] for o in m["requests"]
                 if o["error"] is None}
    for row in ran:
        for measured in row["rates"]:
            both = [o for o in measured["requests"] if o["error"] is None and (measured["rate"], o["index"]) in reference]
            same = sum(o["text"] == reference[(measured["rate"], o["index"])] for o in both)
            measured["summary"]["same_text"] = {"as": ran[0]["contender"], "count": same, "of": len(both)}


def _figure(results: dict[str, Any], contender: str, rate: float, read: Callable[[dict], float | None]):
    """`read(summary)` of one contender at one rate, None where it did not run."""
    for row in results["contenders"]:
        if row["contender"] == contender:
            for measured in row.get("rates", []):
                if measured["rate"] == rate:
                    return read(measured["summary"])
    return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' targets: throughput and p99 TPOT against transformers' and llama.cpp's servers (float32 against
    F32, int8 against Q8_0, where both ran), prefix caching's TTFT, no loss.

    Saturation is the highest rate; the TTFT target holds at the lowest rate,
    where queueing adds least to the prompt's processing (other rates are
    reported).
    """
    rates = results["config"]["rates"]
    rows = []
    ran = {row["contender"] for row in results["contenders"] if "rates" in row}
    # The transformers pair is always reported (unmeasured where it did not run); a llama.cpp pair where both ran.
    pairs = [(ours, peer, least) for ours, peer, least in THROUGHPUT_TARGETS
             if peer == "transformers" or {ours, peer} <= ran]
    for ours, peer, least in pairs:
        tokens_per_s = [_figure(results, name, rates[-1], lambda s: s["output_tokens_per_s"]) for name in (ours, peer)]
        rows.append(target(f"output tokens/s at saturation, {ours} / {peer}", _ratio(*tokens_per_s), ">=", least,
                           rate=rates[-1]))
    for ours, peer, _ in pairs:
        for rate in rates:
            tpot = [_figure(results, name, rate, lambda s: s["tpot_ms"]["p99"]) for name in (ours, peer)]
            rows.append(target(f"p99 TPOT, {ours} / {peer}", _ratio(*tpot), "<=", 1.0, rate=rate))
    for rate in rates:
        ttft = [_figure(results, name, rate, lambda s: s["ttft_system_p50_ms"])
                for name in ("kvattn-no-prefix", "kvattn")]
        rows.append(target("p50 TTFT with the system prompt, no prefix caching / prefix caching", _ratio(*ttft),
                           ">=", 5.0 if rate == rates[0] else None, rate=rate))
    for ours, reference in results.get("generate", {}).items():
        served = _figure(results, ours, rates[-1], lambda s: s["output_tokens_per_s"])
        rows.append(target(f"output tokens/s at saturation, {ours} / generate in batches of "
                           f"{results['config']['pool']['max_batch']}",
                           _ratio(served, reference.get("output_tokens_per_s")), ">=", GENERATE_TARGET,
                           rate=rates[-1]))
    for row in results["contenders"]:
        if "rates" in row:
            bad = sum(m["summary"]["lost"] + m["summary"]["duplicated"] for m in row["rates"])
            rows.append(target(f"lost or duplicated requests, {row['contender']}", bad, "<=", 0, rate="all"))
    return rows


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _agreement(summary: dict[str, Any], contender: str) -> str:
    same = summary.get("same_text")
    if same is None or same["as"] == contender:
        return "—"
    return f"{same['count']}/{same['of']}"


def serve_markdown(results: dict[str, Any]) -> str:
    """The run's tables: per rate and contender the counts, throughput and latencies; then the targets."""
    config = results["config"]
    body, unavailable = [], []
    for rate in config["rates"]:
        for row in results["contenders"]:
            if "unavailable" in row:
                continue
            (measured,) = [m for m in row["rates"] if m["rate"] == rate] or [None]
            if measured is None:
                continue
            s = measured["summary"]
            tokens = f"{s['output_tokens']} ({s['output_tokens_min']}–{s['output_tokens_max']})"
            body.append([
                _rate(rate), row["contender"], f"{s['completed']}/{s['failed']}/{s['duplicated']}",
                tokens, "—" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.1f}",
                *(f"{_ms(s[k]['p50'])} / {_ms(s[k]['p99'])}" for k in ("ttft_ms", "tpot_ms", "itl_ms")),
                f"{_ms(s['ttft_system_p50_ms'])} / {_ms(s['ttft_no_system_p50_ms'])}",
                "—" if s.get("prompt_tokens_cached_share") is None else f"{s['prompt_tokens_cached_share']:.0%}",
                _agreement(s, row["contender"]),
            ])
    for row in results["contenders"]:
        if "unavailable" in row:
            unavailable.append(f"- `{row['contender']}` unavailable: {row['unavailable']}")
    header = ["rate (req/s)", "contender", "done/failed/dup", "output tokens (min–max)", "output tok/s",
              "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "ITL p50 / p99 ms", "TTFT p50 system / none ms",
              "prompt tokens cached", "same text as the first"]
    low, high = config["prompt_tokens"]
    out_low, out_high = config["output_tokens"]
    lines = [
        (f"{config['num_requests']} requests per rate, Poisson arrivals, `{config['endpoint']}` endpoint, streaming, "
         f"greedy; prompts {low}–{high} tokens, `max_tokens` {out_low}–{out_high}; "
         f"{config['system_share']:.0%} of requests start with a shared {config['system_tokens']}-token system "
         f"prompt. KV pool {config['pool']['tokens']} tokens (kvattn: {config['pool']['num_pages']} pages of "
         f"{config['pool']['page_size']}, batch {config['pool']['max_batch']}; transformers: "
         f"{config['pool']['transformers_blocks']} blocks of {config['pool']['transformers_page_size']}; "
         f"llama-server: {config['pool']['max_batch']} slots of {config['pool']['max_len']} tokens)."),
        "",
        *table(header, body),
        "",
        *unavailable,
        *[f"- `generate` in batches of {config['pool']['max_batch']} on the saturation rate's requests, as "
          f"`{ours}` weighs them: " + (f"{g['output_tokens']} output tokens in {g['seconds']:.1f} s, "
                                       f"{g['output_tokens_per_s']:.1f} tok/s" if "seconds" in g else
                                       f"unavailable: {g.get('unavailable')}")
          for ours, g in results.get("generate", {}).items()],
        "",
        "### Targets",
        "",
        *targets_table(results["targets"], {"rate": "rate"}),
    ]
    return "\n".join(lines) + "\n"


def plot_serve(results: dict[str, Any], path: Path) -> None:
    """TTFT and TPOT (p50 solid, p99 dashed) and output tokens/s against the request rate, one line per contender."""
    Figure = require("matplotlib.figure").Figure
    rates = results["config"]["rates"]
    positions = list(range(len(rates)))  # `inf` has no place on a numeric axis: the rates are categories
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    axes = figure.subplots(1, 3)
    panels = (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"))
    for ax, (key, label) in zip(axes, panels):
        for index, row in enumerate(r for r in results["contenders"] if "rates" in r):
            color = f"C{index}"
            for q, style in (("p50", "-"), ("p99", "--")):
                values = [_figure(results, row["contender"], rate, lambda s, key=key, q=q: s[key][q]) for rate in rates]
                ax.plot(positions, [math.nan if v is None else v for v in values], style, marker="o", color=color,
                        label=f"{row['contender']} {q}")
        ax.set(yscale="log", ylabel=label, title=label)
    for index, row in enumerate(r for r in results["contenders"] if "rates" in r):
        values = [_figure(results, row["contender"], rate, lambda s: s["output_tokens_per_s"]) for rate in rates]
        axes[2].plot(positions, [math.nan if v is None else v for v in values], marker="o", color=f"C{index}",
                     label=row["contender"])
    axes[2].set(ylabel="output tokens/s", title="throughput")
    for ax in axes:
        ax.set_xticks(positions, labels=[_rate(r) for r in rates])
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    figure.savefig(path, dpi=120)


# ---- The run ----------------------------------------------------------------------------------------------------


def _transformers_versions(transformers: str) -> dict[str, str] | str:
    """torch's and transformers' versions in the interpreter beside the `transformers` command."""
    python = Path(shlex.split(transformers)[0]).with_name("python")
    script = "import json, torch, transformers; print(json.dumps({'torch': torch.__version__, " \
             "'transformers': transformers.__version__}))"
    try:
        done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, check=True)
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return f"unknown ({type(error).__name__})"


def measure_contender(name: str, command: list[str], *, checkpoint: Path, config: LoadConfig,
                      workloads: list[list[Request]], warmup: list[Request], system: str, log_path: Path,
                      ready_timeout_s: float, encode: Callable[[str], list[int]] | None = None) -> dict[str, Any]:
    """Starts one contender, warms it up, drives every rate and stops it; its row of the results."""
    port = int(command[command.index("--port") + 1])
    base_url = f"http://127.0.0.1:{port}"
    row: dict[str, Any] = {"contender": name, "command": command}

    def progress(message: str) -> None:
        print(f"[{name}] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    with running(command, log_path) as process:
        try:
            row["model"] = wait_ready(base_url, process, ready_timeout_s)
            row["ready_s"] = time.perf_counter() - started
            progress(f"ready after {row['ready_s']:.0f} s; warming up with {len(warmup)} requests")
            outcomes, wall_s = asyncio.run(drive(
                base_url, row["model"], warmup, system, np.zeros(len(warmup)), endpoint=config.endpoint,
                request_timeout_s=config.request_timeout_s, deadline_s=config.rate_deadline_s, encode=encode))
            row["warmup"] = summarize([dataclasses.asdict(o) for o in outcomes], wall_s)
            row["rates"] = []
            for rate_index, (rate, requests) in enumerate(zip(config.rates, workloads)):
                send_at = arrivals(len(requests), rate, np.random.default_rng([config.seed, 1, rate_index]))
                before = scrape_metrics(base_url)
                outcomes, wall_s = asyncio.run(drive(
                    base_url, row["model"], requests, system, send_at, endpoint=config.endpoint,
                    request_timeout_s=config.request_timeout_s, deadline_s=config.rate_deadline_s, encode=encode))
                outcomes = [dataclasses.asdict(o) for o in outcomes]
                summary = summarize(outcomes, wall_s)
                summary["prompt_tokens_cached_share"] = cached_share(before, scrape_metrics(base_url))
                row["rates"].append({"rate": rate, "summary": summary, "load_average": load_average(),
                                     "requests": outcomes})
                progress(f"rate {_rate(rate)}: {summary['completed']}/{summary['requests']} completed, "
                         f"{summary['output_tokens_per_s'] or 0:.1f} output tokens/s over {wall_s:.0f} s")
                if process.poll() is not None:
                    raise ServerFailed(f"exited with code {process.returncode} during the run")
            row["peak_rss_mb"] = peak_rss_mb(process.pid)
        except ServerFailed as error:
            row["unavailable"] = str(error)
            progress(f"failed: {error}")
    row["exit_code"] = process.returncode
    failed = "unavailable" in row or any(m["summary"]["failed"] for m in row.get("rates", []))
    if failed or process.returncode not in (0, -signal.SIGTERM):
        row["log_tail"] = tail(log_path)
    return row


def run_serve(*, contenders: Sequence[str] = CONTENDERS, config: LoadConfig = LoadConfig(), pool: Pool = Pool(),
              checkpoint: str | os.PathLike | None = None, sizes: dict[str, int] | None = None,
              kvattn: str | None = None, transformers: str | None = None,
              extra_args: dict[str, list[str]] | None = None, ready_timeout_s: float = 900.0,
              llama_server: str | os.PathLike | None = None, gguf_python: str | None = None,
              out_dir: str | os.PathLike = "bench-results/serve",
              cache_dir: str | os.PathLike = "bench-results/serve-cache", generate: bool = False) -> dict[str, Any]:
    """Measures every contender under the same workload; writes `serve.json`, `serve.md` and `serve.png`.

    Args:
      contenders: names from `CONTENDERS`, run in this order.
      config: the workload and the client's limits.
      pool: the KV pool (and batch and length limits) every contender gets.
      checkpoint: a directory to serve as it is; default: `write_serve_checkpoint` under `cache_dir`.
      sizes: the written checkpoint's sizes (default `LLAMA_125M`).
      kvattn, transformers: the commands that run `kvattn` and `transformers` (split like a shell).
      extra_args: more arguments per server command, keyed "kvattn", "transformers" or "llama-server".
      ready_timeout_s: how long a server may take to answer `/health`.
      llama_server: the folder of llama.cpp's binaries, for the llama.cpp contenders.
      gguf_python: the interpreter that converts the checkpoint to GGUF (torch, transformers; default this one).
      out_dir: where the results go.
      cache_dir: where the checkpoint and the servers' logs go.
      generate: also time `generate` on the saturation rate's requests for each kvattn contender's weights.

    Returns:
      The results, as written to `serve.json`.
    """
    from benchmarks.serve_checkpoint import SPECIAL_TOKENS, kept_corpus, load_tokenizer, write_serve_checkpoint

    cache = Path(cache_dir)
    if checkpoint is None:
        recorded = write_serve_checkpoint(cache / "checkpoint", sizes=sizes, max_position_embeddings=pool.max_len)
        checkpoint = cache / "checkpoint"
    else:
        recorded = {"given": str(checkpoint)}
    checkpoint = Path(checkpoint).resolve()
    kvattn = kvattn or str(Path(sys.executable).with_name("kvattn"))
    transformers = transformers or shutil.which("transformers") or DEFAULT_TRANSFORMERS

    tokenizer = load_tokenizer(checkpoint)
    # The repository's text (as the cache first kept it) names the special tokens; prompts never hold them.
    stream = [i for i in tokenizer.encode(kept_corpus(cache)).ids if i >= len(SPECIAL_TOKENS)]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    decode = tokenizer.decode
    system, system_tokens = text_window(stream, config.system_tokens, encode, decode,
                                        np.random.default_rng([config.seed, 0]))
    lengths = {"num_requests": config.num_requests, "prompt_tokens": config.prompt_tokens,
               "output_tokens": config.output_tokens, "system_share": config.system_share}
    workloads = [make_workload(stream, encode, decode, rng=np.random.default_rng([config.seed, 2, i]), **lengths)
                 for i in range(len(config.rates))]
    warmup = make_workload(stream, encode, decode, rng=np.random.default_rng([config.seed, 3]),
                           **{**lengths, "num_requests": config.warmup_requests})

    ggufs = None
    wanted = sorted({LLAMA_SERVER_TYPES[name] for name in contenders if name in LLAMA_SERVER_TYPES})
    if wanted:
        if llama_server is None:
            raise ValueError("the llama.cpp contenders need llama_server, the folder of llama.cpp's binaries")
        from tools import llama_cpp

        # The benchmark's tokenizer is its own BPE, which the converter does not know by name.
        ggufs = llama_cpp.convert(checkpoint, wanted, python=gguf_python or sys.executable, pre_tokenizer="default")

    load = load_average()
    started = time.perf_counter()
    rows = []
    for name in contenders:
        command = server_command(name, port=free_port(), checkpoint=checkpoint, pool=pool, kvattn=kvattn,
                                 transformers=transformers, extra_args=extra_args or {}, llama_server=llama_server,
                                 ggufs=ggufs)
        rows.append(measure_contender(name, command, checkpoint=checkpoint, config=config, workloads=workloads,
                                      warmup=warmup, system=system, log_path=cache / "logs" / f"{name}.log",
                                      ready_timeout_s=ready_timeout_s, encode=encode))
    references = {}
    if generate:
        ids = [{"prompt": encode((system if r.system else "") + r.user), "max_tokens": r.max_tokens}
               for r in workloads[-1]]
        for name in contenders:
            if name in GENERATE_WEIGHTS and GENERATE_WEIGHTS[name] not in [
                    GENERATE_WEIGHTS[done] for done in references]:
                print(f"[generate] {name}'s weights, batches of {pool.max_batch}", file=sys.stderr, flush=True)
                references[name] = generate_reference(checkpoint, ids, pool, GENERATE_WEIGHTS[name], cache)
    results = {
        "config": {**dataclasses.asdict(config), "rates": list(config.rates), "system_tokens_measured": system_tokens,
                   "pool": {**dataclasses.asdict(pool), "tokens": pool.tokens,
                            "transformers_blocks": pool.transformers_blocks},
                   "checkpoint": str(checkpoint), "checkpoint_record": recorded,
                   "ggufs": {kind: str(path) for kind, path in (ggufs or {}).items()}},
        "machine": machine_info(),
        "versions": {**versions(), **({"transformers_serve": _transformers_versions(transformers)}
                                      if "transformers" in contenders else {})},
        "source": source_revision(), "load_average": {"before": load, "after": load_average()},
        "contenders": rows, "elapsed_s": time.perf_counter() - started,
        **({"generate": references} if generate else {}),
    }
    mark_agreement(rows)
    results["targets"] = targets(results)
    out = Path(out_dir)
    write(out, "serve", _json_safe(results), serve_markdown(results))
    plot_serve(results, out / "serve.png")
    return results


def generate_reference(checkpoint: Path, requests: list[dict[str, Any]], pool: Pool, weights: str | None,
                       cache: Path) -> dict[str, Any]:
    """`benchmarks.serve_generate` on `requests` (ids and `max_tokens`) in a subprocess: its figures, or why not."""
    path = cache / f"generate-requests-{weights or 'float32'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(requests))
    command = [sys.executable, "-m", "benchmarks.serve_generate", "--checkpoint", str(checkpoint), "--requests",
               str(path), "--batch", str(pool.max_batch), "--max-len", str(pool.max_len),
               *(["--weights", weights] if weights else [])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"command": command, "unavailable": f"exit code {done.returncode}: {done.stderr[-2000:]}"}
    return {"command": command, "weights": weights or "float32", **json.loads(done.stdout.strip().splitlines()[-1])}


def _json_safe(value: Any) -> Any:
    """`value` with infinite floats as the string "inf" (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# ---- The command line -------------------------------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(","))
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"want LOW,HIGH with 0 < LOW <= HIGH, got {text}")
    return low, high


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(part) for part in text.split(","))
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive (inf: all at once), got {text}")
    return rates


def _parser() -> argparse.ArgumentParser:
    defaults, pool = LoadConfig(), Pool()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--contenders", type=lambda t: tuple(t.split(",")), default=DEFAULT_CONTENDERS,
                        help=f"comma-separated, from {','.join(CONTENDERS)}")
    parser.add_argument("--rates", type=_rates, default=defaults.rates,
                        help="request rates (req/s), comma-separated; inf: all at once")
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests, help="requests per rate")
    parser.add_argument("--prompt-tokens", type=_pair, default=defaults.prompt_tokens, help="LOW,HIGH (uniform)")
    parser.add_argument("--output-tokens", type=_pair, default=defaults.output_tokens,
                        help="LOW,HIGH of max_tokens (uniform)")
    parser.add_argument("--system-tokens", type=int, default=defaults.system_tokens, help="the shared system prompt")
    parser.add_argument("--system-share", type=float, default=defaults.system_share,
                        help="share of requests with the system prompt")
    parser.add_argument("--warmup-requests", type=int, default=defaults.warmup_requests,
                        help="untimed requests, all at once, before the rates")
    parser.add_argument("--endpoint", choices=("chat", "completions", "completions-ids"), default=defaults.endpoint,
                        help="completions-ids: prompts as the tokenizer's ids (for the llama.cpp contenders)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds")
    parser.add_argument("--rate-deadline", type=float, default=defaults.rate_deadline_s,
                        help="seconds per rate; requests still running then are lost")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--num-pages", type=int, default=pool.num_pages)
    parser.add_argument("--page-size", type=int, default=pool.page_size)
    parser.add_argument("--max-batch", type=int, default=pool.max_batch)
    parser.add_argument("--max-len", type=int, default=pool.max_len)
    parser.add_argument("--transformers-page-size", type=int, default=pool.transformers_page_size,
                        help="transformers' --cb-block-size; its block count makes the pool as many tokens")
    parser.add_argument("--checkpoint", help="serve this directory as it is (default: the random 125M Llama)")
    parser.add_argument("--num-layers", type=int, help="fewer layers than the 125M Llama's 12")
    parser.add_argument("--kvattn", help="the command that runs kvattn (default: kvattn beside this Python)")
    parser.add_argument("--transformers",
                        help=f"the command that runs transformers (default: on PATH, else {DEFAULT_TRANSFORMERS})")
    parser.add_argument("--llama-server", help="the folder of llama.cpp's binaries (python -m tools.llama_cpp build), "
                        "for the llama-server contenders")
    parser.add_argument("--gguf-python", help="an interpreter with torch and transformers, which converts the "
                        "checkpoint to GGUF (default: this one)")
    parser.add_argument("--kvattn-args", type=shlex.split, default=[], help="more arguments to kvattn serve")
    parser.add_argument("--transformers-args", type=shlex.split, default=[],
                        help="more arguments to transformers serve")
    parser.add_argument("--llama-server-args", type=shlex.split, default=[],
                        help="more arguments to llama-server")
    parser.add_argument("--out-dir", default="bench-results/serve")
    parser.add_argument("--cache-dir", default="bench-results/serve-cache",
                        help="the checkpoint and the servers' logs")
    parser.add_argument("--generate", action="store_true",
                        help="also time kvattn's generate in fixed batches on the saturation rate's requests")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: a 2-layer model, rate inf, 4 requests, short prompts and outputs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    if set(args.contenders) & set(LLAMA_SERVER_TYPES) and args.llama_server is None:
        parser.error("the llama-server contenders need --llama-server, the folder of llama.cpp's binaries")
    from benchmarks.model import LLAMA_125M

    sizes = dict(LLAMA_125M)
    config = LoadConfig(rates=args.rates, num_requests=args.num_requests, prompt_tokens=args.prompt_tokens,
                        output_tokens=args.output_tokens, system_tokens=args.system_tokens,
                        system_share=args.system_share, warmup_requests=args.warmup_requests, endpoint=args.endpoint,
                        seed=args.seed, request_timeout_s=args.request_timeout, rate_deadline_s=args.rate_deadline)
    if args.quick:
        sizes = dict(QUICK_MODEL)
        config = dataclasses.replace(config, rates=(math.inf,), num_requests=4, prompt_tokens=(8, 32),
                                     output_tokens=(4, 8), system_tokens=64, warmup_requests=2)
    if args.num_layers is not None:
        sizes["num_layers"] = args.num_layers
    pool = Pool(num_pages=args.num_pages, page_size=args.page_size, max_batch=args.max_batch, max_len=args.max_len,
                transformers_page_size=args.transformers_page_size)
    run_serve(contenders=args.contenders, config=config, pool=pool, checkpoint=args.checkpoint, sizes=sizes,
              kvattn=args.kvattn, transformers=args.transformers,
              extra_args={"kvattn": args.kvattn_args, "transformers": args.transformers_args,
                          "llama-server": args.llama_server_args},
              ready_timeout_s=args.ready_timeout, llama_server=args.llama_server, gguf_python=args.gguf_python,
              out_dir=args.out_dir, cache_dir=args.cache_dir, generate=args.generate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
