"""Thunks of the engine's decode steps against generate's, B=8, 512-token contexts (float32 or int8)."""
import sys, glob, collections, tempfile
from tools import step_profile as sp  # sets XLA_FLAGS before jax starts
import jax, numpy as np
from flax import nnx
from benchmarks.model import LLAMA_125M, write_llama_checkpoint
from kvattn import generation, models
from kvattn import SamplingParams

from kvattn.serving import Server
weights = sys.argv[1] if len(sys.argv) > 1 else None
B, P, PAGE, N = 8, 512, 16, 16
max_len = P + N + 1
with tempfile.TemporaryDirectory() as d:
    ck = write_llama_checkpoint(d, **LLAMA_125M, max_position_embeddings=max_len)
    fixed = models.from_pretrained(ck, max_len=max_len, batch_size=B, weights=weights)
    paged = models.from_pretrained(ck, max_len=max_len, batch_size=B, weights=weights,
                                   num_pages=B * -(-max_len // PAGE) + 1, page_size=PAGE)
prompts = np.random.default_rng(0).integers(0, LLAMA_125M["vocab_size"], (B, P)).astype(np.int32)
def gen(count):
    def run():
        fixed.reset(); jax.block_until_ready(nnx.state(fixed, nnx.Cache))
        jax.block_until_ready(generation.generate(fixed, prompts, count).tokens)
    return run
server = Server(paged, chunk=4 * PAGE, prefix_caching=False)
def start():
    for p in prompts: server.submit(p.tolist(), SamplingParams(max_tokens=N + 2, ignore_eos=True))
    while any(len(r.generated) == 0 for r in server.scheduler.seqs if r is not None) or server.stats.waiting:
        server.step()
def steps():
    for _ in range(N - 1): server.step()
    jax.block_until_ready(server.runner.pools) if hasattr(server.runner, "pools") else None
written, files = set(), []
for count in (1, N): gen(count)()
start(); steps(); server.run()
files = set(glob.glob(f"{sp.HLO_DIR}/*after_optimizations.txt"))
first, fc = sp._thunks(gen(1), files); whole, wc = sp._thunks(gen(N), files)
dec = collections.Counter({k: whole[k] - first.get(k, 0) for k in whole}); dc = {k: wc[k] - fc.get(k, 0) for k in whole}
print("generate decode, per step"); sp._print(dec, dc, N - 1, 22)
start()
eng, ec = sp._thunks(steps, files)
server.run()
print("\nengine decode, per step"); sp._print(eng, ec, N - 1, 22)
