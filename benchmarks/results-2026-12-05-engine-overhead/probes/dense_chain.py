import time, numpy as np, jax, jax.numpy as jnp
from kvattn.kernels import native, route
from kvattn.math import quant
rng = np.random.default_rng(0)
def old(x, t, s):
    v, rs = quant.quantize_rows(x)
    return route.lax.platform_dependent(v, t, cpu=native.int8_dot, default=native.int8_dot_on_xla).astype(jnp.float32) * rs * s[None]
def new(x, t, s):
    return native.int8_dense(x, t, s)
for M, K in [(8, 768), (1, 768), (8, 2048)]:
    w = rng.integers(-127, 128, (K, K), dtype=np.int8)
    t = jnp.asarray(quant.tile(quant.Int8Weights(w, None)).tiles); s = jnp.full((K,), 1e-3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    fs = {}
    for name, f in (("old", old), ("new", new)):
        def chain(x, f=f):
            for _ in range(40):
                x = f(x, t, s)
            return x
        fs[name] = jax.jit(chain); fs[name](x).block_until_ready()
    times = {n: [] for n in fs}
    for _ in range(15):
        for n, f in fs.items():
            t0 = time.perf_counter(); f(x).block_until_ready(); times[n].append((time.perf_counter() - t0) / 40 * 1e6)
    print(M, K, {n: round(float(np.median(v)), 1) for n, v in times.items()}, "us per dot")
