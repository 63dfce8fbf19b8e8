"""Rows i and j: CuPy with its default memory pool (argument "default") or with
cupy.cuda.MemoryAsyncPool (argument "async").  Exact integer results.  Pauses once."""
import os
import sys

import cupy as cp

mode = sys.argv[1] if len(sys.argv) > 1 else "default"
if mode == "async":
    cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
print(f"# cupy {cp.__version__}, allocator {mode}")
a = cp.arange(1 << 20, dtype=cp.int64) % 1000
b = a * 3 + 7
print("elementwise: sum", int(b.sum()))
m = (cp.arange(256 * 256, dtype=cp.int64) % 11 - 5).astype(cp.float64).reshape(256, 256)
mm = m @ m
print("matmul: trace", int(mm.trace()), "sum", int(mm.sum()))
big = cp.zeros(64 << 20, dtype=cp.uint8)
big[::4096] = 3
print("big: sum", int(big.sum()))
total = 0
for i in range(24):
    t = cp.full(((i * 37) % 50 + 1) << 14, i, dtype=cp.int32)
    total += int(t.sum())
    del t
print("churn: total", total)
cp.cuda.Device().synchronize()
print(f"# a at 0x{a.data.ptr:x}, big at 0x{big.data.ptr:x}")
print(f"# pause {os.getpid()}", flush=True)
sys.stdin.readline()
del a, b, m, mm, big
print("done")
