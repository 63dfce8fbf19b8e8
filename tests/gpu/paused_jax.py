"""Work while paused under JAX (issue 37): one process under the shim with VMMSHIM_SLEEP_ADOPTED=1,
started by tests/gpu/paused.sh.  An array of 256 MiB is made and summed, vmmshim.pause() takes
everything, then a new small array is made and summed while paused, then resume, and the first
array must sum the same.  XLA's default allocator (BFC) carves every array out of one arena it
made at start, which the pause released: a new array lands there.  XLA_PYTHON_CLIENT_ALLOCATOR=
platform gives each array its own cudaMalloc, which the shim serves from memory that is not
paused.  Prints "R jax allocator=A work_ok=0|1 exact=0|1 [why]"."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))
import jax.numpy as jnp  # noqa: E402
import vmmshim  # noqa: E402

alloc = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
big = jnp.arange(64 * 2**20, dtype=jnp.float32)
ref = float(big.sum())
vmmshim.pause()
ok, why = 0, ""
try:
    small = jnp.full((256,), 3.0)
    ok = int(float(small.sum()) == 768.0)
except Exception as e:
    why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
try:
    vmmshim.resume()
    exact = int(float(big.sum()) == ref)
except Exception as e:
    exact, why = 0, why or f"resume: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
print(f"R jax allocator={alloc} work_ok={ok} exact={exact} why={why!r}", flush=True)
