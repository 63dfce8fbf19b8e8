"""The trainer of tests/gpu/ddp_soak.sh: PyTorch DistributedDataParallel over NCCL on two GPUs for
a given time, deterministic, with shapes that change from step to step.

  ddp_soak.py --init file:///PATH --seconds S [--log-every 50]
      mp.spawn of one process per GPU.  Each rank prints "# rank R pid P" once it is set up,
      "# training" (rank 0) when the loop starts, "rank R step N loss L" every --log-every steps
      (9 significant digits; the same seeds give the same losses natively and under the shim,
      whatever the speed), and "rank R done N" at the end.  The model is an MLP (1024-4096-4096-
      1024, AdamW); each step's batch has 64..1024 rows (a function of the step) of each rank's
      own fixed-seed data, and a scratch tensor of 1 B..48 MiB is made, filled and dropped, so the
      allocator sees sizes come and go.  Every 10 steps the ranks agree (an all-reduce of a flag)
      whether rank 0's clock says the time is up, so they stop at the same step.
"""
import argparse
import os
import sys
import time


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def worker(rank, world, init, seconds, log_every):
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
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096),
                                torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(dev)
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234 + rank)
    say(f"# rank {rank} pid {os.getpid()}")
    dist.barrier(device_ids=[rank])
    if rank == 0:
        say("# training")
    start = time.monotonic()
    step = 0
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    while True:
        if step % 10 == 0:
            flag.fill_(1 if rank == 0 and time.monotonic() - start >= seconds else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        rows = 64 * (1 + (step * 7) % 16)
        x = torch.randn(rows, 1024, generator=gen).to(dev)
        y = torch.randn(rows, 1024, generator=gen).to(dev)
        scratch = torch.empty(1 + (step * 7919) % (48 << 20), dtype=torch.uint8, device=dev)
        scratch.fill_(step & 0xFF)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del scratch
        if step % log_every == 0:
            say(f"rank {rank} step {step} loss {loss.item():.9e}")
        step += 1
    torch.cuda.synchronize()
    say(f"rank {rank} done {step}")
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    say(f"# torch {torch.__version__} cuda {torch.version.cuda}, parent pid {os.getpid()}, PYTORCH_CUDA_ALLOC_CONF="
        f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}")
    mp.spawn(worker, args=(args.world, args.init, args.seconds, args.log_every), nprocs=args.world, join=True)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
