"""The sleep table of issue 29, PyTorch side: one process, one allocator setting, started by
tests/gpu/sleep.sh (or by hand):

  LD_PRELOAD=build/libvmmshim.so python3 tests/gpu/sleep_bench.py          under the shim
  LD_PRELOAD=.../torch_memory_saver_hook_mode_preload_cu13.abi3.so \
      PYTHONPATH=.tms/site python3 tests/gpu/sleep_bench.py --tms          torch_memory_saver (TMS)

PYTORCH_CUDA_ALLOC_CONF as the row wants (TMS refuses expandable_segments).

  trainer   a Llama-shaped decoder, TinyLlama's shape by default (SLEEP_LAYERS 22 of width
            SLEEP_WIDTH 2048, SLEEP_HEADS 32 query and SLEEP_KV_HEADS 4 key/value heads, SwiGLU
            SLEEP_FFN 5632, vocabulary SLEEP_VOCAB 32,000: 1.1 B parameters) in bf16 with fused AdamW,
            trained on SLEEP_BATCH x SLEEP_SEQ (4 x 512) random tokens.  Its weights are made outside
            any region; its gradients and AdamW's state are made up front under the tag "optim":
            shim: inside vmmshim.region("optim") and a torch.cuda.MemPool of their own (the way
            tools/python/vmmshim/_sleep.py says), or the region alone under backend:cudaMallocAsync,
            which allocates each tensor with its own cudaMallocAsync and has no MemPool;
            TMS: inside torch_memory_saver.region(tag="optim", enable_cpu_backup=True), which brings
            its own MemPool.  Backward then accumulates into those gradients (zero_grad keeps them).
            First the same model is trained SLEEP_STEPS x (SLEEP_ROUNDS + 1) steps without sleeping
            (the reference); then again from the same seed: SLEEP_STEPS steps, and each round
            pause("optim") with its contents kept, a neighbour process allocates the bytes released,
            resume, SLEEP_STEPS more steps.  Its losses must equal the reference's bit for bit:
            deterministic algorithms, and the math attention kernel (flash attention's backward is
            not deterministic unless told, and under warn_only it is not told).
  neighbour before the rounds a process without the shim (sleep_common.py neighbour) takes all the
            device has free but SLEEP_HEADROOM_MB (2048), so that its cuMemAlloc of the region's
            bytes less 256 MiB fails before the pause (checked: else the check proves nothing) and
            succeeds after it only if the pause really gave them to the device.
  kv        then SLEEP_KV_FRACTION (0.5) of what the device has free (NVML), one tensor under the tag
            "kv" (its own MemPool, as above), paused with its contents discarded and resumed, each
            round.

Prints "R ..." lines (sleep_common.say): R setup, R pinned (cuMemcpy between device memory and
cuMemAllocHost memory, the best of 3 of SLEEP_PINNED_MB), R model, R neighbour, one R sleep per round (pause
and resume seconds, wall clock around the call after a synchronize, and GB/s over the bytes copied:
the shim's bytes_kept, or for TMS the bytes of the segments its region made; NVML used before, after
the pause and after the resume, the process's own share: less what was used before it started and
less what the neighbour holds), R losses, one R kv per round, R done.  Ends with "N passed, N
failed" over its own checks (TMS's are printed as NOTE and not counted: the baseline is reported,
not judged).  Exit 0, 1 when a check failed, 3 when it cannot run here (SKIP)."""
import contextlib
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))
sys.path.insert(0, HERE)
# cuBLAS reads it when it makes a handle: without it deterministic mode refuses cuBLAS
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from sleep_common import (HEADROOM, KV_FRACTION, LAYERS, PINNED, ROUNDS, SLACK, STEPS, WIDTH,  # noqa: E402
                          Checks, DeviceView, MiB, Neighbour,
                          pinned_bandwidth, say)

MODE = "tms" if "--tms" in sys.argv else "shim"
T0 = time.perf_counter()
view = DeviceView()  # before CUDA starts: what others use

checks = Checks(report_only=MODE == "tms")

try:
    import torch  # noqa: E402
except Exception as e:
    print(f"SKIP torch not importable: {e}", flush=True)
    sys.exit(3)
if not torch.cuda.is_available():
    print("SKIP torch.cuda.is_available() is False", flush=True)
    sys.exit(3)

from llama_train import Llama, steps  # noqa: E402

if MODE == "tms":
    try:
        from torch_memory_saver import torch_memory_saver as saver  # noqa: E402
    except Exception as e:
        print(f"SKIP torch_memory_saver not importable: {e}", flush=True)
        sys.exit(3)
else:
    import vmmshim  # noqa: E402

dev = torch.device("cuda")


class ShimSleeper:
    """vmmshim's regions, pause and resume; a MemPool per region where the allocator has them."""

    def __init__(self):
        self.backend = torch.cuda.get_allocator_backend()
        self.pools = self.backend != "cudaMallocAsync"  # that backend cannot allocate to a MemPool

    @contextlib.contextmanager
    def region(self, tag, keep, hold):
        """Allocations inside carry tag; hold (a list) keeps the MemPool alive as long as the caller."""
        pool = None
        if self.pools:
            try:
                pool = torch.cuda.MemPool()
            except Exception as e:  # then the region alone, and say so
                self.pools = False
                say("note", mempool="unavailable", reason=str(e).replace(" ", "_")[:100])
        hold.append(pool)
        with vmmshim.region(tag), (torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext()):
            yield

    def pool_bytes(self, hold):
        """The bytes of the segments of the region's pool: what it holds on the device."""
        return pool_bytes(hold[0].id) if hold and hold[0] is not None else None

    def pause(self, tag, keep):
        t = time.perf_counter()
        rep = vmmshim.pause(tag, keep=keep)
        return time.perf_counter() - t, rep

    def resume(self, tag):
        t = time.perf_counter()
        rep = vmmshim.resume(tag)
        return time.perf_counter() - t, rep


class TmsSleeper:
    """torch_memory_saver in preload mode: its region brings its own MemPool (one per tag, kept by
    TMS), and a pause copies every segment of it."""
    backend = "native"

    def region(self, tag, keep, hold):
        return saver.region(tag=tag, enable_cpu_backup=keep)

    def pool_bytes(self, hold):
        return pool_bytes(None)

    def pause(self, tag, keep):
        t = time.perf_counter()
        saver.pause(tag)
        return time.perf_counter() - t, None

    def resume(self, tag):
        t = time.perf_counter()
        saver.resume(tag)
        return time.perf_counter() - t, None


def pool_bytes(pool_id):
    """The bytes of the caching allocator's segments in the MemPool pool_id (None: in every pool but
    the default one), None where it keeps no such list (backend:cudaMallocAsync)."""
    try:
        segs = torch.cuda.memory._snapshot()["segments"]
    except Exception:
        return None

    def pid(s):
        return tuple(s.get("segment_pool_id") or (0, 0))

    want = tuple(pool_id) if pool_id is not None else None
    return sum(s["total_size"] for s in segs if (pid(s) == want if want else pid(s) != (0, 0)))


def trainer(sleeper, seed):
    """The model (initialized on the device from the seed, then bf16), fused AdamW, and its
    gradients and state made under "optim"; returns (model, opt, hold, bytes): hold keeps the
    region's pool, bytes is what the region holds on the device, the segments of its pool (what
    a pause has to copy; TMS copies whole segments), else (backend:cudaMallocAsync) the tensors'."""
    torch.manual_seed(seed)
    with torch.device(dev):
        model = Llama()
    model.to(torch.bfloat16)
    torch.cuda.empty_cache()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.synchronize()
    hold, made = [], 0
    with sleeper.region("optim", True, hold):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            made += p.grad.nbytes
        for group in opt.param_groups:  # the state AdamW makes at its first step (fused: step on the device)
            for p in group["params"]:
                st = opt.state[p]
                st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += 4 + 2 * p.nbytes
    torch.cuda.synchronize()
    return model, opt, hold, sleeper.pool_bytes(hold) or made


def main():
    sleeper = TmsSleeper() if MODE == "tms" else ShimSleeper()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # `import torch.utils.deterministic` here would make torch a local name of main()
        from torch.utils import deterministic  # noqa: PLC0415
        deterministic.fill_uninitialized_memory = False  # a 40 GB torch.empty stays a malloc
    except (ImportError, AttributeError):
        pass
    say("setup", mode=MODE, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default") or "default",
        backend=sleeper.backend, layers=LAYERS, width=WIDTH, rounds=ROUNDS, steps=STEPS,
        device=torch.cuda.get_device_name(0).replace(" ", "_"))
    d2h, h2d = pinned_bandwidth(PINNED)
    say("pinned", d2h=d2h, h2d=h2d, bytes=PINNED)

    t = time.perf_counter()
    model, opt, hold, _ = trainer(sleeper, 1)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device=dev).manual_seed(7)
    reference = steps(model, opt, STEPS * (ROUNDS + 1), gen)
    del model, opt, hold
    gc.collect()  # nothing of the run may stay cached in its pool
    torch.cuda.empty_cache()
    ref_s = time.perf_counter() - t

    model, opt, hold, made = trainer(sleeper, 1)
    gen = torch.Generator(device=dev).manual_seed(7)
    losses = steps(model, opt, STEPS, gen)
    torch.cuda.synchronize()
    say("model", params=params, optim_bytes=made, reference_s=ref_s)

    nb = Neighbour(view)
    filled = nb.fill(HEADROOM)
    ask = max(made - SLACK, 0)
    say("neighbour", filled=filled, footprint=view.others, headroom=HEADROOM, asks=ask)
    for r in range(ROUNDS):
        torch.cuda.synchronize()
        before = view.own()
        got_before = nb.tries(ask)
        pause_s, rep = sleeper.pause("optim", keep=True)
        paused = view.own()
        got = nb.tries(ask)
        resume_s, back = sleeper.resume("optim")
        resumed = view.own()
        kept = rep.bytes_kept if rep else made
        released = rep.bytes_released if rep else made
        say("sleep", round=r, pause_s=pause_s, bytes=kept, pause_GBps=kept / pause_s / 1e9, released=released,
            resume_s=resume_s, resume_GBps=(back.bytes_kept if back else made) / resume_s / 1e9,
            nvml_before=before, nvml_paused=paused, nvml_resumed=resumed, neighbour_before=int(got_before),
            neighbour=int(got), not_shim=rep.bytes_not_shim if rep else 0,
            shim_pause_s=rep.seconds if rep else -1.0, shim_resume_s=back.seconds if back else -1.0)
        if before is not None:
            checks.check(released > 0 and before - paused >= released * 0.9,
                         f"round {r}: NVML fell by {before - paused} for {released} released")
        checks.check(got and not got_before,
                     f"round {r}: the neighbour's allocation of {ask} bytes: before the pause "
                     f"{'succeeded (the device had room: the check proves nothing)' if got_before else 'failed'}, "
                     f"after it {'succeeded' if got else 'failed'}")
        losses += steps(model, opt, STEPS, gen)
    nb.close()
    same = losses == reference[:len(losses)]
    first = next((i for i, (a, b) in enumerate(zip(losses, reference)) if a != b), -1)
    say("losses", equal=int(same), first_differing_step=first, steps=len(losses),
        last=f"{losses[-1]:.6f}", reference_last=f"{reference[len(losses) - 1]:.6f}")
    checks.check(same, f"losses after sleeping equal a run that never slept (first differing step {first})")
    del model, opt, hold
    gc.collect()  # nothing of the run may stay cached in its pool
    torch.cuda.empty_cache()

    free = view.free()
    if free is None:  # no NVML: the process's own view (under the shim it counts the pool's free bytes)
        free = torch.cuda.mem_get_info()[0]
    n = int(free * KV_FRACTION) // (2 * MiB) * (2 * MiB)
    kv_hold = []
    with sleeper.region("kv", False, kv_hold):
        kv = torch.empty(n, dtype=torch.uint8, device=dev)
    for r in range(ROUNDS):
        torch.cuda.synchronize()
        pause_s, rep = sleeper.pause("kv", keep=False)
        resume_s, back = sleeper.resume("kv")
        say("kv", round=r, bytes=n, pause_s=pause_s, resume_s=resume_s,
            released=rep.bytes_released if rep else n, kept=rep.bytes_kept if rep else 0)
        if rep:
            checks.check(rep.bytes_kept == 0 and rep.bytes_released >= n, f"kv round {r}: {rep}")
    del kv, kv_hold
    say("done", seconds=time.perf_counter() - T0)
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
