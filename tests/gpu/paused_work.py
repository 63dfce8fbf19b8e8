"""Work while paused (issue 37), one process, one allocator setting, under the shim; started by
tests/gpu/paused.sh (or by hand: LD_PRELOAD=build/libvmmshim.so python3 tests/gpu/paused_work.py).

A model's weights (1 GiB fp32), cached free blocks of many sizes, cuBLAS and cuBLASLt workspaces
made by a matmul; then vmmshim.pause() of everything, contents kept, and while paused, each row in
order (CUDA_LAUNCH_BLOCKING=1 from paused.sh, so a fault shows at its row):
  tensor_1k     a new 1 KiB tensor, filled and summed
  tensor_300m   a new 300 MiB tensor, filled and summed
  matmul        fp32 matmul of two new 512x512 tensors, against float64 on the CPU
  linear_bf16   a bf16 linear (cuBLASLt)
  fwd_bwd       a new model's forward and backward (autograd's thread allocates)
  thread        a new tensor and a matmul on another Python thread
then resume, and the weights must be bit-exact; then a tag's pause while another model computes:
  tag_forward   model A made inside vmmshim.region("a") with a MemPool of its own is paused
                ("a"), and model B, untagged, runs forward and backward; A exact after resume
With --guard (VMMSHIM_PAUSE_GUARD=1 set by paused.sh): after the rows, a kernel writes a paused
weight on purpose (guard_touch): the process must live on, the resume must give the kept weights
bit-exact (the write went to the scratch) and say so on stderr.
Prints "R work setting=S row=R ok=0|1 [why]" per row, "R sleep setting=S first_pause_s=..
later_pause_s=.. resume_s=.. nvml_before_gib=.. nvml_paused_gib=.. not_shim_gib=..", and ends with
"N passed, N failed"."""
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import vmmshim  # noqa: E402

SETTING = os.environ.get("PAUSED_SETTING", "default")
GUARD = "--guard" in sys.argv
passed = failed = 0


def say(kind, **f):
    print("R " + kind + " " + " ".join(f"{k}={v}" for k, v in f.items()), flush=True)


def row(name, fn):
    global passed, failed
    try:
        ok, why = fn(), ""
    except Exception as e:  # a fault names its row
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    passed += bool(ok)
    failed += not ok
    say("work", setting=SETTING, row=name, ok=int(bool(ok)), why=repr(why) if why else "''")
    return ok


def nvml_used_gib(index):
    import pynvml
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used / 2**30


dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
torch.manual_seed(0)
weights = [torch.randn(4096, 4096, device=dev) for _ in range(16)]
ref = [w.cpu() for w in weights]
for i in range(64):  # free blocks of many sizes, cached by PyTorch's allocator inside soon-paused memory
    t = torch.empty((i * 7919) % 3_000_000 + 1000, device=dev)
    del t
_ = (weights[0] @ weights[1]).sum().item()
_ = torch.nn.functional.linear(weights[2][:512].bfloat16(), weights[3][:512].bfloat16()).sum().item()
torch.cuda.synchronize()


def exact():
    return all(torch.equal(w.cpu(), r) for w, r in zip(weights, ref))


def tensor_1k():
    a = torch.full((256,), 3.0, device=dev)
    return a.sum().item() == 768.0


def tensor_300m():
    b = torch.ones(300 * 2**20 // 4, device=dev)
    return b.sum().item() == float(b.numel())


def matmul():
    x, y = torch.randn(512, 512, device=dev), torch.randn(512, 512, device=dev)
    r = x.cpu().double() @ y.cpu().double()
    return float(((x @ y).cpu().double() - r).norm() / r.norm()) < 1e-3


def linear_bf16():
    x, y = torch.randn(512, 512, device=dev), torch.randn(512, 512, device=dev)
    r = x.cpu().double() @ y.cpu().double().T
    z = torch.nn.functional.linear(x.bfloat16(), y.bfloat16()).double().cpu()
    return float((z - r).norm() / r.norm()) < 2e-2


def fwd_bwd():
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(dev)
    loss = m(torch.randn(64, 256, device=dev)).square().mean()
    loss.backward()
    return all(torch.isfinite(p.grad).all().item() for p in m.parameters())


def on_thread():
    out = {}

    def body():
        try:
            out["ok"] = tensor_1k() and matmul()
        except Exception as e:
            out["err"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "err" in out:
        raise out["err"]
    return out["ok"]


u0 = nvml_used_gib(0)
t0 = time.perf_counter()
report = vmmshim.pause()
first_pause = time.perf_counter() - t0
u1 = nvml_used_gib(0)
for name, fn in (("tensor_1k", tensor_1k), ("tensor_300m", tensor_300m), ("matmul", matmul),
                 ("linear_bf16", linear_bf16), ("fwd_bwd", fwd_bwd), ("thread", on_thread)):
    row(name, fn)
torch.cuda.synchronize()
t0 = time.perf_counter()
vmmshim.resume()
resume = time.perf_counter() - t0
row("exact_after_resume", exact)
t0 = time.perf_counter()
vmmshim.pause()
later_pause = time.perf_counter() - t0
vmmshim.resume()
row("exact_after_second_cycle", exact)
say("sleep", setting=SETTING, first_pause_s=f"{first_pause:.3f}", later_pause_s=f"{later_pause:.3f}",
    resume_s=f"{resume:.3f}", nvml_before_gib=f"{u0:.2f}", nvml_paused_gib=f"{u1:.2f}",
    released_gib=f"{report.bytes_released / 2**30:.2f}", not_shim_gib=f"{report.bytes_not_shim / 2**30:.3f}")


def tag_forward():
    pool = torch.cuda.MemPool() if torch.cuda.get_allocator_backend() == "native" else None
    with vmmshim.region("a"):
        if pool is not None:
            with torch.cuda.use_mem_pool(pool):
                a = torch.nn.Linear(2048, 2048).to(dev)
        else:
            a = torch.nn.Linear(2048, 2048).to(dev)
    a_ref = a.weight.detach().cpu()
    b = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(dev)
    torch.cuda.synchronize()
    vmmshim.pause("a")
    loss = b(torch.randn(32, 512, device=dev)).square().mean()
    loss.backward()
    ok = torch.isfinite(loss).item()
    torch.cuda.synchronize()
    vmmshim.resume("a")
    return ok and torch.equal(a.weight.detach().cpu(), a_ref)


row("tag_forward", tag_forward)

if GUARD:
    def guard_touch():
        vmmshim.pause()
        weights[5].add_(1.0)  # a kernel on paused memory: the scratch takes it
        torch.cuda.synchronize()
        vmmshim.resume()
        return exact()

    t0 = time.perf_counter()
    row("guard_touch", guard_touch)
    say("guard", setting=SETTING, cycle_s=f"{time.perf_counter() - t0:.3f}")

print(f"{passed} passed, {failed} failed", flush=True)
sys.exit(1 if failed else 0)
