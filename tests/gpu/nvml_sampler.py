"""Device memory as another process sees it: NVML's used memory of one GPU, sampled every ~2 ms
from a thread of this process (which never starts CUDA), for tests/gpu/bench_mem.py.  Never
cudaMemGetInfo inside the measured program: under the shim it counts the pool's free bytes as free.

NVML through ctypes (libnvidia-ml.so.1), else pynvml.  The GPU is NVML index BENCH_NVML_INDEX
(default: the first entry of CUDA_VISIBLE_DEVICES when it is a number, else 0).

As a program:  nvml_sampler.py [--interval-ms 2] [--baseline-ms 300] -- COMMAND ARGS...
takes a baseline before COMMAND starts, samples until it exits, and prints
"NVML baseline=B peak=P steady=S samples=N" (bytes; peak and steady above the baseline; steady is
the median of the second half of the run, or of the window between the command's
"M steady_begin t=" and "M steady_end t=" lines when it prints them)."""
import ctypes
import os
import statistics
import subprocess
import sys
import threading
import time


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def default_index():
    v = os.environ.get("BENCH_NVML_INDEX")
    if v:
        return int(v)
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class Nvml:
    """used() and total() in bytes for one GPU.  Raises RuntimeError when NVML cannot be had."""

    def __init__(self, index=None):
        index = default_index() if index is None else index
        self._py = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
            if init() != 0:
                raise RuntimeError("nvmlInit failed")
            get = getattr(lib, "nvmlDeviceGetHandleByIndex_v2", None) or lib.nvmlDeviceGetHandleByIndex
            self._h = ctypes.c_void_p()
            rc = get(ctypes.c_uint(index), ctypes.byref(self._h))
            if rc != 0:
                raise RuntimeError(f"nvmlDeviceGetHandleByIndex({index}) returned {rc}")
            self._get = lib.nvmlDeviceGetMemoryInfo
            self._mem = _Memory()
            self.how = "libnvidia-ml.so.1 via ctypes"
        except (OSError, AttributeError, RuntimeError) as e:
            try:
                import pynvml  # noqa: PLC0415 (only when ctypes could not)

                pynvml.nvmlInit()
                self._py = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
                self.how = "pynvml"
            except Exception as e2:  # no NVML at all
                raise RuntimeError(f"{e}; pynvml: {e2}") from None
        self.index = index

    def info(self):
        if self._py:
            m = self._py[0].nvmlDeviceGetMemoryInfo(self._py[1])
            return m.used, m.total
        rc = self._get(self._h, ctypes.byref(self._mem))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetMemoryInfo returned {rc}")
        return self._mem.used, self._mem.total

    def used(self):
        return self.info()[0]

    def total(self):
        return self.info()[1]


class Sampler:
    """A thread appending (time.monotonic(), used bytes) every interval until stop()."""

    def __init__(self, nvml, interval_ms=2.0):
        self.nvml, self.interval = nvml, interval_ms / 1000.0
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        nxt = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.nvml.used()))
            nxt += self.interval
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.samples


# Window helpers over a list of (t, used) samples; None when the window holds no sample.
def window(samples, t0=None, t1=None):
    return [u for t, u in samples if (t0 is None or t >= t0) and (t1 is None or t <= t1)]


def wmedian(samples, t0=None, t1=None):
    w = window(samples, t0, t1)
    return statistics.median(w) if w else None


def wmax(samples, t0=None, t1=None):
    w = window(samples, t0, t1)
    return max(w) if w else None


def first_at_or_below(samples, t0, level):
    """Seconds from t0 to the first sample at or after t0 with used <= level, or None."""
    for t, u in samples:
        if t >= t0 and u <= level:
            return t - t0
    return None


def marks(text):
    """{name: t} from "M name t=SECONDS" lines (the first of each name)."""
    out = {}
    for line in text.splitlines():
        w = line.split()
        if len(w) >= 3 and w[0] == "M" and w[2].startswith("t="):
            try:
                out.setdefault(w[1], float(w[2][2:]))
            except ValueError:
                pass
    return out


def main(argv):
    interval, base_ms = 2.0, 300.0
    while argv and argv[0] != "--":
        opt = argv.pop(0)
        if opt == "--interval-ms":
            interval = float(argv.pop(0))
        elif opt == "--baseline-ms":
            base_ms = float(argv.pop(0))
        else:
            print(f"nvml_sampler: unknown option {opt}", file=sys.stderr)
            return 2
    if not argv[1:]:
        print("usage: nvml_sampler.py [--interval-ms MS] [--baseline-ms MS] -- COMMAND ARGS...", file=sys.stderr)
        return 2
    nvml = Nvml()
    s = Sampler(nvml, interval).start()
    time.sleep(base_ms / 1000.0)
    t_start = time.monotonic()
    p = subprocess.run(argv[1:], stdout=subprocess.PIPE, text=True)
    t_end = time.monotonic()
    samples = s.stop()
    sys.stdout.write(p.stdout)
    base = wmedian(samples, None, t_start)
    m = marks(p.stdout)
    if "steady_begin" in m and "steady_end" in m:
        steady = wmedian(samples, m["steady_begin"], m["steady_end"])
    else:
        steady = wmedian(samples, (t_start + t_end) / 2, t_end)
    peak = wmax(samples, t_start, t_end)
    fmt = lambda v: "na" if v is None or base is None else str(int(v - base))  # noqa: E731
    print(f"NVML baseline={base if base is None else int(base)} peak={fmt(peak)} steady={fmt(steady)} "
          f"samples={len(samples)} via={nvml.how.replace(' ', '_')}")
    return p.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
