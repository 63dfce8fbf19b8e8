"""vmmshim.pause and resume under PyTorch (tools/python/vmmshim/_sleep_torch.py), over the emulated
runtime, with a stand-in for the torch calls that module makes (no torch here).  The stand-in logs
each call; its memory is real cudaMalloc'd memory under the shim, and its memory_snapshot() names
those allocations as the caching allocator's segments, in the default pool or a private one.
Checks: cuBLAS's workspaces are dropped once the shim paused (the memory paused when they go), on
a pause under the default pool, before any route; after a pause of everything, every device's allocations go to one fresh pool, and
once resumed the route ends and the pool is let go; a tag whose memory holds no default-pool
segment is paused with no route and cuBLAS's workspaces kept, one that does is cleared and routed; a second pause while routed adds no
route, and the route lasts until the last paused tag is resumed (also a resume of one tag after a
pause of everything keeps it); empty_cache() while routed runs with the route stepped aside; a pool begun while routed: the route
stays where PyTorch takes the last begun pool (2.10 on), moves behind it where the first (a fresh pool,
both let go at the resume); under backend:cudaMallocAsync nothing is routed; a CUDA graph
captured while routed finds the route stepped aside and put back after it; a pause the shim
refuses routes nothing; torch imported but CUDA not started, or not imported at all: no call.
Ends with "N passed, N failed"."""
import json
import subprocess
import sys

import harness
from harness import PACKAGE

harness.setup()
T = harness.Tally()

CHILD = r"""
import ctypes, json, os, sys, types
sys.path.insert(0, sys.argv[1])
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
def alloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value
log = []
cfg = {"backend": "native", "initialized": True, "segments": []}

def paused_now():
    import vmmshim
    with vmmshim.Registry() as reg:
        return reg.process(os.getpid()).bytes_paused

torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace()
torch._C = types.SimpleNamespace()
torch.cuda.is_initialized = lambda: cfg["initialized"]
torch.cuda.get_allocator_backend = lambda: cfg["backend"]
torch.cuda.device_count = lambda: 2
pools = iter(range(1, 100))
torch.cuda.graph_pool_handle = lambda: (0, next(pools))
torch.cuda.memory_snapshot = lambda: list(cfg["segments"])
torch._C._cuda_clearCublasWorkspaces = lambda: log.append(["clear", paused_now()])
torch._C._cuda_beginAllocateToPool = lambda d, p: log.append(["begin", d, list(p)])
torch._C._cuda_endAllocateToPool = lambda d, p: log.append(["end", d, list(p)])
torch._C._cuda_releasePool = lambda d, p: log.append(["release", d, list(p)])
class CUDAGraph:
    def capture_begin(self, *a, **k): log.append(["capture_begin"])
    def capture_end(self): log.append(["capture_end"])
torch.cuda.CUDAGraph = CUDAGraph
torch.cuda.empty_cache = lambda: log.append(["empty_cache"])

import vmmshim
out = {}
def step(name, fn):
    del log[:]
    try:
        fn()
        out[name] = {"log": list(log)}
    except vmmshim.Error as e:
        out[name] = {"log": list(log), "error": type(e).__name__}

plain = alloc(3 << 20)
with vmmshim.region("kv"):
    kv = alloc(4 << 20)
with vmmshim.region("optim"):
    optim = alloc(2 << 20)
# pinned ahead: every allocation of 1 MiB or more, once; then in the background, nothing left to do
out["prepared"] = vmmshim.prepare_pause(background=False)
t = vmmshim.prepare_pause()
t.join()
out["prepared_again_thread"] = type(t).__name__
# not imported: the package never imports torch itself
step("no_torch", lambda: (vmmshim.pause(), vmmshim.resume()))
out["torch_imported_by_us"] = "torch" in sys.modules
sys.modules["torch"] = torch
step("pause_all", vmmshim.pause)
step("empty_while_routed", lambda: torch.cuda.empty_cache())
step("pause_again", vmmshim.pause)          # refused: already paused; no second route
step("resume_kv_only", lambda: vmmshim.resume("kv"))  # the rest stays paused: the route stays
step("resume_all", vmmshim.resume)
# a tag whose memory holds only a private pool's segment: no route
cfg["segments"] = [{"address": plain, "total_size": 3 << 20, "segment_pool_id": (0, 0)},
                   {"address": kv, "total_size": 4 << 20, "segment_pool_id": (0, 7)}]
step("pause_kv_private", lambda: vmmshim.pause("kv"))
step("resume_kv_private", lambda: vmmshim.resume("kv"))
# the same tag's memory under a default-pool segment: routed
cfg["segments"] = [{"address": plain, "total_size": 3 << 20, "segment_pool_id": (0, 0)},
                   {"address": kv + (2 << 20), "total_size": 1 << 20, "segment_pool_id": (0, 0)}]
step("pause_kv_default", lambda: vmmshim.pause("kv"))
step("pause_optim_too", lambda: vmmshim.pause("optim"))
step("capture", lambda: (torch.cuda.CUDAGraph().capture_begin(), torch.cuda.CUDAGraph().capture_end()))
step("resume_kv", lambda: vmmshim.resume("kv"))
step("resume_optim", lambda: vmmshim.resume("optim"))
step("capture_unrouted", lambda: (torch.cuda.CUDAGraph().capture_begin(), torch.cuda.CUDAGraph().capture_end()))
# a pool the program begins while routed: PyTorch 2.10 and later take the last begun (no move),
# earlier ones the first (the route moves behind it, to a fresh pool)
torch.__version__ = "2.11.0+cu130"
step("pause_all_again", vmmshim.pause)
from vmmshim import _sleep_torch
step("behind_lifo", _sleep_torch.route_behind)
torch.__version__ = "2.9.1"
step("behind_fifo", _sleep_torch.route_behind)
step("resume_after_behind", vmmshim.resume)
cfg["backend"] = "cudaMallocAsync"
step("pause_async", vmmshim.pause)
step("resume_async", vmmshim.resume)
cfg["backend"], cfg["initialized"] = "native", False
step("pause_uninitialized", vmmshim.pause)
step("resume_uninitialized", vmmshim.resume)
print(json.dumps(out))
"""


def main():
    try:
        run = subprocess.run([sys.executable, "-c", CHILD, str(PACKAGE)], capture_output=True, text=True,
                             env=harness.preload_env(), timeout=120)
        T.check(run.returncode == 0, f"the child under the shim: rc {run.returncode}\n{run.stdout}{run.stderr[-1500:]}")
        if run.returncode != 0:
            T.done()
        out = json.loads(run.stdout.strip().splitlines()[-1])
        logs = {k: v["log"] for k, v in out.items() if isinstance(v, dict)}
        T.check(out["prepared"] == 9 << 20 and out["prepared_again_thread"] == "Thread",
                f"prepare_pause: {out['prepared']} bytes made ready (want the 3 + 4 + 2 MiB allocations), "
                f"background: {out['prepared_again_thread']}")
        T.check(not out["torch_imported_by_us"] and logs["no_torch"] == [] and "error" not in out["no_torch"],
                f"without torch imported: no call, and the package imports none: {out['no_torch']}")
        pa = logs["pause_all"]
        T.check(len(pa) > 0 and pa[0][0] == "clear" and pa[0][1] > 0,
                f"cuBLAS's workspaces go first, once the memory is paused: {pa}")
        begins = [e for e in pa if e[0] == "begin"]
        T.check([e[1] for e in begins] == [0, 1] and begins[0][2] == begins[1][2],
                f"a pause of everything routes both devices to one fresh pool: {pa}")
        pool = begins[0][2] if begins else None
        T.check(logs["empty_while_routed"] == [["end", 0, pool], ["end", 1, pool], ["empty_cache"], ["begin", 0, pool],
                                               ["begin", 1, pool]],
                f"empty_cache() while routed runs with the route stepped aside (PyTorch asserts none is on): "
                f"{logs['empty_while_routed']}")
        T.check(out["pause_again"].get("error") == "WrongState" and logs["pause_again"] == [],
                f"a refused pause touches nothing of torch's: {out['pause_again']}")
        T.check(logs["resume_kv_only"] == [], f"resuming one tag after a pause of everything keeps the route: "
                f"{logs['resume_kv_only']}")
        T.check(logs["resume_all"] == [["end", 0, pool], ["release", 0, pool], ["end", 1, pool], ["release", 1, pool]],
                f"once everything is resumed the route ends and its pool is let go: {logs['resume_all']}")
        T.check(logs["pause_kv_private"] == [] and logs["resume_kv_private"] == [],
                f"a tag under a private pool only: cuBLAS's workspaces kept (a graph captured earlier uses its own), "
                f"not routed: {logs['pause_kv_private']} {logs['resume_kv_private']}")
        routed = [e for e in logs["pause_kv_default"] if e[0] == "begin"]
        T.check(len(routed) == 2 and routed[0][2] != pool,
                f"a tag under a default-pool segment is routed, to a new pool: {logs['pause_kv_default']}")
        pool2 = routed[0][2] if routed else None
        T.check([e for e in logs["pause_optim_too"] if e[0] != "clear"] == [],
                f"a second tag's pause while routed adds no route: {logs['pause_optim_too']}")
        T.check(logs["capture"] == [["end", 0, pool2], ["end", 1, pool2], ["capture_begin"], ["capture_end"],
                                    ["begin", 0, pool2], ["begin", 1, pool2]],
                f"a graph capture finds the route stepped aside, put back after: {logs['capture']}")
        T.check(logs["resume_kv"] == [], f"one tag still paused: the route stays: {logs['resume_kv']}")
        T.check(logs["resume_optim"] == [["end", 0, pool2], ["release", 0, pool2], ["end", 1, pool2],
                                         ["release", 1, pool2]],
                f"the last tag resumed ends the route: {logs['resume_optim']}")
        T.check(logs["capture_unrouted"] == [["capture_begin"], ["capture_end"]],
                f"with no route a capture is left alone: {logs['capture_unrouted']}")
        p1 = next((e[2] for e in logs["pause_all_again"] if e[0] == "begin"), None)
        T.check(logs["behind_lifo"] == [], f"torch 2.11 takes the last begun pool: the route stays: {logs['behind_lifo']}")
        moved = logs["behind_fifo"]
        p2 = moved[0][2] if moved else None
        T.check(p1 is not None and p2 != p1 and
                moved == [["begin", 0, p2], ["begin", 1, p2], ["end", 0, p1], ["end", 1, p1]],
                f"torch 2.9 takes the first: the route moves behind, onto a fresh pool begun before the old ends: {moved}")
        T.check(logs["resume_after_behind"] == [["end", 0, p2], ["release", 0, p2], ["end", 1, p2], ["release", 1, p2],
                                                ["release", 0, p1], ["release", 1, p1]],
                f"the resume ends the route and lets both pools go: {logs['resume_after_behind']}")
        T.check([e[0] for e in logs["pause_async"]] == ["clear"] and logs["resume_async"] == [],
                f"backend:cudaMallocAsync: cleared, never routed: {logs['pause_async']} {logs['resume_async']}")
        T.check(logs["pause_uninitialized"] == [] and logs["resume_uninitialized"] == [] and
                "error" not in out["pause_uninitialized"],
                f"CUDA not started in torch: no call: {out['pause_uninitialized']}")
    finally:
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
