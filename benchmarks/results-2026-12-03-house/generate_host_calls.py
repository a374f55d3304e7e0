"""Python function calls per `generate` call and ms per new token: the ab.py model, float32, B=1.

    PYTHONPATH=OLD_OR_NEW_SRC .venv/bin/python benchmarks/results-2026-12-03-house/generate_host_calls.py

Run it for each revision in alternation: equal calls and equal compiled programs leave only noise.
"""
import cProfile, pstats, time, statistics
import jax, numpy as np
from flax import nnx
import kvattn
from kvattn import generation, models
config = models.ModelConfig("llama", vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                            head_dim=64, intermediate_size=1536, norm_eps=1e-5, tie_embeddings=False,
                            max_position_embeddings=1024, rope=kvattn.RoPE(theta=10000.0))
model = models.CausalLM(config, max_len=128, batch_size=1, rngs=nnx.Rngs(0))
prompts = np.random.default_rng(0).integers(0, 8192, (1, 32))
def run():
    model.reset(); return generation.generate(model, prompts, 64).tokens
jax.block_until_ready(run())
pr = cProfile.Profile(); pr.enable()
for _ in range(5): jax.block_until_ready(run())
pr.disable()
st = pstats.Stats(pr); print("calls per generate", st.total_calls / 5)
t = []
for _ in range(15):
    s = time.perf_counter(); jax.block_until_ready(run()); t.append(time.perf_counter() - s)
print("ms/token", 1e3 * statistics.median(t) / 64)
