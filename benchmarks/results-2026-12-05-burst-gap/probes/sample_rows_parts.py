import time, numpy as np, jax, jax.numpy as jnp
from kvattn.generation import sampling as S
B,V=8,32000
logits=jnp.asarray(np.random.default_rng(0).standard_normal((B,V)),jnp.float32)
rows=S.RowSampling.of([], B)
adj=S.Adjustments(*(jax.device_put(a) for a in S.Adjustments.neutral((B,V))))
fns={
 'sample_rows+adj': jax.jit(lambda l,r,a: S.sample_rows(l,r,a)),
 'sample_rows': jax.jit(lambda l,r: S.sample_rows(l,r)),
 'greedy': jax.jit(lambda l: S.greedy_tokens(l)),
 'greedy+logprob': jax.jit(lambda l: S.token_logprobs(l, S.greedy_tokens(l), jnp.bool_(False))),
 'scaled_rows+greedy': jax.jit(lambda l,r: (S.greedy_tokens(l), S.scaled_rows(l,r))),
}
args={'sample_rows+adj':(logits,rows,adj),'sample_rows':(logits,rows),'greedy':(logits,),'greedy+logprob':(logits,),'scaled_rows+greedy':(logits,rows)}
for n,f in fns.items(): jax.block_until_ready(f(*args[n]))
res={n:[] for n in fns}
for r in range(7):
  for n,f in fns.items():
    t=time.perf_counter()
    for _ in range(50): out=f(*args[n])
    jax.block_until_ready(out); res[n].append((time.perf_counter()-t)/50*1e3)
for n,v in res.items(): print(f"{n:22s} median {np.median(v):.3f} ms")
