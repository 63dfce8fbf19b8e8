"""vmmshim's stand-in for torch_memory_saver (tools/python/vmmshim/_tms, vmmshim/_saver.py) over the
emulated driver, with a stand-in for the torch calls it makes (no torch here): its tensors are real
cudaMalloc'd memory under the shim, written and read with cudaMemcpy.
Checks:
- the switch: the README's line runs SGLang's command (a stand-in sglang.launch_server) with the
  stand-in, and its scheduler child too; `vmmshim run --torch-memory-saver` resolves `import torch_memory_saver` to the stand-in,
  sets VMMSHIM_SLEEP_ADOPTED=1, and a plain `vmmshim run` does not; configure_subprocess() starts
  children under the shim that import the stand-in, and restores the environment after; with the
  real TMS's hook in LD_PRELOAD, `vmmshim run --torch-memory-saver` refuses in one line and an import
  of the stand-in raises one line; outside the shim the first region says how to start under it;
- the API: each (tag, backup) pair is its own shim tag in the registry; a tag's pause takes only that
  tag, a pause of everything every region's memory and nothing outside; pausing or resuming twice is
  no error, and any order works; a CPU-backed tag comes back bit-exact, a discarded one does not keep
  its bytes; get_cpu_backup gives the contents while paused, None once resumed, and with
  retain_cpu_backup the same host buffer cycle after cycle, with each pause's contents; memory_margin_bytes
  refuses new memory as out-of-memory; nested regions
  restore the outer config; two TorchMemorySaver instances share the pauses; PyTorch's cache is
  emptied once every tag sleeps; a tag longer than the shim's 31 bytes is shortened;
- TMS_INIT_ENABLE=1: memory allocated outside every region is the "default" tag, kept with
  TMS_INIT_ENABLE_CPU_BACKUP=1; what a thread allocates inside disable() is never paused.
Ends with "N passed, N failed"."""
import json
import os
import subprocess
import sys

import harness
from harness import BUILD, PACKAGE

harness.setup()
T = harness.Tally()
VMMSHIM = [sys.executable, "-m", "vmmshim"]

FAKE_TORCH = r"""
import contextlib, ctypes, sys, types
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
log = []

class Tensor:
    is_cuda = True
    dtype = "uint8"
    def __init__(self, n):
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), n) == 0
        self.ptr, self.nbytes, self.shape = p.value, n, (n,)
    def data_ptr(self): return self.ptr
    def is_contiguous(self): return True
    def write(self, byte):
        buf = (ctypes.c_uint8 * self.nbytes)(*([byte] * self.nbytes))
        assert rt.cudaMemcpy(self.ptr, buf, self.nbytes, 1) == 0
    def read(self):
        buf = (ctypes.c_uint8 * self.nbytes)()
        assert rt.cudaMemcpy(buf, self.ptr, self.nbytes, 2) == 0
        return bytes(buf)

class Host:
    def __init__(self, buf): self.buf = buf
    def view(self, *a): return self
    def address(self): return ctypes.addressof(ctypes.c_char.from_buffer(self.buf))

torch = types.ModuleType("torch")
torch.uint8 = "uint8"
torch.frombuffer = lambda buf, dtype: Host(buf)
torch.empty = lambda *a, **k: Host(bytearray())
cuda = torch.cuda = types.SimpleNamespace()
torch._C = types.SimpleNamespace(_cuda_clearCublasWorkspaces=lambda: log.append("clear"))
cuda.is_initialized = lambda: True
cuda.get_allocator_backend = lambda: "native"
cuda.device_count = lambda: 1
cuda.current_device = lambda: 0
snapshot = []  # the segments PyTorch would report: a child fills it
cuda.memory_snapshot = lambda: snapshot
cuda.empty_cache = lambda: log.append("empty_cache")
pools = []
class MemPool:
    def __init__(self): pools.append(self)
cuda.MemPool = MemPool
@contextlib.contextmanager
def use_mem_pool(pool):
    log.append(("pool", pools.index(pool)))
    yield
cuda.use_mem_pool = use_mem_pool
sys.modules["torch"] = torch

class Counters(ctypes.Structure):  # the emulated driver's (argv[1]: their names, from fakecuda.h)
    _fields_ = [(n, ctypes.c_ulonglong) for n in sys.argv[1].split(",")]

def phys():
    c = Counters()
    ctypes.CDLL("libcuda.so.1").fakecuda_counters(ctypes.byref(c))
    return c.phys_bytes_live
"""

API_CHILD = FAKE_TORCH + r"""
import json, os, vmmshim
import torch_memory_saver
from torch_memory_saver import TorchMemorySaver
S = torch_memory_saver.torch_memory_saver
out = {"module": torch_memory_saver.__file__}
MiB = 1 << 20

def states():
    with vmmshim.Registry() as reg:
        return {hex(a.address): [a.tag, a.paused] for a in reg.allocations(os.getpid())}

def state(t):
    return states().get(hex(t.ptr))

S.hook_mode = "preload"
with S.region(tag="weights", enable_cpu_backup=True):
    out["tag_in_region"] = vmmshim.thread_tag()
    w = Tensor(4 * MiB); w.write(0xA1)
with S.region(tag="kv_cache"):
    kv = Tensor(4 * MiB); kv.write(0xB2)
out["tag_after"] = vmmshim.thread_tag()
plain = Tensor(2 * MiB); plain.write(0xC3)
out["tags"] = [state(w)[0], state(kv)[0], state(plain)[0]]
out["pools"] = [e for e in log if e[0] == "pool"]

def cached(t):  # t's memory as a segment of PyTorch's cache with no block in use
    return {"address": t.ptr, "total_size": t.nbytes, "allocated_size": 0, "segment_pool_id": (1, 0)}
S.pause("kv_cache")
out["after_kv"] = [state(w)[1], state(kv)[1], state(plain)[1]]
freed = Tensor(8 * MiB)
rt.cudaFree.argtypes = [ctypes.c_void_p]
assert rt.cudaFree(freed.ptr) == 0   # held by the shim for quick reuse (VMMSHIM_GIVE_BACK_HOLD)
out["held_before"] = phys()
del log[:]
snapshot[:] = [cached(w)]
S.pause()
out["empty_cache_paused_only"] = log.count("empty_cache")
S.resume()
snapshot[:] = [cached(w), cached(plain)]
del log[:]
S.pause()
out["held_after"] = phys()
out["after_all"] = [state(w)[1], state(kv)[1], state(plain)[1]]
out["empty_cache"] = log.count("empty_cache")
S.pause()
S.pause("weights")
out["twice_ok"] = True
b = S.get_cpu_backup(w)
out["backup_paused"] = b is not None and bytes(b.buf) == bytes([0xA1]) * (4 * MiB)
out["backup_discarded"] = S.get_cpu_backup(kv) is None
S.resume("weights")
out["after_resume_w"] = [state(w)[1], state(kv)[1]]
out["w_exact"] = w.read() == bytes([0xA1]) * (4 * MiB)
out["backup_after_resume"] = S.get_cpu_backup(w) is None
S.resume()
S.resume()
out["kv_awake"] = state(kv)[1] is False
out["kv_dropped"] = kv.read() != bytes([0xB2]) * (4 * MiB)
out["plain_exact"] = plain.read() == bytes([0xC3]) * (2 * MiB)

S.retain_cpu_backup = True
S.pause("weights")
p1 = S.get_cpu_backup(w, zero_copy=True)
S.resume("weights")
p2 = S.get_cpu_backup(w, zero_copy=True)
out["retained"] = p2 is not None and p1.address() == p2.address() and bytes(p2.buf[:16]) == bytes([0xA1]) * 16
w.write(0xD4)
S.pause("weights")
p3 = S.get_cpu_backup(w, zero_copy=True)
out["retained_refreshed"] = p3.address() == p1.address() and bytes(p3.buf[:16]) == bytes([0xD4]) * 16
S.retain_cpu_backup = False
S.resume("weights")
out["released"] = S.get_cpu_backup(w) is None and w.read()[:16] == bytes([0xD4]) * 16

S.pause("kv_cache")
vmmshim.resume("kv_cache")   # behind the stand-in's back
S.pause("kv_cache")
out["repaused"] = state(kv)[1]
S.resume("kv_cache")
out["reawake"] = state(kv)[1]

cd = S._impl._binary_wrapper.cdll
with S.region(tag="outer", enable_cpu_backup=True):
    with S.region(tag="inner"):
        inner = [cd.tms_get_current_tag().decode(), cd.tms_get_enable_cpu_backup(), vmmshim.thread_tag()]
    outer = [cd.tms_get_current_tag().decode(), cd.tms_get_enable_cpu_backup(), vmmshim.thread_tag()]
out["nested"] = [inner, outer, [cd.tms_get_current_tag().decode(), cd.tms_get_interesting_region()]]

c = ctypes.CDLL(None)
c.tms_pause(b"kv_cache")
out["c_pause"] = [state(w)[1], state(kv)[1]]
c.tms_resume(None)
out["c_resume"] = state(kv)[1]

S2 = TorchMemorySaver()
with S2.region(tag="second"):
    x = Tensor(2 * MiB)
S.pause("second")
out["instances_share"] = state(x)[1]
S2.resume("second")
out["instances_resume"] = state(x)[1]

def try_alloc(n):
    p = ctypes.c_void_p()
    rc = rt.cudaMalloc(ctypes.byref(p), n)
    if rc == 0:
        rt.cudaFree(p)
    return rc
S.memory_margin_bytes = 1 << 50    # more than the device has: no new memory at all
out["margin_refused"] = try_alloc(64 * MiB)
S.memory_margin_bytes = 0
out["margin_off"] = try_alloc(64 * MiB)

with S.region(tag="t" * 40, enable_cpu_backup=True):
    out["long_tag"] = vmmshim.thread_tag()
print(json.dumps(out))
"""

INIT_CHILD = FAKE_TORCH + r"""
import json, os, vmmshim
import torch_memory_saver
S = torch_memory_saver.torch_memory_saver
cd = S._impl._binary_wrapper.cdll if S._impl else None
out = {}
MiB = 1 << 20
def state(t):
    with vmmshim.Registry() as reg:
        return next([a.tag, a.paused] for a in reg.allocations(os.getpid()) if a.address == t.ptr)
a = Tensor(4 * MiB); a.write(0x5A)
with S.region(tag="grad", enable_cpu_backup=False):
    g = Tensor(2 * MiB)
S._ensure_initialized()
cd = S._impl._binary_wrapper.cdll
snapshot[:] = [{"address": a.ptr, "total_size": a.nbytes, "allocated_size": 0, "segment_pool_id": (1, 0)}]
out["init"] = [cd.tms_get_interesting_region(), cd.tms_get_enable_cpu_backup(), cd.tms_get_current_tag().decode()]
S.pause()
out["paused"] = [state(a)[1], state(g)[1]]
out["kept_cache"] = log.count("empty_cache") == 0
with S.disable():
    d = Tensor(2 * MiB); d.write(0x11)
    out["disabled_tag"] = vmmshim.thread_tag()
    out["disabled_awake"] = state(d)[1] is False and d.read()[:4] == bytes([0x11]) * 4
    spent = Tensor(8 * MiB)
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    assert rt.cudaFree(spent.ptr) == 0   # as the pool's cache emptied at the exit: held for quick reuse
    held = phys()
out["disable_exit_gives_back"] = held - phys() >= 8 * MiB
out["tag_after_disable"] = vmmshim.thread_tag()
S.pause()
out["disabled_never_paused"] = state(d)[1] is False
S.resume()
out["a_exact"] = a.read() == bytes([0x5A]) * (4 * MiB)
print(json.dumps(out))
"""


C_ONLY_CHILD = r"""
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
p = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(p), 6912) == 0
one = ctypes.c_ubyte(0xA5)
assert rt.cudaMemcpy(p, ctypes.byref(one), 1, 1) == 0
import vmmshim
def paused():
    with vmmshim.Registry() as reg:
        return next(a.paused for a in reg.allocations(os.getpid()) if a.address == p.value)
c = ctypes.CDLL(None)
out = [c.tms_pause(b"other"), paused(), c.tms_pause(None), paused(), c.tms_resume(None), paused()]
back = ctypes.c_ubyte()
assert rt.cudaMemcpy(ctypes.byref(back), p, 1, 2) == 0
out.append(back.value)
print(json.dumps(out))
"""


def test_c_entries():
    """Without the stand-in imported, TMS's C entry points pause what TMS_INIT_ENABLE=1 makes TMS's
    "default" (untagged memory, kept with TMS_INIT_ENABLE_CPU_BACKUP=1), and another tag is nothing."""
    env = harness.preload_env({"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    r = subprocess.run([sys.executable, "-c", C_ONLY_CHILD, str(PACKAGE)], capture_output=True, text=True, env=env,
                       timeout=120)
    out = last_json(r, "the C entry points child")
    T.check(out == [0, False, 0, True, 0, False, 0xA5],
            f"tms_pause('other') nothing, tms_pause(NULL) the untagged memory, tms_resume(NULL) it back kept: {out}")


def child(script, env, tms_path=True):
    if tms_path:
        env = dict(env, PYTHONPATH=os.pathsep.join([str(PACKAGE / "vmmshim" / "_tms"), str(PACKAGE)]))
    fields = ",".join(harness._counter_names())
    return subprocess.run([sys.executable, "-c", script, fields], capture_output=True, text=True, env=env, timeout=120)


def last_json(run, what):
    if not T.check(run.returncode == 0, f"{what}: rc {run.returncode}\n{run.stdout[-1500:]}{run.stderr[-2500:]}"):
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def registry_allocations(pid):
    """pid's allocations in the test's registry; none where no process made the registry yet."""
    sys.path.insert(0, str(PACKAGE))
    import vmmshim
    try:
        with vmmshim.Registry() as reg:
            return [a for a in reg.allocations() if a.pid == pid]
    except vmmshim.NotFound:
        return []


def test_switch():
    env = dict(os.environ, VMMSHIM_SHIM_LIB=str(BUILD / "libvmmshim.so"), PYTHONPATH=str(PACKAGE))
    env.pop("VMMSHIM_SLEEP_ADOPTED", None)
    probe = ("import os, ctypes, torch_memory_saver as t; "
             "print(t.BACKEND, os.environ.get('VMMSHIM_SLEEP_ADOPTED'), hasattr(ctypes.CDLL(None), 'vmm_pause_ex'))")
    r = subprocess.run(VMMSHIM + ["run", "--torch-memory-saver", "--", sys.executable, "-c", probe],
                       capture_output=True, text=True, env=env, timeout=60)
    T.check(r.returncode == 0 and r.stdout.split() == ["vmmshim", "1", "True"],
            f"run --torch-memory-saver: the stand-in, adopted memory pausable, under the shim: {r.stdout!r} {r.stderr!r}")
    r = subprocess.run(VMMSHIM + ["run", "--", sys.executable, "-c", "import torch_memory_saver"],
                       capture_output=True, text=True, env=env, timeout=60)
    T.check(r.returncode != 0 and "ModuleNotFoundError" in r.stderr,
            f"a plain `vmmshim run` leaves torch_memory_saver unresolved: rc {r.returncode} {r.stderr[-300:]!r}")
    # a real library under the hook's name (the NCCL stand-in: it does nothing when loaded)
    hook = os.path.join(os.environ["VMMSHIM_BROKER_DIR"], "torch_memory_saver_hook_mode_preload_cu13.abi3.so")
    os.makedirs(os.path.dirname(hook), exist_ok=True)
    with open(BUILD / "tests" / "libnccl-standin.so", "rb") as src, open(hook, "wb") as dst:
        dst.write(src.read())
    # behind whatever is preloaded already (the ASan runtime must stay first)
    with_hook = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), hook) if p)
    r = subprocess.run(VMMSHIM + ["run", "--torch-memory-saver", "--", "true"], capture_output=True, text=True,
                       env=dict(env, LD_PRELOAD=with_hook), timeout=60)
    lines = r.stderr.strip().splitlines()
    T.check(r.returncode == 2 and len(lines) == 1 and lines[0].startswith("vmmshim: error:") and hook in lines[0],
            f"the real TMS's hook preloaded: run refuses in one line: rc {r.returncode} {r.stderr!r}")
    r = child("import torch_memory_saver", dict(env, LD_PRELOAD=with_hook))
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    T.check(r.returncode != 0 and last.startswith("ImportError: vmmshim: error:") and "LD_PRELOAD" in last,
            f"the real TMS's hook preloaded: importing the stand-in raises one line: {last!r}")
    # both preloaded with no stand-in (a plain `vmmshim run` of a job that uses the real TMS, whose
    # configure_subprocess adds its hook): the shim steps aside in one line, and TMS gets the calls
    both = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(BUILD / "libvmmshim.so"), hook) if p)
    alloc = ("import ctypes, os\nrt = ctypes.CDLL('libcudart.so.13')\n"
             "rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]\n"
             "p = ctypes.c_void_p()\nprint(rt.cudaMalloc(ctypes.byref(p), 1 << 20), os.getpid())\n")
    for strict in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", alloc], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=both, VMMSHIM_STRICT=strict))
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("vmmshim:")]
        word = "error" if strict == "1" else "warning"
        out = r.stdout.split()
        mine = registry_allocations(int(out[-1])) if out else []
        T.check(r.returncode == 0 and len(lines) == 1 and lines[0].startswith(f"vmmshim: {word}:") and
                "torch_memory_saver_hook_mode_preload_cu13" in lines[0] and not mine and
                out[:1] == (["0"] if strict == "0" else [out[0]]) and (strict == "0" or out[0] != "0"),
                f"both hooks preloaded (VMMSHIM_STRICT={strict}): one {word} line, nothing backed by the shim, "
                f"cudaMalloc {'passed through' if strict == '0' else 'refused'}: {r.stdout!r} {r.stderr[-400:]!r}")
    spawn = ("import os, subprocess, sys, torch_memory_saver as t\n"
             "before = os.environ.get('LD_PRELOAD')\n"
             "with t.configure_subprocess():\n"
             "    out = subprocess.run([sys.executable, '-c', 'import ctypes, torch_memory_saver as t; "
             "print(t.BACKEND, hasattr(ctypes.CDLL(None), \"vmm_pause_ex\"))'], capture_output=True, text=True)\n"
             "print(out.stdout.strip(), os.environ.get('LD_PRELOAD') == before, out.stderr[-300:])\n")
    r = child(spawn, env)
    T.check(r.returncode == 0 and r.stdout.split()[:3] == ["vmmshim", "True", "True"],
            f"configure_subprocess: the child under the shim with the stand-in, the parent's LD_PRELOAD restored: "
            f"{r.stdout!r} {r.stderr[-300:]!r}")
    r = child(FAKE_TORCH + "import torch_memory_saver as t\nwith t.torch_memory_saver.region():\n    pass\n", env)
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    T.check(r.returncode != 0 and "vmmshim: error: torch_memory_saver: this process does not run under the shim" in last,
            f"outside the shim the first region says how to start under it: {last!r}")


SGLANG_STANDIN = r"""
import ctypes, subprocess, sys
import torch_memory_saver as tms
assert tms.BACKEND == "vmmshim", tms.__file__
probe = "import ctypes, torch_memory_saver as t; print(t.BACKEND, hasattr(ctypes.CDLL(None), 'vmm_pause_ex'))"
with tms.configure_subprocess():  # as SGLang starts its scheduler processes
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split()
print("sglang-standin", hasattr(ctypes.CDLL(None), "vmm_pause_ex"), *child, *sys.argv[1:])
"""


def test_readme_switch():
    """The README's one-step switch, run as it is written, with a stand-in sglang.launch_server
    that checks the module it gets and starts a scheduler child the way SGLang does."""
    import re
    import tempfile
    readme = (harness.ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- use-tms -->\n```sh\n(.*?)```\n", readme, re.S)
    if not T.check(len(blocks) == 1, f"README.md has {len(blocks)} sh blocks after <!-- use-tms -->, not 1"):
        return
    line = blocks[0].strip()
    T.check(line.startswith("vmmshim run --torch-memory-saver -- python -m sglang.launch_server "),
            f"the switch is one `vmmshim run --torch-memory-saver` in front of SGLang's own command: {line!r}")
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "pkg", "sglang"))
        open(os.path.join(tmp, "pkg", "sglang", "__init__.py"), "w").close()
        with open(os.path.join(tmp, "pkg", "sglang", "launch_server.py"), "w") as f:
            f.write(SGLANG_STANDIN)
        os.makedirs(os.path.join(tmp, "bin"))
        with open(os.path.join(tmp, "bin", "vmmshim"), "w") as f:
            f.write(f"#!/bin/sh\nexec {sys.executable} -m vmmshim \"$@\"\n")
        os.chmod(os.path.join(tmp, "bin", "vmmshim"), 0o755)
        os.symlink(sys.executable, os.path.join(tmp, "bin", "python"))
        env = dict(os.environ, PATH=os.path.join(tmp, "bin") + os.pathsep + os.environ["PATH"],
                   PYTHONPATH=os.pathsep.join([str(PACKAGE), os.path.join(tmp, "pkg")]),
                   VMMSHIM_SHIM_LIB=str(BUILD / "libvmmshim.so"))
        r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=120)
    words = r.stdout.split()
    T.check(r.returncode == 0 and words[:4] == ["sglang-standin", "True", "vmmshim", "True"] and
            "--enable-memory-saver" in words,
            f"the README's line: SGLang's process and its scheduler child under the shim with the stand-in: "
            f"{r.stdout!r} {r.stderr[-500:]!r}")


def test_api():
    out = last_json(child(API_CHILD, harness.preload_env()), "the API child")
    if out is None:
        return
    T.check(out["module"].startswith(str(PACKAGE / "vmmshim" / "_tms")), f"the stand-in is imported: {out['module']}")
    T.check(out["tag_in_region"] == "weights+cpu" and out["tag_after"] is None,
            f"a CPU-backed region tags its thread <tag>+cpu, and untags after: {out['tag_in_region']} {out['tag_after']}")
    T.check(out["tags"] == ["weights+cpu", "kv_cache", ""], f"the registry's tags: {out['tags']}")
    T.check(len(out["pools"]) == 2 and out["pools"][0] != out["pools"][1],
            f"each region allocates from a PyTorch pool of its own: {out['pools']}")
    T.check(out["after_kv"] == [False, True, False], f"pause('kv_cache') takes only that tag: {out['after_kv']}")
    T.check(out["after_all"] == [True, True, False], f"pause() takes every region, nothing outside: {out['after_all']}")
    T.check(out["held_before"] - out["held_after"] >= 8 << 20,
            f"once every tag sleeps what the shim held of a free goes back to the device: "
            f"{out['held_before']} -> {out['held_after']} bytes")
    T.check(out["empty_cache"] == 1, f"once every tag sleeps PyTorch's cache is emptied, once, where some lies "
            f"outside paused memory: {out['empty_cache']}")
    T.check(out["empty_cache_paused_only"] == 0,
            f"a cache wholly in paused memory is kept, to come back at the resume: {out['empty_cache_paused_only']}")
    T.check(out.get("twice_ok") is True, "pausing what is paused is no error")
    T.check(out["backup_paused"] and out["backup_discarded"],
            f"get_cpu_backup while paused: the contents, None for a discarded tag: {out['backup_paused']} "
            f"{out['backup_discarded']}")
    T.check(out["after_resume_w"] == [False, True] and out["w_exact"],
            f"resume('weights') after pause(): that tag back bit-exact, the other still paused: {out['after_resume_w']}")
    T.check(out["backup_after_resume"], "without retain_cpu_backup the backup is gone after resume")
    T.check(out["kv_awake"] and out["kv_dropped"] and out["plain_exact"],
            f"resume() twice: all awake, the discarded bytes not kept, memory outside regions untouched: "
            f"{out['kv_awake']} {out['kv_dropped']} {out['plain_exact']}")
    T.check(out["retained"] and out["retained_refreshed"] and out["released"],
            f"retain_cpu_backup: the same host buffer after resume, refreshed by the next pause, let go by a "
            f"resume without it: {out['retained']} {out['retained_refreshed']} {out['released']}")
    T.check(out["repaused"] is True and out["reawake"] is False,
            f"a tag resumed by vmmshim.resume behind the stand-in's back is paused again by the next pause: "
            f"{out['repaused']} {out['reawake']}")
    T.check(out["nested"] == [["inner", False, "inner"], ["outer", True, "outer+cpu"], ["default", False]],
            f"nested regions restore the outer config: {out['nested']}")
    T.check(out["c_pause"] == [False, True] and out["c_resume"] is False,
            f"the shim's C tms_pause/tms_resume go through the stand-in: {out['c_pause']} {out['c_resume']}")
    T.check(out["instances_share"] is True and out["instances_resume"] is False,
            f"two instances pause and resume each other's tags: {out['instances_share']} {out['instances_resume']}")
    T.check(out["margin_refused"] == 2 and out["margin_off"] == 0,
            f"memory_margin_bytes: new memory leaving less free is refused as out-of-memory (cudaErrorMemoryAllocation), "
            f"0 allows it again: {out['margin_refused']} {out['margin_off']}")
    T.check(len(out["long_tag"].encode()) <= 31 and out["long_tag"].endswith("+cpu"),
            f"a 40-byte tag is shortened to the shim's 31 bytes: {out['long_tag']!r}")


def test_init_enable():
    env = harness.preload_env({"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    out = last_json(child(INIT_CHILD, env), "the TMS_INIT_ENABLE child")
    if out is None:
        return
    T.check(out["init"] == [True, True, "default"], f"TMS_INIT_ENABLE: interesting from the start: {out['init']}")
    T.check(out["paused"] == [True, True], f"pause(): untagged memory ('default') and the region's: {out['paused']}")
    T.check(out["disabled_tag"] == "tms-off" and out["disabled_awake"] and out["tag_after_disable"] is None,
            f"disable(): allocations under tms-off, usable while the rest sleeps: {out['disabled_tag']} "
            f"{out['disabled_awake']} {out['tag_after_disable']}")
    T.check(out["disabled_never_paused"], "what disable() made is not paused by pause()")
    T.check(out["disable_exit_gives_back"], "what disable() freed is the device's at its exit, not held for reuse")
    T.check(out["a_exact"], "TMS_INIT_ENABLE_CPU_BACKUP=1: the default tag comes back bit-exact")
    T.check(out["kept_cache"], "everything in regions: PyTorch's cache, all paused, is not emptied (training_engine)")


def main():
    try:
        test_switch()
        test_readme_switch()
        test_api()
        test_init_enable()
        test_c_entries()
    finally:
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
