"""What the sleep table's processes share (sleep_bench.py for PyTorch under the shim or
torch_memory_saver, sleep_bench_jax.py for JAX): the "R ..." result lines, the process's own
checks, the knobs, NVML read as another process sees the device, pinned bandwidth and the
neighbour, both through the driver API with ctypes (libcuda.so.1, present wherever the driver is,
so no framework and no CUDA runtime is needed for them).

  R kind key=value ...   one result; tests/gpu/sleep_table.py reads them

As a program, `sleep_common.py neighbour` is the neighbour: another process, started without the
shim or torch_memory_saver, answering one stdin line at a time:
  fill HEADROOM   allocate what the device has free less HEADROOM bytes (cuMemGetInfo: the device as
                  any process sees it), keep it: "filled BYTES free=FREE"
  try BYTES       cuMemAlloc BYTES and free them at once: "try RC" (0: it got them)
  quit
so that "another process can have the released bytes" is tested on a device that has no more than
HEADROOM free otherwise (on an empty 80 GB device any allocation of a few GB would succeed)."""
import ctypes
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30
MiB = 1 << 20


def knob(name, default, kind=int):
    """An environment knob: every size and count of the sleep table is one."""
    v = os.environ.get(name)
    return kind(v) if v not in (None, "") else default


# The trainers' sizes (sleep_bench.py and sleep_bench_jax.py: TinyLlama's shape) and the rounds.
ROUNDS = knob("SLEEP_ROUNDS", 3)
STEPS = knob("SLEEP_STEPS", 4)
LAYERS = knob("SLEEP_LAYERS", 22)
WIDTH = knob("SLEEP_WIDTH", 2048)
HEADS = knob("SLEEP_HEADS", 32)
KV_HEADS = knob("SLEEP_KV_HEADS", 4)
FFN = knob("SLEEP_FFN", 5632)
VOCAB = knob("SLEEP_VOCAB", 32000)
BATCH = knob("SLEEP_BATCH", 4)
SEQ = knob("SLEEP_SEQ", 512)
PINNED = knob("SLEEP_PINNED_MB", 2048) * MiB
HEADROOM = knob("SLEEP_HEADROOM_MB", 2048) * MiB
KV_FRACTION = knob("SLEEP_KV_FRACTION", 0.5, float)
SLACK = 256 * MiB  # the neighbour asks for the released bytes less this: its own rounding and the pool's tail


def say(kind, **fields):
    """One "R kind key=value ..." line; floats to 6 significant digits, the rest as they print."""
    parts = [f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()]
    print("R " + kind + (" " + " ".join(parts) if parts else ""), flush=True)


class Checks:
    """The process's own checks.  report_only: failures are printed as NOTE and not counted (a
    baseline's, torch_memory_saver's, own behaviour is reported, not judged here)."""

    def __init__(self, report_only=False):
        self.passed = self.failed = 0
        self.report_only = report_only

    def check(self, ok, what):
        if ok:
            self.passed += 1
        elif self.report_only:
            print(f"NOTE (not counted): {what}", flush=True)
        else:
            self.failed += 1
            print(f"FAIL: {what}", flush=True)
        return ok

    def done(self):
        print(f"{self.passed} passed, {self.failed} failed", flush=True)
        return 0 if self.failed == 0 else 1


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- NVML: the device as another process sees it ----------------------------------------------

class DeviceView:
    """NVML's used bytes of the GPU (tests/gpu/nvml_sampler.py's Nvml), and the process's own share:
    used minus what was used before this process started CUDA (base, read at construction, so make
    it first) minus what the neighbour holds (set once it filled).  None when NVML is missing."""

    def __init__(self):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        try:
            from nvml_sampler import Nvml  # noqa: PLC0415
            self.nvml = Nvml()
            self.base = self.nvml.used()
        except Exception as e:  # no NVML (the dry run over the emulated driver)
            print(f"R note nvml=unavailable reason={str(e).replace(' ', '_')[:80]}", flush=True)
            self.nvml, self.base = None, 0
        self.others = 0  # the neighbour's context and fill

    def used(self):
        return self.nvml.used() if self.nvml else None

    def total(self):
        return self.nvml.total() if self.nvml else None

    def own(self):
        u = self.used()
        return None if u is None else u - self.base - self.others

    def free(self):
        u = self.used()
        return None if u is None else self.total() - u


# ---- the driver API through ctypes ------------------------------------------------------------

class Driver:
    """The few driver calls the pinned-bandwidth probe and the neighbour make, on the device's
    primary context (the one PyTorch, JAX and the CUDA runtime use), made current on this thread."""

    def __init__(self):
        cu = ctypes.CDLL("libcuda.so.1")
        self.cu = cu
        self.ck(cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        cur = ctypes.c_void_p()
        if cu.cuCtxGetCurrent(ctypes.byref(cur)) != 0 or not cur.value:
            self.ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(cur), dev), "cuDevicePrimaryCtxRetain")
            self.ck(cu.cuCtxSetCurrent(cur), "cuCtxSetCurrent")
        for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuMemAllocHost_v2", "cuMemFreeHost",
                     "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuCtxSynchronize"):
            getattr(cu, name).restype = ctypes.c_int
        cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        cu.cuMemAllocHost_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]

    @staticmethod
    def ck(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    def alloc(self, n):
        p = ctypes.c_uint64()
        rc = self.cu.cuMemAlloc_v2(ctypes.byref(p), n)
        return rc, p.value

    def free(self, p):
        self.ck(self.cu.cuMemFree_v2(p), "cuMemFree")

    def mem_info(self):
        f, t = ctypes.c_size_t(), ctypes.c_size_t()
        self.ck(self.cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "cuMemGetInfo")
        return f.value, t.value


def pinned_bandwidth(nbytes, reps=3):
    """Device-to-host and host-to-device GB/s between plain device memory and page-locked host
    memory (cuMemAllocHost), the best of reps synchronous copies each way: the ceiling a kept pause
    (d2h) and its resume (h2d) are set against, measured in the same process."""
    d = Driver()
    rc, dev = d.alloc(nbytes)
    d.ck(rc, "cuMemAlloc for the pinned-bandwidth probe")
    host = ctypes.c_void_p()
    try:
        d.ck(d.cu.cuMemAllocHost_v2(ctypes.byref(host), nbytes), "cuMemAllocHost")
        d.ck(d.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        d2h = h2d = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            d.ck(d.cu.cuMemcpyDtoH_v2(host, dev, nbytes), "cuMemcpyDtoH")
            d2h = max(d2h, nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            d.ck(d.cu.cuMemcpyHtoD_v2(dev, host, nbytes), "cuMemcpyHtoD")
            d.ck(d.cu.cuCtxSynchronize(), "cuCtxSynchronize")  # a pinned HtoD may return before the DMA ends
            h2d = max(h2d, nbytes / (time.perf_counter() - t) / 1e9)
        return d2h, h2d
    finally:
        if host.value:
            d.cu.cuMemFreeHost(host)
        d.free(dev)


class Neighbour:
    """The neighbour process (this file as a program), started without LD_PRELOAD: it sees the
    device as any other process does."""

    def __init__(self, view):
        env = dict(os.environ)
        # neither the shim nor torch_memory_saver's hook; anything else preloaded (a sanitizer's
        # runtime, which an instrumented emulated driver needs first) stays
        keep = [e for e in env.get("LD_PRELOAD", "").replace(":", " ").split()
                if not e.endswith("libvmmshim.so") and "torch_memory_saver" not in e]
        if keep:
            env["LD_PRELOAD"] = " ".join(keep)
        else:
            env.pop("LD_PRELOAD", None)
        self.view = view
        before = view.used()
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "neighbour"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
        self.ready = self._ask(None).startswith("ready")
        if not self.ready:  # the rounds still run and are timed; the neighbour's checks fail
            print("R note neighbour=unavailable", flush=True)
        self.footprint_before = before

    def _ask(self, line):
        try:
            if line is not None:
                self.p.stdin.write(line + "\n")
                self.p.stdin.flush()
            return (self.p.stdout.readline() or "gone").strip()
        except (BrokenPipeError, OSError):
            return "gone"

    def fill(self, headroom):
        """Leave headroom bytes free on the device; the process's own NVML share from now on
        excludes what the neighbour holds (its context included).  Returns the bytes filled."""
        ans = self._ask(f"fill {headroom}").split()
        filled = int(ans[1]) if len(ans) > 1 and ans[0] == "filled" else 0
        if self.view.nvml and self.footprint_before is not None:
            self.view.others = self.view.used() - self.footprint_before
        return filled

    def tries(self, nbytes):
        """True when the neighbour's cudaMalloc (cuMemAlloc) of nbytes succeeded right now."""
        return self._ask(f"try {nbytes}") == "try 0"

    def close(self):
        try:
            self._ask("quit")
        except (BrokenPipeError, OSError):
            pass
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.view.others = 0


def _neighbour_main():
    d = Driver()
    print("ready", flush=True)
    held = []
    for line in sys.stdin:
        w = line.split()
        if not w or w[0] == "quit":
            break
        if w[0] == "fill":
            headroom = int(w[1])
            free, _ = d.mem_info()
            want = max(free - headroom, 0) // (2 * MiB) * (2 * MiB)
            got = 0
            while want >= 64 * MiB:  # one block, a little smaller each time the driver says no
                rc, p = d.alloc(want)
                if rc == 0:
                    held.append(p)
                    got += want
                    break
                want -= 256 * MiB
            print(f"filled {got} free={d.mem_info()[0]}", flush=True)
        elif w[0] == "try":
            rc, p = d.alloc(int(w[1]))
            if rc == 0:
                d.free(p)
            print(f"try {rc}", flush=True)
        else:
            print(f"unknown {w[0]}", flush=True)
    for p in held:
        d.free(p)


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call, wall clock."""
    t = time.perf_counter()
    r = fn(*args, **kwargs)
    return r, time.perf_counter() - t


if __name__ == "__main__":
    if sys.argv[1:2] == ["neighbour"]:
        _neighbour_main()
    else:
        print("usage: sleep_common.py neighbour", file=sys.stderr)
        sys.exit(2)
