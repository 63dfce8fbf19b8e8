"""The README's snippets, run exactly as they appear there, over the emulated driver.
The companions: the C one (after `<!-- companion-c -->`, a 5-line body) compiled against
tools/include and the build's client library, the Python one (after `<!-- companion-python -->`,
3 lines) run with the package; both against a live owner, both printing the allocation's first 16
bytes.  The first screen's uses, each line run by bash with `vmmshim` (python -m vmmshim), `vmmctl`
(the build's) and `python` on PATH and a stand-in `train.py` in the working directory: 1 (after
`<!-- use-run-job -->` and `<!-- use-run-see -->`): the job under `vmmshim run`, then `vmmctl list`
and `ps` showing its allocation; 3 (after `<!-- use-keep -->`): the job SIGKILLs itself under
`vmmshim run --keep`, the example pid 4242 is replaced by the one the launcher names, and the list,
dump and release that follow work on the dead job's memory; 2 (after `<!-- names-owner -->` and
`<!-- names-companion -->`): the owner's line in tests/python/named_owner.py under the shim, the
companion's three lines here with stand-ins for torch (test_to_torch.py's) and the model.  Ends with "N passed, N failed"."""
import ctypes
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import harness
from harness import BUILD, PACKAGE, ROOT, Owner, pattern

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()


def snippet(readme, marker, lang):
    blocks = re.findall(r"<!-- %s -->\n```%s\n(.*?)```\n" % (marker, lang), readme, re.S)
    T.check(len(blocks) == 1, f"README.md has {len(blocks)} ```{lang} blocks after <!-- {marker} -->, not 1")
    return blocks[0] if blocks else ""


# The stand-in jobs: cudaMalloc through the emulated runtime (which the shim's hooks serve), the
# buffer filled with pattern(0, 0, n), its address said on stdout.
TRAIN = r"""
import ctypes, os, signal, sys, time
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
p, n = ctypes.c_void_p(), 3 << 20
assert rt.cudaMalloc(ctypes.byref(p), n) == 0
data = bytes(range(256)) * (n // 256)
assert rt.cudaMemcpy(p, data, n, 1) == 0
print(f"allocated {os.getpid()} {p.value:#x} {n}", flush=True)
"""
# use 1: runs until its stdin closes
TRAIN_RUN = TRAIN + "sys.stdin.read()\n"
# use 3: crashes once a keeper holds it (past the keeper's --settle, 50 ms, and its tick)
TRAIN_CRASH = TRAIN + r"""
import vmmshim
reg, deadline = vmmshim.Registry(), time.monotonic() + 30
while reg.keeper_of(os.getpid()) is None and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def shell_env(tmp):
    """PATH with vmmshim, vmmctl and python as a user of the wheel has them, all from this build."""
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "vmmshim"), "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" -m vmmshim "$@"\n')
    os.chmod(os.path.join(bin_dir, "vmmshim"), 0o755)
    os.symlink(BUILD / "vmmctl", os.path.join(bin_dir, "vmmctl"))
    os.symlink(sys.executable, os.path.join(bin_dir, "python"))
    return dict(os.environ, PATH=bin_dir + ":" + os.environ.get("PATH", ""), PYTHONPATH=str(PACKAGE),
                VMMSHIM_SHIM_LIB=str(BUILD / "libvmmshim.so"), VMMSHIM_VMMCTL=str(BUILD / "vmmctl"))


def commands(block):
    """The block's command lines (a comment is the shell's to skip)."""
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def sh(line, env, cwd, **kw):
    return subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=120, **kw)


def rows(out, pid):
    return [line.split() for line in out.splitlines() if line.split()[:1] == [str(pid)]]


def use_run(readme, tmp):
    job, see = snippet(readme, "use-run-job", "sh"), snippet(readme, "use-run-see", "sh")
    job, see = commands(job), commands(see)
    if not T.check(len(job) == 1 and len(see) == 2, f"use 1: one job line and two to see it: {job} {see}"):
        return
    work = os.path.join(tmp, "use-run")
    os.makedirs(work)
    with open(os.path.join(work, "train.py"), "w") as f:
        f.write(TRAIN_RUN)
    env = shell_env(work)
    proc = subprocess.Popen(["bash", "-c", job[0]], env=env, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        said = proc.stdout.readline().split()
        if not T.check(len(said) == 4 and said[0] == "allocated", f"use 1: the job did not allocate: {said} "
                                                                   f"{proc.poll() is not None and proc.stderr.read()[-500:]}"):
            return
        pid, address, size = int(said[1]), int(said[2], 16), int(said[3])
        lst, ps = sh(see[0], env, work), sh(see[1], env, work)
        mine = rows(lst.stdout, pid)
        T.check(lst.returncode == 0 and len(mine) == 1 and f"{address:#x}" in mine[0] and "trainer" in mine[0],
                f"use 1: `{see[0]}` shows the job's one allocation ({address:#x}, tag trainer): {lst.returncode} {lst.stdout}{lst.stderr}")
        T.check(ps.returncode == 0 and len(rows(ps.stdout, pid)) == 1 and ps.stdout.rstrip().count("train.py") == 1 and
                rows(ps.stdout, pid)[0][1] == "alive",
                f"use 1: `{see[1]}` shows the job's process: {ps.returncode} {ps.stdout}{ps.stderr}")
        try:
            a = vmmshim.Registry().find(pid, address)
            T.check(a.exportable and a.size == size and a.tag == "trainer",
                    f"use 1: the job's allocation is backed and exportable: {a.size} {a.exportable} {a.tag}")
        except vmmshim.Error as e:
            T.check(False, f"use 1: the job's allocation is not in the registry: {e}")
        proc.stdin.close()
        T.check(proc.wait(timeout=60) == 0, f"use 1: the job ends with its own status: {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def use_keep(readme, tmp):
    lines = commands(snippet(readme, "use-keep", "sh"))
    if not T.check(len(lines) == 4 and all("4242" in line for line in lines[2:]),
                   f"use 3: a job line, a list and two lines about pid 4242: {lines}"):
        return
    work = os.path.join(tmp, "use-keep")
    os.makedirs(work)
    with open(os.path.join(work, "train.py"), "w") as f:
        f.write(TRAIN_CRASH)
    env = shell_env(work)
    job = sh(lines[0], env, work)
    said = job.stdout.split()
    told = re.search(r"keepers still hold pid (\d+)", job.stderr)
    T.check(job.returncode == 128 + signal.SIGKILL, f"use 3: the launcher exits 137 for the SIGKILLed job: "
                                                   f"{job.returncode} {job.stderr[-500:]}")
    if not T.check(len(said) == 4 and told and int(told.group(1)) == int(said[1]),
                   f"use 3: the launcher names the crashed job's pid: {job.stdout} {job.stderr[-500:]}"):
        return
    pid, address, size = int(said[1]), int(said[2], 16), int(said[3])
    log = re.search(r"keeper log (\S+)", job.stderr)
    run = [line.replace("4242", str(pid)) for line in lines[1:]]
    lst = sh(run[0], env, work)
    mine = rows(lst.stdout, pid)
    T.check(lst.returncode == 0 and len(mine) == 1 and f"{address:#x}" in mine[0] and "kept" in mine[0],
            f"use 3: `{run[0]}` shows the dead job's allocation kept: {lst.returncode} {lst.stdout}{lst.stderr}")
    dump = sh(run[1], env, work)
    out = os.path.join(work, "ckpt")
    files = sorted(os.listdir(out)) if os.path.isdir(out) else []
    T.check(dump.returncode == 0 and files == [f"{address:#x}.bin", "manifest.json"],
            f"use 3: `{run[1]}` writes the allocation and a manifest: {dump.returncode} {files} {dump.stderr[-300:]}")
    if f"{address:#x}.bin" in files:
        with open(os.path.join(out, f"{address:#x}.bin"), "rb") as f:
            T.check(f.read() == bytes(range(256)) * (size // 256), "use 3: the dump holds the dead job's bytes")
    try:
        keeper = vmmshim.Registry().keeper_of(pid)
    except vmmshim.Error:
        keeper = None
    rel = sh(run[2], env, work)
    T.check(rel.returncode == 0, f"use 3: `{run[2]}`: {rel.returncode} {rel.stdout}{rel.stderr}")
    gone, deadline = False, time.monotonic() + 10
    while keeper and not gone and time.monotonic() < deadline:
        try:
            gone = open(f"/proc/{keeper}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            gone = True
        time.sleep(0.05)
    T.check(keeper and gone, f"use 3: the keeper ({keeper}) lets go and stops after the release")
    if log:
        try:
            os.unlink(log.group(1))
        except FileNotFoundError:
            pass
    subprocess.run([str(BUILD / "vmmctl"), "gc"], capture_output=True)


class PyOwner(harness.LineProcess):
    """tests/python/named_owner.py under the shim; ok(src) runs one line of Python there."""

    def __init__(self):
        super().__init__([sys.executable, str(ROOT / "tests" / "python" / "named_owner.py"), str(PACKAGE)],
                         harness.preload_env())
        line = self.readline(60)
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"the Python owner did not start: {line!r}")
        self.pid = int(line.split()[1])

    def ok(self, src):
        status, _, rest = self.command(src).partition(" ")
        T.check(status == "ok", f"owner: {src}: {status} {rest}")
        return rest


class StandInModel:
    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state, assign=False):
        self.loaded, self.assign = state, assign


def words(seed, first, count):
    """What named_owner.py's fill(p, n, seed) writes: 64-bit words seed * K + index."""
    K, MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1
    return b"".join((((seed * K) + k) & MASK).to_bytes(8, "little") for k in range(first, first + count))


def use_share(readme):
    owner, companion = snippet(readme, "names-owner", "python"), snippet(readme, "names-companion", "python")
    if not T.check(len(owner.splitlines()) == 1 and len(companion.splitlines()) == 3,
                   f"use 2: the owner's example is one line, the companion's three: {owner!r} {companion!r}"):
        return
    own = PyOwner()
    try:
        own.ok("P = alloc(1 << 20); fill(P, 1 << 20, 9)")
        own.ok("model = Model({'fc.weight': CAI(P, (128, 256), '<f4'), 'fc.bias': DL(P + 131072, (128,), (2, 32, 1))})")
        own.ok(owner.strip())
        import test_to_torch  # its stand-in for the torch calls open_torch makes
        sys.modules["torch"] = test_to_torch.make_torch()[0]
        space = {"vmmshim": vmmshim, "model": StandInModel(), "pid": own.pid}
        try:
            exec(compile(companion, "README.md (names-companion)", "exec"), space)
        except Exception as e:
            T.check(False, f"use 2: the README's companion raised {type(e).__name__}: {e}")
            return
        finally:
            sys.modules.pop("torch", None)
        loaded = space["model"].loaded
        T.check(set(loaded or ()) == {"fc.weight", "fc.bias"} and space["model"].assign, f"use 2: loaded: {loaded}")
        if loaded and "fc.weight" in loaded and "fc.bias" in loaded:
            wt = loaded["fc.weight"]
            T.check(wt.shape == (128, 256) and wt.strides == (256, 1) and wt.dtype == "float32" and
                    ctypes.string_at(wt.data_ptr(), 64) == words(9, 0, 8), "use 2: fc.weight zero-copy, the owner's bytes")
            T.check(ctypes.string_at(loaded["fc.bias"].data_ptr(), 16) == words(9, 131072 // 8, 2), "use 2: fc.bias")
            del wt
        del loaded
        space.clear()
        gc.collect()
    finally:
        own.end()


# A stand-in torch for the sleep snippet: torch.empty(n, dtype=torch.uint8, device="cuda") is a
# cudaMalloc through the emulated runtime, under the shim.
SLEEP_CHILD = r'''
import ctypes, json, os, sys, types
sys.path.insert(0, sys.argv[1])
import vmmshim
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
def empty(n, dtype=None, device=None):
    p = ctypes.c_void_p()
    assert device == "cuda" and rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value
torch = types.SimpleNamespace(empty=empty, uint8="uint8")
base = ctypes.c_void_p()
assert rt.cudaMalloc(ctypes.byref(base), 3 << 20) == 0
n_bytes = 4 << 20
reports = []
real_pause, real_resume = vmmshim.pause, vmmshim.resume
vmmshim.pause = lambda *a, **k: reports.append(("pause", a, real_pause(*a, **k).bytes_released))
vmmshim.resume = lambda *a, **k: reports.append(("resume", a, real_resume(*a, **k).bytes_released))
exec(sys.argv[2])
reg = vmmshim.Registry()
print(json.dumps({"reports": reports, "tag": reg.find(os.getpid(), kv_cache).tag,
                  "paused": [reg.find(os.getpid(), p).paused for p in (kv_cache, base.value)]}))
'''


def use_sleep(readme):
    src = snippet(readme, "use-sleep", "python")
    run = subprocess.run([sys.executable, "-c", SLEEP_CHILD, str(PACKAGE), src], capture_output=True, text=True,
                         env=harness.preload_env(), timeout=120)
    T.check(run.returncode == 0, f"use 4 under the shim: rc {run.returncode} {run.stdout[-500:]}{run.stderr[-1500:]}")
    if run.returncode != 0:
        return
    import json
    out = json.loads(run.stdout.strip().splitlines()[-1])
    kinds = [(r[0], r[1]) for r in out["reports"]]
    T.check(kinds == [("pause", ["kv_cache"]), ("pause", []), ("resume", [])], f"use 4's calls: {out['reports']}")
    released = [r[2] for r in out["reports"]]
    T.check(len(released) == 3 and released[0] >= 4 << 20 and released[1] >= 3 << 20 and
            released[2] >= released[0] + released[1], f"use 4's bytes released and mapped again: {released}")
    T.check(out["tag"] == "kv_cache" and out["paused"] == [False, False], f"use 4: tag {out['tag']!r}, paused {out['paused']}")


def main():
    readme = (ROOT / "README.md").read_text()
    c_src, py_src = snippet(readme, "companion-c", "c"), snippet(readme, "companion-python", "python")
    body = re.search(r"\bmain\([^)]*\)\s*\{[^\n]*\n(.*)\n\}\s*$", c_src, re.S)
    T.check(body and len(body.group(1).splitlines()) == 5, f"the C companion's body is not 5 lines:\n{c_src}")
    T.check(len(py_src.splitlines()) == 3, f"the Python companion is not 3 lines:\n{py_src}")
    tmp = tempfile.mkdtemp(prefix="vmmshim-readme-")
    own = None
    try:
        with open(os.path.join(tmp, "companion.c"), "w") as f:
            f.write(c_src)
        with open(os.path.join(tmp, "companion.py"), "w") as f:
            f.write(py_src)
        exe = os.path.join(tmp, "companion")
        cc = subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Werror", f"-I{ROOT / 'tools' / 'include'}",
                             os.path.join(tmp, "companion.c"), "-o", exe, f"-L{BUILD}", "-lvmmshim-client",
                             f"-Wl,-rpath,{BUILD}"], capture_output=True, text=True)
        T.check(cc.returncode == 0, f"the C companion does not build: {cc.stderr[-800:]}")
        use_run(readme, tmp)
        use_share(readme)
        use_keep(readme, tmp)
        use_sleep(readme)
        own = Owner("1", "0.25a")
        for i, (address, _, _) in enumerate(own.buffers):
            want = pattern(i, 0, 16).hex() + "\n"
            args = [str(own.pid), hex(address)]
            c_out = subprocess.run([exe, *args], capture_output=True, text=True) if cc.returncode == 0 else None
            py_out = subprocess.run([sys.executable, os.path.join(tmp, "companion.py"), *args], capture_output=True,
                                    text=True, env=dict(os.environ, PYTHONPATH=str(PACKAGE)))
            T.check(c_out is not None and c_out.returncode == 0 and c_out.stdout == want,
                    f"the C companion on buffer {i}: {c_out and (c_out.returncode, c_out.stdout, c_out.stderr)}, "
                    f"want {want!r}")
            T.check(py_out.returncode == 0 and py_out.stdout == want,
                    f"the Python companion on buffer {i}: {py_out.returncode} {py_out.stdout!r} {py_out.stderr[-300:]}")
        # a bad address: the C one prints vmm_last_error()'s line, the Python one raises NotFound
        bad = [str(own.pid), "0x10"]
        if cc.returncode == 0:
            c_bad = subprocess.run([exe, *bad], capture_output=True, text=True)
            T.check(c_bad.returncode == 1 and c_bad.stdout == "" and "no live allocation" in c_bad.stderr and
                    c_bad.stderr.count("\n") == 1, f"the C companion on a bad address: {c_bad.stderr!r}")
        py_bad = subprocess.run([sys.executable, os.path.join(tmp, "companion.py"), *bad], capture_output=True,
                                text=True, env=dict(os.environ, PYTHONPATH=str(PACKAGE)))
        T.check(py_bad.returncode == 1 and "vmmshim.NotFound: " in py_bad.stderr and
                "no live allocation" in py_bad.stderr, f"the Python companion on a bad address: {py_bad.stderr[-300:]}")
    finally:
        if own:
            own.end()
        shutil.rmtree(tmp, ignore_errors=True)
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
