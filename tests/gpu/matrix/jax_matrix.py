"""Rows h and h2: JAX with the platform allocator (no argument: XLA_PYTHON_CLIENT_ALLOCATOR=
platform, no preallocation, unless the environment says otherwise) or with whatever allocator
the environment selects (argument "default": nothing is set here, so XLA's BFC arena
preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU).  Values are exact (small integers,
dyadic arithmetic), so any algorithm XLA picks gives the same digits.  Pauses once while the
arrays are live; just before, "# memory_stats {json}" gives the device's allocator statistics
(pool_bytes, bytes_limit, bytes_reserved, ...; "null" where the backend has none)."""
import json
import os
import sys

mode = sys.argv[1] if len(sys.argv) > 1 else "platform"
if mode != "default":
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
print(f"# jax {jax.__version__}, devices {jax.devices()}, mode {mode}, " + ", ".join(
    f"{k}={os.environ.get(k, '(unset)')}" for k in
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")))
print("backend", jax.default_backend())
x = (jnp.arange(512 * 256, dtype=jnp.int32) % 17 - 8).astype(jnp.float32).reshape(512, 256)
w = (jnp.arange(256 * 128, dtype=jnp.int32) % 13 - 6).astype(jnp.float32).reshape(256, 128)
yi = (x @ w).astype(jnp.int32)
print("matmul: sum", int(yi.sum()), "max", int(jnp.abs(yi).max()), "y[3,5]", int(yi[3, 5]))


@jax.jit
def lcg(s):
    return jax.lax.fori_loop(0, 1000, lambda i, v: v * jnp.uint32(1103515245) + jnp.uint32(12345), s)


s = lcg(jnp.arange(4096, dtype=jnp.uint32))
print("lcg: sum mod 1000", int((s % 1000).astype(jnp.int32).sum()), "s[7]", int(s[7]))
big = jnp.ones((16 << 20,), jnp.float32)  # 64 MiB
print("big: sum", int(big.astype(jnp.int32).sum()))
target = jnp.arange(8, dtype=jnp.float32) / 4


@jax.jit
def step(v):
    loss, g = jax.value_and_grad(lambda u: jnp.sum((u - target) ** 2))(v)
    return v - 0.125 * g, loss


v = jnp.zeros(8, jnp.float32)
for i in range(6):
    v, loss = step(v)
    print(f"step {i} loss {float(loss):.6f}")
print("tanh", [f"{float(t):.6f}" for t in jnp.tanh(target)])
jax.block_until_ready((yi, s, big, v))
try:
    stats = jax.devices()[0].memory_stats()
except Exception as e:  # a backend without statistics
    stats = None
    print(f"# memory_stats unavailable: {e!r}")
print("# memory_stats " + json.dumps(stats, default=int))
print(f"# pause {os.getpid()}", flush=True)
sys.stdin.readline()
del big
print("done")
