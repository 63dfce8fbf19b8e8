"""Stream-ordered frees on the per-thread default stream (cudaStreamPerThread), under the shim over
the emulated driver with the device lagging (FAKECUDA_EVENT_DELAY_US), so no free is reached while
the test runs.  That one handle names a stream of each thread: a block freed on thread A's is handed
out again at once to thread A, but to thread B only with B's stream made to wait for the free
(cuStreamWaitEvent, counted by the emulated driver) or not at all; before, the pool took both for
the same stream and gave B the block with no wait.
Ends with "N passed, N failed"."""
import json
import subprocess
import sys

import harness
from harness import PACKAGE

harness.setup()
T = harness.Tally()

CHILD = r"""
import ctypes, json, sys, threading
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMallocAsync.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p]
rt.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
PER_THREAD = ctypes.c_void_p(2)  # cudaStreamPerThread
names = sys.argv[1].split(",")
class Counters(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in names]
def waits():
    c = Counters()
    ctypes.CDLL("libcuda.so.1").fakecuda_counters(ctypes.byref(c))
    return c.calls_cuStreamWaitEvent
def alloc():
    p = ctypes.c_void_p()
    assert rt.cudaMallocAsync(ctypes.byref(p), 4 << 20, PER_THREAD) == 0
    return p.value
out = {}
def thread_a():
    p = alloc()
    assert rt.cudaFreeAsync(p, PER_THREAD) == 0
    w = waits()
    q = alloc()
    out["a"] = [p, q, waits() - w]
    assert rt.cudaFreeAsync(q, PER_THREAD) == 0
def thread_b():
    w = waits()
    r = alloc()
    out["b"] = [r, waits() - w]
for f in (thread_a, thread_b):
    t = threading.Thread(target=f)
    t.start()
    t.join()
print(json.dumps(out))
"""


def main():
    try:
        env = harness.preload_env({"FAKECUDA_EVENT_DELAY_US": "3000000"})
        r = subprocess.run([sys.executable, "-c", CHILD, ",".join(harness._counter_names())], capture_output=True,
                           text=True, env=env, timeout=120)
        if T.check(r.returncode == 0, f"the child under the shim: rc {r.returncode} {r.stdout} {r.stderr[-1500:]}"):
            out = json.loads(r.stdout.strip().splitlines()[-1])
            p, q, a_waits = out["a"]
            got, b_waits = out["b"]
            T.check(q == p and a_waits == 0,
                    f"thread A gets its own free back at once, on its own stream, with no wait: {out['a']}")
            T.check(got != p or b_waits >= 1,
                    f"thread B, on its own per-thread stream, gets that block only after a wait for the free: "
                    f"{hex(got)} against {hex(p)}, {b_waits} waits")
    finally:
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
