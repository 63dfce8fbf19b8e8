"""Row g: torch.multiprocessing (spawn) shares a CUDA tensor with a second process, which
modifies it in place; the parent prints the result.  Pauses once in the parent."""
import os
import sys

import torch
import torch.multiprocessing as mp


def child(q, done):
    t = q.get()
    t.mul_(2).add_(1)
    torch.cuda.synchronize()
    del t
    done.set()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    print(f"# torch {torch.__version__}, tensor at 0x{t.data_ptr():x}")
    print(f"# pause {os.getpid()}", flush=True)
    sys.stdin.readline()
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, done))
    p.start()
    q.put(t)
    print("child finished:", done.wait(90))
    p.join(60)
    print("child exit code", p.exitcode)
    torch.cuda.synchronize()
    print("first values", t[:5].tolist())
    print("sum", int(t.double().sum().item()))
    print("done")
