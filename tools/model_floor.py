"""What bounds whole-model decoding at B=8: the step every decoder must run, with no attention at all.

Issue "real models" asks kvattn.generation.generate to decode at B=8 at least 2x
faster than transformers and 1.5x faster than the plain hand-rolled cache.
Both contenders run the same weight matmuls per step (projections, MLP,
head); only attention differs. This times, on the benchmark's random
125M Llama (float32, prompt 128, 128 new tokens):

- plain: the hand-rolled decoder of `python -m benchmarks --model`, one jitted step per token;
- kvattn: `kvattn.generation.generate` (decode ms per token);
- floor: the plain step with attention removed (each layer's output
  projection applied to the new token's value): no cache read at all.

If the floor is more than 1/1.5 of the plain step, no cache, however fast,
makes a decoder 1.5x faster than the plain one. Like the plain step, the
floor is called from Python once per token (kvattn's loop is compiled whole,
so at B=1, where a step is short, kvattn can come out below this floor).

    python -m tools.model_floor [--batch 8] [--repeats 3]     # from the repository root
"""

import argparse
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import model as bench
from benchmarks import plain_cache
from benchmarks.timing import time_calls
from kvattn import generation, models


def floor_step_fn(config):
    """The plain step without attention: `(weights, tokens (B,)) -> next tokens`."""
    from kvattn.math.rope import apply_rope

    def rms(x, weight):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + config.norm_eps) * weight[None, :]

    def step(weights, tokens, pos):
        x = jnp.take(weights["embed"], tokens, axis=0)
        positions = jnp.broadcast_to(pos, (tokens.shape[0], 1))
        for layer in weights["layers"]:
            h = rms(x, layer["attention_norm"])
            q = apply_rope(jnp.einsum("BD,DNH->BNH", h, layer["query"])[:, None], positions, config.rope)
            k = apply_rope(jnp.einsum("BD,DKH->BKH", h, layer["key"])[:, None], positions, config.rope)
            v = jnp.einsum("BD,DKH->BKH", h, layer["value"])
            group = config.num_heads // config.num_kv_heads
            mixed = jnp.repeat(v, group, axis=1) + 0 * (q[:, 0].sum() + k.sum())  # keep q and k computed
            x = x + jnp.einsum("BNH,NHD->BD", mixed, layer["out"])
            h = rms(x, layer["mlp_norm"])
            x = x + (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        logits = rms(x, weights["final_norm"]) @ weights["lm_head"]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.jit(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt_len, new_tokens = 128, 128
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = bench.write_llama_checkpoint(directory, **bench.LLAMA_125M,
                                                  max_position_embeddings=prompt_len + new_tokens)
        model = models.from_pretrained(checkpoint, max_len=prompt_len + new_tokens, batch_size=args.batch)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, prompt_len)).astype(np.int32)
    def generations(count):
        def run(_):
            model.reset()
            return generation.generate(model, prompts, count).tokens
        return statistics.median(time_calls(run, args.repeats).ms)

    ours = (generations(new_tokens) - generations(1)) / (new_tokens - 1)
    plain = plain_cache.time_plain(model, prompts, new_tokens, args.repeats)["decode_ms_per_token"]
    weights = plain_cache.plain_weights(model)
    step = floor_step_fn(model.config)
    tokens = jnp.asarray(prompts[:, 0])

    def decode(_):
        token = tokens
        for pos in range(prompt_len, prompt_len + new_tokens - 1):
            token = step(weights, token, jnp.int32(pos))
        return token

    floor = statistics.median(time_calls(decode, args.repeats, units=new_tokens - 1).ms)
    print(f"B={args.batch}: kvattn {ours:.2f} ms/token, plain {plain:.2f}, floor without attention {floor:.2f}")
    print(f"best possible speed-up over plain (plain / floor): {plain / floor:.2f}x; kvattn's: {plain / ours:.2f}x")


if __name__ == "__main__":
    main()
