#!/usr/bin/env python3
"""A JAX training-step worker for bench_mem.py's jaxstep rows (issue 27): bench_mem.py starts one
natively and one under the shim, both up at once on one GPU, and has them take turns.

  bench_mem_jax.py worker big    a GPU-bound step: a jitted train step (forward, grad, SGD with
                                 momentum, parameters donated) of 8 residual blocks of width 4096
                                 with 4 x width hidden layers (bf16 matmuls) over 4096 tokens: about
                                 26 TFLOP, tens of ms on an H100/H200
  bench_mem_jax.py worker small  a host-bound step of about a millisecond: a jitted train step of a
                                 3-layer MLP of width 256 on a batch of 128, its numpy batch put on
                                 the device each step and the loss's block_until_ready() each step
                                 (the issue's small JAX MLP)

After warm-up it prints "M ready", then answers each stdin line "run ROUND K" with K steps, each
timed to its block_until_ready(), and one line "T round=ROUND ms=a,b,..."; "quit" (or the end of
stdin) ends it.  JAX's default allocator (the preallocating BFC arena): bench_mem.py sets
XLA_PYTHON_CLIENT_MEM_FRACTION so that both workers fit one GPU.
Without JAX or a GPU it prints "SKIP reason" and exits 3."""
import sys
import time

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
except Exception as e:  # a machine without JAX: the row says skipped
    print(f"SKIP jax not importable: {e}", flush=True)
    sys.exit(3)
try:
    if jax.devices()[0].platform != "gpu":
        print(f"SKIP JAX has no GPU (platform {jax.devices()[0].platform})", flush=True)
        sys.exit(3)
except Exception as e:
    print(f"SKIP JAX has no GPU: {e}", flush=True)
    sys.exit(3)

mode = sys.argv[1] if len(sys.argv) > 1 else "worker"
kind = sys.argv[2] if len(sys.argv) > 2 else "big"
if mode != "worker" or kind not in ("big", "small"):
    print(f"usage: {sys.argv[0]} worker big|small", file=sys.stderr)
    sys.exit(2)


def init_params(key, sizes, dtype):
    params = []
    for i, (a, b) in enumerate(sizes):
        k = jax.random.fold_in(key, i)
        params.append((jax.random.normal(k, (a, b), dtype) * (1.0 / np.sqrt(a)), jnp.zeros((b,), dtype)))
    return params


def big():
    d, hidden, layers, tokens = 4096, 4 * 4096, 8, 4096
    key = jax.random.PRNGKey(0)
    sizes = [s for _ in range(layers) for s in ((d, hidden), (hidden, d))]
    params = init_params(key, sizes, jnp.bfloat16)
    mom = jax.tree_util.tree_map(jnp.zeros_like, params)
    x = jax.random.normal(jax.random.fold_in(key, 1000), (tokens, d), jnp.bfloat16)
    y = jax.random.normal(jax.random.fold_in(key, 1001), (tokens, d), jnp.bfloat16)

    def loss_fn(p, x, y):
        h = x
        for i in range(layers):
            (w1, b1), (w2, b2) = p[2 * i], p[2 * i + 1]
            h = h + (jax.nn.gelu(h @ w1 + b1) @ w2 + b2) * 0.1  # a residual block
        return jnp.mean((h.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    def train(p, m, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, m, g)
        p = jax.tree_util.tree_map(lambda p, m: p - 1e-4 * m, p, m)
        return p, m, loss

    train = jax.jit(train, donate_argnums=(0, 1))
    state = [params, mom]

    def step():
        state[0], state[1], loss = train(state[0], state[1], x, y)
        loss.block_until_ready()

    return step


def small():
    sizes, batch = ((256, 256), (256, 256), (256, 10)), 128
    params = init_params(jax.random.PRNGKey(0), sizes, jnp.float32)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((64, batch, 256), dtype=np.float32)  # numpy batches, as a data loader's
    ys = rng.integers(0, 10, (64, batch))

    def loss_fn(p, x, y):
        h = x
        for w, b in p[:-1]:
            h = jax.nn.relu(h @ w + b)
        logits = h @ p[-1][0] + p[-1][1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    @jax.jit
    def train(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-2 * g, p, g), loss

    state = [params, 0]

    def step():
        i = state[1] % len(xs)
        state[0], loss = train(state[0], xs[i], ys[i])
        loss.block_until_ready()
        state[1] += 1

    return step


step = big() if kind == "big" else small()
for _ in range(3 if kind == "big" else 200):  # warm-up: compiled, the arena's blocks in place
    step()
print(f"M ready t={time.monotonic():.6f}", flush=True)
while True:
    line = sys.stdin.readline()
    w = line.split()
    if not w or w[0] == "quit":
        break
    rnd, k = int(w[1]), int(w[2])
    ms = []
    for _ in range(k):
        t = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t) * 1e3)
    print(f"T round={rnd} ms={','.join(f'{x:.4f}' for x in ms)}", flush=True)
