"""CuPy's MemoryAsyncPool under a mixed workload, for the `cupy` row of `make bench-gpu` (issue 15):
tests/gpu/bench_mem.py runs it natively and under the shim while sampling NVML.  Arrays of
256 B..256 MiB (log-uniform, fixed seed), at most 64 live, 3000 operations; then, with the last
live set held, the pool's used_bytes/free_bytes/total_bytes ("held"), and after deleting every
array and free_all_blocks() (a stream synchronize plus cudaMemPoolTrimTo(0)) the same again
("trim").  Marks "M ready", "M held_begin", "M held_end", "M trimmed", "M end" for the sampler.
Without CuPy it prints "SKIP reason" and exits 3."""
import math
import random
import sys
import time

try:
    import cupy
except Exception as e:
    print(f"SKIP cupy not importable: {e}", flush=True)
    sys.exit(3)


def mark(what):
    print(f"M {what} t={time.monotonic():.6f}", flush=True)


try:
    pool = cupy.cuda.MemoryAsyncPool()
    cupy.cuda.set_allocator(pool.malloc)
    cupy.cuda.Device(0).synchronize()
except Exception as e:  # a CuPy or driver without stream-ordered allocation
    print(f"SKIP MemoryAsyncPool unavailable: {e}", flush=True)
    sys.exit(3)

mark("ready")
time.sleep(0.15)
rng = random.Random(7)
live, fails = [], 0
for op in range(3000):
    if len(live) == 64 or (live and rng.random() < 0.5):
        live.pop(rng.randrange(len(live)))
    else:
        n = int(math.exp2(8 + 20 * rng.random()))
        try:
            live.append(cupy.empty(n, dtype=cupy.uint8))
        except cupy.cuda.memory.OutOfMemoryError:
            fails += 1
    if op % 256 == 255:
        cupy.cuda.get_current_stream().synchronize()
cupy.cuda.get_current_stream().synchronize()
live_bytes = sum(a.nbytes for a in live)
held = (pool.used_bytes(), pool.free_bytes(), pool.total_bytes())
mark("held_begin")
time.sleep(0.3)
mark("held_end")
live.clear()
pool.free_all_blocks()
trim = (pool.used_bytes(), pool.free_bytes(), pool.total_bytes())
mark("trimmed")
time.sleep(0.4)
mark("end")
print(
    f"R cupy live={live_bytes} used_held={held[0]} free_held={held[1]} total_held={held[2]} "
    f"used_trim={trim[0]} free_trim={trim[1]} total_trim={trim[2]} fail={fails}",
    flush=True,
)
