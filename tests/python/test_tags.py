"""vmmshim.region(tag), set_thread_tag and thread_tag in a Python program under the shim over the
emulated runtime: what a thread allocates inside a region carries the tag in its record and lies
in chunks of that tag's own; regions nest and restore; another thread is not tagged by this one's
region; vmmshim.pause(tag) gives back that tag's memory alone (its records flagged paused, a second
pause refused with WrongState, the untagged bytes untouched) and resume brings its bytes back at the
same addresses; keep=False copies nothing; a tag too long raises InvalidArgument and changes
nothing; without the shim, NotUnderShim.
Ends with "N passed, N failed"."""
import os
import subprocess
import sys

import harness
from harness import PACKAGE

harness.setup()
T = harness.Tally()

CHILD = r"""
import ctypes, json, os, sys, threading
sys.path.insert(0, sys.argv[1])
import vmmshim
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
def alloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value
out = {"before": vmmshim.thread_tag()}
a = {"plain": alloc(1 << 20)}
with vmmshim.region("kv_cache"):
    a["kv"] = alloc(1 << 20)
    out["inside"] = vmmshim.thread_tag()
    with vmmshim.region("optim"):
        a["optim"] = alloc(3 << 20)
        other = {}
        t = threading.Thread(target=lambda: other.update(tag=vmmshim.thread_tag(), p=alloc(1 << 20)))
        t.start(); t.join()
        a["other_thread"] = other["p"]
        out["other_thread_tag"] = other["tag"]
    out["after_inner"] = vmmshim.thread_tag()
    a["kv2"] = alloc(1 << 20)
out["after"] = vmmshim.thread_tag()
try:
    vmmshim.set_thread_tag("x" * 40)
    out["too_long"] = "accepted"
except vmmshim.InvalidArgument as e:
    out["too_long"] = str(e)
out["after_too_long"] = vmmshim.thread_tag()
reg = vmmshim.Registry()
recs = {k: reg.find(os.getpid(), v) for k, v in a.items()}
out["tags"] = {k: r.tag for k, r in recs.items()}
out["chunks"] = {k: r.chunk_id for k, r in recs.items()}
# pausing one tag: its memory goes, the rest stays; resumed at the same addresses with its bytes
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def put(p, data):
    assert rt.cudaMemcpy(p, data, len(data), 1) == 0
def get(p, n):
    b = ctypes.create_string_buffer(n)
    assert rt.cudaMemcpy(b, p, n, 2) == 0
    return b.raw
kv_bytes, plain_bytes = os.urandom(1 << 20), os.urandom(1 << 20)
put(a["kv"], kv_bytes); put(a["plain"], plain_bytes)
r = vmmshim.pause("kv_cache")
out["pause"] = [r.bytes_released, r.bytes_kept, r.allocations]
recs = {k: reg.find(os.getpid(), v) for k, v in a.items()}
out["paused"] = sorted(k for k, rec in recs.items() if rec.paused)
try:
    vmmshim.pause("kv_cache")
    out["again"] = "accepted"
except vmmshim.WrongState as e:
    out["again"] = str(e)
out["plain_while_paused"] = get(a["plain"], 1 << 20) == plain_bytes
r = vmmshim.resume("kv_cache")
out["resume"] = [r.bytes_released, r.bytes_kept]
out["kv_back"] = get(a["kv"], 1 << 20) == kv_bytes
out["paused_after"] = sorted(k for k, v in a.items() if reg.find(os.getpid(), v).paused)
r = vmmshim.pause("optim", keep=False)
out["discard"] = [r.bytes_released > 0, r.bytes_kept]
vmmshim.resume("optim")
print(json.dumps(out))
"""


def main():
    try:
        run = subprocess.run([sys.executable, "-c", CHILD, str(PACKAGE)], capture_output=True, text=True,
                             env=harness.preload_env(), timeout=120)
        T.check(run.returncode == 0, f"the child under the shim: rc {run.returncode}\n{run.stdout}{run.stderr[-1500:]}")
        if run.returncode == 0:
            import json
            out = json.loads(run.stdout.strip().splitlines()[-1])
            T.check(out["before"] is None and out["inside"] == "kv_cache" and out["after_inner"] == "kv_cache" and
                    out["after"] is None, f"tags as the thread saw them: {out}")
            T.check(out["other_thread_tag"] is None, f"another thread is not tagged by this one's region: {out}")
            tags, chunks = out["tags"], out["chunks"]
            T.check(tags == {"plain": "", "kv": "kv_cache", "optim": "optim", "other_thread": "", "kv2": "kv_cache"},
                    f"the records' tags: {tags}")
            T.check(chunks["kv"] == chunks["kv2"] and len({chunks["plain"], chunks["kv"], chunks["optim"]}) == 3 and
                    chunks["other_thread"] not in (chunks["kv"], chunks["optim"]),
                    f"a tag's allocations share chunks only with that tag's: {chunks}")
            T.check(out["pause"][0] >= 2 << 20 and out["pause"][1] >= (1 << 20) + 4096 and out["pause"][2] == 2 and
                    out["paused"] == ["kv", "kv2"], f"pause('kv_cache'): report {out['pause']}, paused records {out['paused']}")
            T.check(out["again"].startswith("vmmshim.pause: already paused"), f"pausing twice: {out['again']!r}")
            T.check(out["plain_while_paused"], "an untagged allocation kept its bytes while the tag slept")
            T.check(out["resume"][0] == out["pause"][0] and out["kv_back"] and out["paused_after"] == [],
                    f"resume('kv_cache'): report {out['resume']}, bytes back {out['kv_back']}, still paused {out['paused_after']}")
            T.check(out["discard"] == [True, 0], f"pause('optim', keep=False): {out['discard']}")
            T.check("at most 31 bytes" in out["too_long"] and "vmmshim.set_thread_tag" in out["too_long"] and
                    out["after_too_long"] is None, f"a tag too long: {out['too_long']!r}, then {out['after_too_long']!r}")
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        native = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import vmmshim\n"
                                 "try:\n    vmmshim.region('kv').__enter__()\nexcept vmmshim.NotUnderShim as e:\n"
                                 "    print('refused:', e)", str(PACKAGE)], capture_output=True, text=True, env=env,
                                timeout=60)
        T.check(native.returncode == 0 and native.stdout.startswith("refused: vmmshim: not running under the shim"),
                f"without the shim: {native.returncode} {native.stdout!r} {native.stderr[-500:]}")
    finally:
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
