"""Sleep in a distributed job (issue 37), two GPUs, one process a GPU over NCCL, started by
tests/gpu/paused.sh (mp.spawn from here; the parent prints the ranks' lines in rank order).

  fsdp_sleep.py fsdp [--sleep]      PyTorch FSDP2 (fully_shard per block), FSDP_BLOCKS (8) MLP blocks
        of width FSDP_WIDTH (2048), AdamW, batch 16x512 tokens of width 2048, FSDP_STEPS (6) steps,
        twice (with FSDP_PREPARE=1 and --sleep, vmmshim.prepare_pause() runs in the background
        during the second FSDP_STEPS), then per cycle (2): with --sleep every rank pauses everything (kept), the ranks meet with
        dist.barrier() and all_reduce a new tensor over NCCL while paused, then resume; without it
        the same collectives, no pause.  FSDP_STEPS more steps after each cycle.  Prints each
        rank's losses (bit-exact against the run without --sleep is the check, made by paused.sh),
        NVML before, paused and after, the pause and resume times.
  fsdp_sleep.py hybrid [--sleep]    the hybrid worker: in each process an FSDP2 trainer (a small MLP
        language model, HYBRID_WIDTH 2048, 6 blocks) whose weights, gradients, AdamW state and
        allocations live under vmmshim.region("trainer") with a MemPool of their own, and a rollout
        model of the same shape, untagged, given the trainer's full weights each iteration
        (DTensor.full_tensor, copied in).  Each of HYBRID_ITERS (8) iterations: a train step; the
        weights to the rollout; with --sleep pause("trainer") (kept); the rollout generates
        HYBRID_TOKENS (32) tokens greedily for 8 prompts and the ranks all_reduce a checksum of them
        over NCCL; resume("trainer").  Prints tokens and losses per iteration (bit-exact against
        the run without --sleep), iteration, pause and resume times, and peak NVML per GPU.
With tests/gpu/alloc_trace.c preloaded and ALLOC_TRACE=PATH, each rank writes PATH.rankR.
Lines: "rank R loss STEP VALUE", "rank R tokens ITER HEX", "R ..." measurements; "# ..." volatile."""
import os
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "python"))


def knob(name, default):
    return int(os.environ.get(name, default))


class Peak:
    """Peak NVML used bytes of one GPU, sampled every 5 ms on a thread."""

    def __init__(self, index):
        import pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.nvml = pynvml
        self.peak = 0
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def now(self):
        return self.nvml.nvmlDeviceGetMemoryInfo(self.h).used

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, self.now())
            time.sleep(0.005)

    def close(self):
        self.stop = True
        self.t.join()
        return self.peak


def setup(rank, init):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if os.environ.get("ALLOC_TRACE"):  # tests/gpu/alloc_trace.c preloaded: one trace a rank, written at exit
        os.environ["ALLOC_TRACE"] += f".rank{rank}"
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch, dist


def mlp_blocks(torch, width, n):
    return [torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)) for _ in range(n)]


def fsdp_main(rank, init, out, sleep):
    torch, dist = setup(rank, init)
    from torch.distributed.fsdp import fully_shard
    dev = torch.device("cuda", rank)
    width, nblocks, steps = knob("FSDP_WIDTH", 2048), knob("FSDP_BLOCKS", 8), knob("FSDP_STEPS", 6)
    peak = Peak(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*mlp_blocks(torch, width, nblocks)).to(dev)
    for blk in model:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    lines = []

    def train(k, base):
        for s in range(k):
            x = torch.randn(16, 512, width, device=dev, generator=g)
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            lines.append(f"rank {rank} loss {base + s} {loss.item():.9g}")

    import vmmshim
    train(steps, 0)
    if sleep and os.environ.get("FSDP_PREPARE") == "1":  # pinned ahead, in the background, while training on
        prep = vmmshim.prepare_pause()
        train(steps, steps)
        prep.join()
    else:
        train(steps, steps)
    for cycle in range(2):
        torch.cuda.synchronize()
        before = peak.now()
        t0 = time.perf_counter()
        r = vmmshim.pause() if sleep else None
        tp = time.perf_counter() - t0
        paused = peak.now()
        t = torch.full((4096,), float(rank + 1), device=dev)
        dist.barrier()
        dist.all_reduce(t)
        ok = t[0].item() == 3.0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if sleep:
            vmmshim.resume()
        tr = time.perf_counter() - t0
        after = peak.now()
        lines.append(f"R fsdp_cycle rank={rank} cycle={cycle} sleep={int(sleep)} collectives_ok={int(ok)} "
                     f"pause_s={tp:.3f} resume_s={tr:.3f} nvml_before_gib={before / 2**30:.2f} "
                     f"nvml_paused_gib={paused / 2**30:.2f} nvml_after_gib={after / 2**30:.2f}"
                     + (f" released_gib={r.bytes_released / 2**30:.2f} not_shim_gib={r.bytes_not_shim / 2**30:.3f}"
                        if r else ""))
        train(steps, steps * (cycle + 2))
    lines.append(f"R fsdp_done rank={rank} sleep={int(sleep)} nvml_peak_gib={peak.close() / 2**30:.2f} "
                 f"max_reserved_gib={torch.cuda.max_memory_reserved(dev) / 2**30:.2f}")
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def hybrid_main(rank, init, out, sleep):
    torch, dist = setup(rank, init)
    from torch.distributed.fsdp import fully_shard
    import vmmshim
    dev = torch.device("cuda", rank)
    width, nblocks, vocab = knob("HYBRID_WIDTH", 2048), 6, 8192
    iters, ntok = knob("HYBRID_ITERS", 8), knob("HYBRID_TOKENS", 32)
    peak = Peak(rank)
    native = torch.cuda.get_allocator_backend() == "native"
    pool = torch.cuda.MemPool() if native else None

    def make():
        return torch.nn.Sequential(torch.nn.Embedding(vocab, width), *mlp_blocks(torch, width, nblocks),
                                   torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab))

    def trainer_region():
        import contextlib
        stack = contextlib.ExitStack()
        if sleep:
            stack.enter_context(vmmshim.region("trainer"))
        if pool is not None:
            stack.enter_context(torch.cuda.use_mem_pool(pool))
        return stack

    torch.manual_seed(0)
    with trainer_region():
        trainer = make().to(dev)
        for blk in trainer[1:1 + nblocks]:
            fully_shard(blk)
        fully_shard(trainer)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    rollout = make().to(dev)  # untagged, the default pool
    g = torch.Generator(device=dev).manual_seed(7 + rank)
    prompts = torch.randint(0, vocab, (8,), device=dev, generator=torch.Generator(device=dev).manual_seed(3))
    lines = []
    times = {"iter": [], "pause": [], "resume": []}
    for it in range(iters):
        t_it = time.perf_counter()
        with trainer_region():
            x = torch.randint(0, vocab, (8, 256), device=dev, generator=g)
            logits = trainer(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            lines.append(f"rank {rank} loss {it} {loss.item():.9g}")
            with torch.no_grad():
                for (_, p), (_, q) in zip(trainer.named_parameters(), rollout.named_parameters()):
                    q.copy_(p.full_tensor())
        torch.cuda.synchronize()
        if sleep:
            t0 = time.perf_counter()
            vmmshim.pause("trainer")
            times["pause"].append(time.perf_counter() - t0)
        with torch.no_grad():
            tok = prompts.clone()
            seq = [tok]
            for _ in range(ntok):
                tok = rollout(tok[:, None])[:, -1].argmax(-1)
                seq.append(tok)
            seq = torch.stack(seq, 1)
            check = seq.sum(dtype=torch.int64).reshape(1)
            dist.all_reduce(check)
        lines.append(f"rank {rank} tokens {it} {seq.cpu().numpy().tobytes().hex()[:64]} {int(check.item())}")
        torch.cuda.synchronize()
        if sleep:
            t0 = time.perf_counter()
            vmmshim.resume("trainer")
            times["resume"].append(time.perf_counter() - t0)
        times["iter"].append(time.perf_counter() - t_it)

    def med(v):
        v = sorted(v)
        return f"{v[len(v) // 2]:.4f}" if v else "-"
    lines.append(f"R hybrid rank={rank} sleep={int(sleep)} backend={torch.cuda.get_allocator_backend()} "
                 f"iter_s={med(times['iter'][1:])} pause_s={med(times['pause'][1:])} "
                 f"first_pause_s={times['pause'][0] if times['pause'] else 0:.3f} resume_s={med(times['resume'][1:])} "
                 f"nvml_peak_gib={peak.close() / 2**30:.2f}")
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def run_ranks(fn, arg):
    """fn(rank, init, out, arg) in two processes (mp.spawn, a file:// store in a new directory out),
    then each rank's lines (out/rankR) printed in rank order."""
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp()
    mp.spawn(fn, args=("file://" + os.path.join(out, "init"), out, arg), nprocs=2)
    for r in range(2):
        with open(os.path.join(out, f"rank{r}")) as f:
            sys.stdout.write(f.read())
    sys.stdout.flush()


def main():
    run_ranks(fsdp_main if sys.argv[1] == "fsdp" else hybrid_main, "--sleep" in sys.argv)


if __name__ == "__main__":
    main()
