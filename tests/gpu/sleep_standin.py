"""tests/gpu/sleep.sh --dry's stand-in for sleep_bench.py: no torch and no GPU, run under the shim
(or torch_memory_saver's preload hook, --tms) over the emulated driver and runtime (build/fakecuda
first on LD_LIBRARY_PATH).  Its "model" is cudaMalloc'd buffers, weights untagged and "optimizer
state" under the tag "optim"; a step rewrites each state buffer from its own bytes and its "loss" is
a hash of the state, so a pause that lost or moved a byte shows in the losses.  The rest is
sleep_bench.py's: a reference run that never sleeps, the rounds (pause kept, the neighbour, resume,
more steps), a tensor under "kv" paused with discard, the same "R ..." lines and checks, through the
same sleep_common.  What NVML would show is the emulated driver's phys_bytes_live (the bytes this
process holds on its emulated device, fakecuda.h's counters), so the pause's release is checked
here too, torch_memory_saver's included (these check the stand-in, not the baseline).  The emulated
device is per process, so the neighbour's check is printed as a NOTE, not counted: it proves
nothing here.
  --tms   torch_memory_saver's C API in the preloaded hook (tms_set_current_tag, tms_pause, ...),
          its CPU backup in mmap memory (TMS_INIT_CPU_BACKUP_BACKEND=mmap: the emulated runtime has no
          cudaMallocHost)
SLEEP_STANDIN_CRASH=1: after its first round it writes a line to stderr and dies (SIGABRT), as a
crashed trainer would."""
import ctypes
import hashlib
import os
import re
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))
sys.path.insert(0, HERE)
from sleep_common import MiB, Checks, Driver, Neighbour, knob, pinned_bandwidth, say  # noqa: E402

MODE = "tms" if "--tms" in sys.argv else "shim"
T0 = time.perf_counter()


class FakeView:
    """sleep_common.DeviceView over the emulated driver: own() is its phys_bytes_live counter."""

    def __init__(self):
        with open(os.path.join(HERE, "..", "fakecuda", "fakecuda.h")) as f:
            header = f.read()
        block = header[header.index("#define FAKECUDA_COUNTER_FIELDS"):header.index("#define FAKECUDA_COUNTER_MEMBER")]
        names = re.findall(r"X\((\w+)\)", block)
        self.index, self.n = names.index("phys_bytes_live"), len(names)
        self.fake = ctypes.CDLL("libcuda.so.1")
        self.nvml, self.others = True, 0

    def own(self):
        c = (ctypes.c_ulonglong * self.n)()
        self.fake.fakecuda_counters(ctypes.byref(c))
        return c[self.index]

    used = own

    def free(self):
        return None


view = FakeView()
ROUNDS = knob("SLEEP_ROUNDS", 3)
STEPS = knob("SLEEP_STEPS", 4)
PINNED = knob("SLEEP_PINNED_MB", 16) * MiB
HEADROOM = knob("SLEEP_HEADROOM_MB", 32) * MiB
KV_FRACTION = knob("SLEEP_KV_FRACTION", 0.5, float)
STATE = [3 * MiB + 4096, 2 * MiB, 5 * MiB, 4096]  # the "optimizer state" buffers
WEIGHTS = [1 * MiB, 3 * MiB]
checks = Checks()
nb_checks = Checks(report_only=True)

# the runtime in the global scope, and its calls looked up there: a program's cudaMalloc reaches the
# preloaded hook (the shim's, TMS's) first, where a lookup in the runtime's own handle would not
ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
rt = ctypes.CDLL(None)
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
H2D, D2H = 1, 2
rt.cudaSetDevice(0)
rt.cudaFree(None)  # the context, as a framework makes it before its first allocation

if MODE == "tms":
    hook = ctypes.CDLL(None)
    hook.tms_set_current_tag.argtypes = [ctypes.c_char_p]
    hook.tms_set_interesting_region.argtypes = [ctypes.c_bool]
    hook.tms_set_enable_cpu_backup.argtypes = [ctypes.c_bool]
    hook.tms_pause.argtypes = hook.tms_resume.argtypes = [ctypes.c_char_p]
else:
    import vmmshim  # noqa: E402


def malloc(n, tag=None, keep=True):
    p = ctypes.c_void_p()
    if tag and MODE == "tms":
        hook.tms_set_current_tag(tag.encode())
        hook.tms_set_interesting_region(True)
        hook.tms_set_enable_cpu_backup(keep)
        try:
            rc = rt.cudaMalloc(ctypes.byref(p), n)
        finally:
            hook.tms_set_interesting_region(False)
            hook.tms_set_current_tag(b"default")
    elif tag:
        with vmmshim.region(tag):
            rc = rt.cudaMalloc(ctypes.byref(p), n)
    else:
        rc = rt.cudaMalloc(ctypes.byref(p), n)
    if rc != 0:
        raise RuntimeError(f"cudaMalloc({n}) returned {rc}")
    return p.value


def read(p, n):
    buf = ctypes.create_string_buffer(n)
    assert rt.cudaMemcpy(buf, p, n, D2H) == 0
    return buf.raw


def write(p, data):
    assert rt.cudaMemcpy(p, data, len(data), H2D) == 0


TABLE = bytes((b * 5 + 1) & 0xFF for b in range(256))


def model():
    w = [malloc(n) for n in WEIGHTS]
    for i, (p, n) in enumerate(zip(w, WEIGHTS)):
        write(p, bytes([(i + 3) & 0xFF]) * n)
    s = [malloc(n, "optim") for n in STATE]
    for i, (p, n) in enumerate(zip(s, STATE)):
        write(p, bytes(range(256)) * (n // 256) + bytes(n % 256))
    return w, s


def steps(m, n):
    losses = []
    for _ in range(n):
        h = hashlib.blake2b(digest_size=8)
        for p, size in zip(m[1], STATE):
            data = read(p, size).translate(TABLE)
            write(p, data)
            h.update(data)
        losses.append(h.hexdigest())
    return losses


def free(m):
    for p in m[0] + m[1]:
        rt.cudaFree(p)


def pause(tag, keep):
    t = time.perf_counter()
    if MODE == "tms":
        hook.tms_pause(tag.encode())
        return time.perf_counter() - t, None
    rep = vmmshim.pause(tag, keep=keep)
    return time.perf_counter() - t, rep


def resume(tag):
    t = time.perf_counter()
    if MODE == "tms":
        hook.tms_resume(tag.encode())
        return time.perf_counter() - t, None
    rep = vmmshim.resume(tag)
    return time.perf_counter() - t, rep


def main():
    say("setup", mode=MODE + "-standin", alloc_conf="standin", backend="emulated", layers=0, width=0, rounds=ROUNDS,
        steps=STEPS, device="emulated")
    d2h, h2d = pinned_bandwidth(PINNED)
    say("pinned", d2h=d2h, h2d=h2d, bytes=PINNED)
    t = time.perf_counter()
    m = model()
    reference = steps(m, STEPS * (ROUNDS + 1))
    free(m)
    ref_s = time.perf_counter() - t
    m = model()
    losses = steps(m, STEPS)
    made = sum(STATE)
    say("model", params=sum(WEIGHTS), optim_bytes=made, reference_s=ref_s)
    nb = Neighbour(view)
    filled = nb.fill(HEADROOM)
    ask = max(made - 4096, 0)
    say("neighbour", filled=filled, footprint=view.others, headroom=HEADROOM, asks=ask)
    for r in range(ROUNDS):
        before = view.own()
        got_before = nb.tries(ask)
        pause_s, rep = pause("optim", True)
        paused = view.own()
        got = nb.tries(ask)
        resume_s, back = resume("optim")
        resumed = view.own()
        kept = rep.bytes_kept if rep else made
        say("sleep", round=r, pause_s=pause_s, bytes=kept, pause_GBps=kept / pause_s / 1e9,
            released=rep.bytes_released if rep else made, resume_s=resume_s,
            resume_GBps=(back.bytes_kept if back else made) / resume_s / 1e9, nvml_before=before, nvml_paused=paused,
            nvml_resumed=resumed, neighbour_before=int(got_before), neighbour=int(got),
            not_shim=rep.bytes_not_shim if rep else 0, shim_pause_s=rep.seconds if rep else -1.0,
            shim_resume_s=back.seconds if back else -1.0)
        if rep:
            checks.check(rep.bytes_kept >= made and rep.bytes_released >= made,
                         f"round {r}: the pause kept {rep.bytes_kept} and released {rep.bytes_released} of {made}")
        checks.check(before - paused >= made and resumed == before,
                     f"round {r}: the emulated device's bytes {before} before, {paused} paused, {resumed} resumed "
                     f"for {made}")
        nb_checks.check(got and not got_before, f"round {r}: the neighbour (per-process emulated device here)")
        if r == 0 and os.environ.get("SLEEP_STANDIN_CRASH") == "1":
            print("sleep_standin: dying on purpose (SLEEP_STANDIN_CRASH=1)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGABRT)
        losses += steps(m, STEPS)
    nb.close()
    same = losses == reference[:len(losses)]
    first = next((i for i, (a, b) in enumerate(zip(losses, reference)) if a != b), -1)
    say("losses", equal=int(same), first_differing_step=first, steps=len(losses), last=losses[-1],
        reference_last=reference[len(losses) - 1])
    checks.check(same, f"losses after sleeping equal a run that never slept (first differing step {first})")
    free(m)

    n = int(Driver().mem_info()[0] * KV_FRACTION) // (2 * MiB) * (2 * MiB)
    kv = malloc(n, "kv", keep=False)
    for r in range(ROUNDS):
        before = view.own()
        pause_s, rep = pause("kv", False)
        paused = view.own()
        resume_s, back = resume("kv")
        checks.check(before - paused >= n and view.own() == before,
                     f"kv round {r}: the emulated device's bytes {before} before, {paused} paused for {n}")
        say("kv", round=r, bytes=n, pause_s=pause_s, resume_s=resume_s, released=rep.bytes_released if rep else n,
            kept=rep.bytes_kept if rep else 0)
        if rep:
            checks.check(rep.bytes_kept == 0 and rep.bytes_released >= n, f"kv round {r}: {rep}")
    rt.cudaFree(kv)
    say("done", seconds=time.perf_counter() - T0)
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
