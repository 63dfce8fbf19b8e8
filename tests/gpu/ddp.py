"""Two-GPU PyTorch DistributedDataParallel over NCCL, for tests/gpu/ddp.sh.

  ddp.py --init file:///PATH [--go-file PATH] [--steps 30] [--pause-at 15]
      mp.spawn of one process per GPU (two by default), a small MLP trained with a fixed seed
      (each rank its own fixed data; DDP averages the gradients with NCCL all-reduce).  After
      step --pause-at the ranks exchange their pids; rank 0 prints "# pause PID0 PID1"; with
      --go-file every rank then waits (at most 60 s, outside any collective) until that file
      exists.  When all ranks are done the parent prints, rank by rank, "rank R step S loss L"
      (9 significant digits), then "rank R params sum X", "params equal across ranks: yes|no"
      and "done".  Volatile lines start '#'.

  ddp.py --compare NATIVE_OUT SHIM_OUT
      Compares the result lines (those starting "rank ", "params " or "done") of two runs:
      "same losses: exact" (exit 0), else "same losses: within relative 1e-5, not bitwise ..."
      (exit 0), else "losses differ: ..." (exit 1).
"""
import argparse
import os
import re
import sys
import tempfile
import time


def worker(rank, world, init, outdir, go_file, steps, pause_at):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", rank)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(256, 128, generator=g).to(dev)
    y = torch.randint(0, 10, (256,), generator=g).to(dev)
    lines = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        lines.append(f"rank {rank} step {step} loss {loss.item():.8e}")
        if step == pause_at:
            torch.cuda.synchronize()
            pids = [None] * world
            dist.all_gather_object(pids, os.getpid())
            if rank == 0:
                print("# pause " + " ".join(str(p) for p in pids), flush=True)
            if go_file:
                deadline = time.monotonic() + 60
                while not os.path.exists(go_file) and time.monotonic() < deadline:
                    time.sleep(0.1)
    torch.cuda.synchronize()
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    lines.append(f"rank {rank} params sum {total:.12e}")
    with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


RESULT = re.compile(r"^(rank \d+ |params |done)")
NUM = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def compare(a, b, tol=1e-5):
    la = [line.split() for line in open(a, errors="replace") if RESULT.match(line)]
    lb = [line.split() for line in open(b, errors="replace") if RESULT.match(line)]
    losses = sum(1 for t in la if "loss" in t)
    if not la or losses == 0:
        print(f"losses differ: no loss lines in {a}")
        return 1
    if la == lb:
        print(f"same losses: exact ({losses} loss lines, bitwise identical)")
        return 0
    if len(la) != len(lb):
        print(f"losses differ: {len(la)} result lines natively, {len(lb)} under the shim")
        return 1
    worst, nlines = 0.0, 0
    for i, (ta, tb) in enumerate(zip(la, lb)):
        if ta == tb:
            continue
        nlines += 1
        bad = len(ta) != len(tb)
        for u, v in zip(ta, tb):
            if u == v:
                continue
            if not (NUM.match(u) and NUM.match(v)):
                bad = True
                break
            fu, fv = float(u), float(v)
            rel = abs(fu - fv) / max(abs(fu), abs(fv), 1e-30)
            worst = max(worst, rel)
            bad = bad or rel > tol
        if bad:
            print(f"losses differ: line {i + 1}: native '{' '.join(ta)}', shim '{' '.join(tb)}'")
            return 1
    print(f"same losses: within relative {tol:g}, not bitwise ({nlines} of {len(la)} lines differ in the last "
          f"digits, largest relative difference {worst:.2e})")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init")
    ap.add_argument("--go-file", default="")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pause-at", type=int, default=15)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--compare", nargs=2, metavar=("NATIVE", "SHIM"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.init:
        ap.error("--init is needed")
    import torch
    import torch.multiprocessing as mp

    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # informative only
        nccl = repr(e)
    print(f"# torch {torch.__version__} cuda {torch.version.cuda} nccl {nccl}, " + ", ".join(
        f"{k}={os.environ.get(k, '(unset)')}" for k in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE")),
        flush=True)
    outdir = tempfile.mkdtemp(prefix="vmmshim-ddp-")
    mp.spawn(worker, args=(args.world, args.init, outdir, args.go_file, args.steps, args.pause_at),
             nprocs=args.world, join=True)
    sums = []
    for r in range(args.world):
        with open(os.path.join(outdir, f"rank{r}.txt")) as f:
            text = f.read()
        sys.stdout.write(text)
        sums += [line.split()[-1] for line in text.splitlines() if " params sum " in line]
        os.unlink(os.path.join(outdir, f"rank{r}.txt"))
    os.rmdir(outdir)
    print("params equal across ranks:", "yes" if len(sums) == args.world and len(set(sums)) == 1 else "no")
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
