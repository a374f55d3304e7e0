"""Host time of one decode dispatch of the engine (flatten, parse, enqueue), B=8, and of the whole step."""
import time, tempfile, statistics, numpy as np, jax
from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from kvattn import models
from kvattn import SamplingParams

from kvattn.serving import Server
B, P, PAGE, N = 8, 128, 16, 40
max_len = P + N + 1
with tempfile.TemporaryDirectory() as d:
    ck = write_llama_checkpoint(d, **LLAMA_125M, max_position_embeddings=max_len)
    paged = models.from_pretrained(ck, max_len=max_len, batch_size=B, num_pages=B * -(-max_len // PAGE) + 1, page_size=PAGE)
server = Server(paged, prefix_caching=False)
server.warm_up()
times = []
original = server.runner._dispatch
def timed(program, *args):
    start = time.perf_counter(); out = original(program, *args); times.append(time.perf_counter() - start); return out
server.runner._dispatch = timed
for rep in range(3):
    times.clear()
    prompts = np.random.default_rng(rep).integers(0, LLAMA_125M["vocab_size"], (B, P))
    for p in prompts: server.submit(p.tolist(), SamplingParams(max_tokens=N, ignore_eos=True))
    server.run()
    print(f"dispatch host time: median {1e3 * statistics.median(times[2:]):.3f} ms over {len(times) - 2} calls")
# where the rest goes: the same call with its arguments already on the device
captured = {}
def capture(program, *args):
    captured.setdefault(program.__name__, (program, args)); return original(program, *args)
server.runner._dispatch = capture
for p in np.random.default_rng(9).integers(0, LLAMA_125M["vocab_size"], (B, P)): server.submit(p.tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
server.run()
program, args = captured["_decode_program"]
r = server.runner
on_device = jax.device_put(args)
for name, a in (("numpy args", args), ("device args", on_device)):
    ts = []
    for _ in range(30):
        t0 = time.perf_counter(); out = program(r._graphdef, r._params, r._pools, *a); ts.append(time.perf_counter() - t0)
        *_, r._pools = out; jax.block_until_ready(out)
    print(name, f"{1e3 * statistics.median(ts):.3f} ms")
