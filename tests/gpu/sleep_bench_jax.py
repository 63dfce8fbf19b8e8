"""The sleep table of issue 29, JAX side: a JAX trainer under the shim, one process, started by
tests/gpu/sleep.sh (or by hand):

  LD_PRELOAD=build/libvmmshim.so VMMSHIM_SLEEP_ADOPTED=1 python3 tests/gpu/sleep_bench_jax.py

XLA_PYTHON_CLIENT_PREALLOCATE=false (XLA's BFC arena grows as it needs), XLA_PYTHON_CLIENT_MEM_FRACTION
0.9 (the arena's cap: the KV tensor below must fit beside what training left in it), both unless set.
VMMSHIM_SLEEP_ADOPTED=1 so that whatever XLA maps itself (cuMemCreate) is released too; without it
that memory stays, counted in the report's bytes_not_shim.

  trainer   the Llama shape of sleep_bench.py (the same SLEEP_* knobs: 22 layers of width 2048, 32/4
            heads, SwiGLU 5632, vocabulary 32,000: 1.1 B parameters) in bf16 with optax.adamw, the
            layers stacked and run by lax.scan under jax.checkpoint (one layer compiled, not 22), one
            jitted step with the parameters and optimizer state donated.  The embedding is a one-hot
            matmul and the loss a one-hot sum, not a gather: a gather's gradient is a scatter-add,
            which XLA runs with atomics in no fixed order, and the losses must be equal bit for bit.
            First SLEEP_STEPS x (SLEEP_ROUNDS + 1) steps without sleeping (the reference), then from
            the same seed SLEEP_STEPS steps and, each round, vmmshim.pause() (everything, kept), the
            neighbour's allocation, vmmshim.resume(), SLEEP_STEPS more steps.  XLA allocates on threads
            of its own, which a thread's region does not reach, so the trainer sleeps whole.
  neighbour as in sleep_bench.py: the device filled to SLEEP_HEADROOM_MB by another process, whose
            allocation of the live arrays' bytes less 256 MiB must fail before the pause and succeed
            after it.
  kv        SLEEP_KV_FRACTION of what the device has free (NVML) as one jnp array made inside
            vmmshim.region("kv"), paused with discard and resumed, each round; the check says whether
            the region reached XLA's allocation of it (XLA may make it on another thread).

The same "R ..." lines as sleep_bench.py (its docstring), and "N passed, N failed".  SLEEP_JAX_CACHE:
a directory for JAX's persistent compilation cache, so that a second process skips compiling.
Exit 0, 1 when a check failed, 3 when it cannot run here (SKIP)."""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))
sys.path.insert(0, HERE)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

from sleep_common import (BATCH, FFN, HEADROOM, HEADS, KV_FRACTION, KV_HEADS, LAYERS, PINNED, ROUNDS,  # noqa: E402
                          SEQ, SLACK, STEPS, VOCAB, WIDTH, Checks, DeviceView, MiB, Neighbour,
                          pinned_bandwidth, say)

T0 = time.perf_counter()
view = DeviceView()  # before CUDA starts: what others use

checks = Checks()

try:
    import jax
    import jax.numpy as jnp
    import optax
except Exception as e:
    print(f"SKIP jax or optax not importable: {e}", flush=True)
    sys.exit(3)
try:
    if jax.devices()[0].platform != "gpu":
        print(f"SKIP JAX has no GPU (platform {jax.devices()[0].platform})", flush=True)
        sys.exit(3)
except Exception as e:
    print(f"SKIP JAX has no GPU: {e}", flush=True)
    sys.exit(3)

import vmmshim  # noqa: E402

if os.environ.get("SLEEP_JAX_CACHE"):
    try:
        jax.config.update("jax_compilation_cache_dir", os.environ["SLEEP_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    except Exception as e:  # an older or newer JAX without these names: compile every time
        say("note", jax_cache="unavailable", reason=str(e).replace(" ", "_")[:100])

BF16, F32 = jnp.bfloat16, jnp.float32
HD = WIDTH // HEADS


def init(key):
    k = jax.random.split(key, 9)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, F32) * fan_in ** -0.5).astype(BF16)

    L, D, F, KVD = LAYERS, WIDTH, FFN, KV_HEADS * HD
    return {
        "emb": normal(k[0], (VOCAB, D), 2500.0),  # std 0.02
        "layers": {
            "n1": jnp.ones((L, D), BF16), "n2": jnp.ones((L, D), BF16),
            "q": normal(k[1], (L, D, D), D), "k": normal(k[2], (L, D, KVD), D), "v": normal(k[3], (L, D, KVD), D),
            "o": normal(k[4], (L, D, D), D),
            "gate": normal(k[5], (L, D, F), D), "up": normal(k[6], (L, D, F), D), "down": normal(k[7], (L, F, D), F),
        },
        "norm": jnp.ones((D,), BF16),
        "head": normal(k[8], (D, VOCAB), D),
    }


def rmsnorm(x, w):
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * w.astype(F32)).astype(BF16)


def layer(x, p):
    b, t, d = x.shape
    rep = HEADS // KV_HEADS
    h = rmsnorm(x, p["n1"])
    q = (h @ p["q"]).reshape(b, t, HEADS, HD)

    def widen(z):  # GQA by broadcast + reshape: its gradient is a plain sum
        z = z.reshape(b, t, KV_HEADS, 1, HD)
        return jnp.broadcast_to(z, (b, t, KV_HEADS, rep, HD)).reshape(b, t, HEADS, HD)

    k, v = widen(h @ p["k"]), widen(h @ p["v"])
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(F32) * HD ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    a = jax.nn.softmax(s, axis=-1).astype(BF16)
    x = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d) @ p["o"]
    h = rmsnorm(x, p["n2"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def loss_fn(params, ids):
    x = jax.nn.one_hot(ids[:, :-1], VOCAB, dtype=BF16) @ params["emb"]
    x, _ = jax.lax.scan(lambda x, p: (jax.checkpoint(layer)(x, p), None), x, params["layers"])
    logp = jax.nn.log_softmax((rmsnorm(x, params["norm"]) @ params["head"]).astype(F32), axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(ids[:, 1:], VOCAB, dtype=F32) * logp, axis=-1))


tx = optax.adamw(1e-4, weight_decay=0.01)


def train_step(params, opt_state, ids):
    loss, g = jax.value_and_grad(loss_fn)(params, ids)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


train_step = jax.jit(train_step, donate_argnums=(0, 1))
init_jit = jax.jit(init)


def run(state, batches):
    losses = []
    for ids in batches:
        state[0], state[1], loss = train_step(state[0], state[1], ids)
        losses.append(float(loss))
    return losses


def fresh():
    params = init_jit(jax.random.PRNGKey(1))
    return [params, tx.init(params)]


def main():
    say("setup", mode="jax", alloc_conf="xla_bfc_no_prealloc", backend="xla", layers=LAYERS, width=WIDTH,
        rounds=ROUNDS, steps=STEPS, device=str(jax.devices()[0].device_kind).replace(" ", "_"))
    d2h, h2d = pinned_bandwidth(PINNED)
    say("pinned", d2h=d2h, h2d=h2d, bytes=PINNED)
    n_steps = STEPS * (ROUNDS + 1)
    all_ids = jax.random.randint(jax.random.PRNGKey(7), (n_steps, BATCH, SEQ), 0, VOCAB)
    batches = [all_ids[i] for i in range(n_steps)]

    t = time.perf_counter()
    state = fresh()
    params = sum(x.size for x in jax.tree_util.tree_leaves(state[0]))
    reference = run(state, batches)
    del state
    ref_s = time.perf_counter() - t

    state = fresh()
    losses = run(state, batches[:STEPS])
    jax.block_until_ready(state)
    live = sum(x.nbytes for x in jax.live_arrays())
    say("model", params=params, optim_bytes=live, reference_s=ref_s)

    nb = Neighbour(view)
    filled = nb.fill(HEADROOM)
    ask = max(live - SLACK, 0)
    say("neighbour", filled=filled, footprint=view.others, headroom=HEADROOM, asks=ask)
    for r in range(ROUNDS):
        jax.block_until_ready(state)
        before = view.own()
        got_before = nb.tries(ask)
        t = time.perf_counter()
        rep = vmmshim.pause()
        pause_s = time.perf_counter() - t
        paused = view.own()
        got = nb.tries(ask)
        t = time.perf_counter()
        back = vmmshim.resume()
        resume_s = time.perf_counter() - t
        resumed = view.own()
        say("sleep", round=r, pause_s=pause_s, bytes=rep.bytes_kept, pause_GBps=rep.bytes_kept / pause_s / 1e9,
            released=rep.bytes_released, resume_s=resume_s, resume_GBps=back.bytes_kept / resume_s / 1e9,
            nvml_before=before, nvml_paused=paused, nvml_resumed=resumed, neighbour_before=int(got_before),
            neighbour=int(got), not_shim=rep.bytes_not_shim, shim_pause_s=rep.seconds, shim_resume_s=back.seconds)
        if before is not None:
            checks.check(rep.bytes_released > 0 and before - paused >= rep.bytes_released * 0.9,
                         f"round {r}: NVML fell by {before - paused} for {rep.bytes_released} released")
        checks.check(got and not got_before,
                     f"round {r}: the neighbour's allocation of {ask} bytes: before the pause "
                     f"{'succeeded (the device had room: the check proves nothing)' if got_before else 'failed'}, "
                     f"after it {'succeeded' if got else 'failed'}")
        checks.check(rep.bytes_not_shim == 0, f"round {r}: {rep.bytes_not_shim} bytes not the shim's stayed")
        losses += run(state, batches[STEPS * (r + 1):STEPS * (r + 2)])
    nb.close()
    same = losses == reference[:len(losses)]
    first = next((i for i, (a, b) in enumerate(zip(losses, reference)) if a != b), -1)
    say("losses", equal=int(same), first_differing_step=first, steps=len(losses),
        last=f"{losses[-1]:.6f}", reference_last=f"{reference[len(losses) - 1]:.6f}")
    checks.check(same, f"losses after sleeping equal a run that never slept (first differing step {first})")
    del state

    free = view.free()
    if free is None:
        free = jax.devices()[0].memory_stats().get("bytes_limit", 0) // 2
    n = int(free * KV_FRACTION) // (2 * MiB) * (2 * MiB)
    with vmmshim.region("kv"):
        kv = jnp.zeros((n,), jnp.uint8).block_until_ready()
    for r in range(ROUNDS):
        kv.block_until_ready()
        try:
            t = time.perf_counter()
            rep = vmmshim.pause("kv", keep=False)
            pause_s = time.perf_counter() - t
            t = time.perf_counter()
            back = vmmshim.resume("kv")
            resume_s = time.perf_counter() - t
        except vmmshim.Error as e:  # nothing under the tag: the region did not reach XLA's allocation
            say("kv", round=r, bytes=n, error=type(e).__name__)
            checks.check(False, f"kv round {r}: {e}")
            break
        say("kv", round=r, bytes=n, pause_s=pause_s, resume_s=resume_s, released=rep.bytes_released,
            kept=rep.bytes_kept)
        checks.check(rep.bytes_kept == 0 and rep.bytes_released >= n,
                     f"kv round {r}: the region's pause released {rep.bytes_released} of the {n} bytes jnp.zeros made "
                     f"inside it (less: XLA allocated them on a thread of its own)")
    del kv
    say("done", seconds=time.perf_counter() - T0)
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
