"""Run by tests/gpu/wheel.sh as `vmmshim run -- torchrun --nproc_per_node=2 tests/gpu/torchrun_pair.py`:
two workers on one GPU (gloo: NCCL refuses two ranks on one device), each allocating a tensor of
its own size; rank 0 gathers the workers' pids and addresses and asks `vmmctl list --json` (the
wheel's, on PATH) whether both are published, exportable, while both still hold them.  Prints
"pair ok" or "pair FAIL ..." from rank 0."""
import json
import os
import subprocess

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.full(((rank + 1) << 20,), rank + 1, dtype=torch.float32, device="cuda:0")
torch.cuda.synchronize()
mine = [os.getpid(), t.data_ptr(), "vmmshim" in os.environ.get("LD_PRELOAD", "")]
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
if rank == 0:
    bad = []
    for pid, ptr, preloaded in everyone:
        out = subprocess.run(["vmmctl", "list", "--pid", str(pid), "--json"], capture_output=True, text=True)
        try:
            recs = json.loads(out.stdout)
        except ValueError:
            bad.append(f"pid {pid}: vmmctl list said {out.stdout[:200]!r} {out.stderr[:200]!r}")
            continue
        recs = recs if isinstance(recs, list) else recs.get("allocations", recs.get("records", []))
        hit = [r for r in recs if r["address"] <= ptr < r["address"] + r["mapped_size"]]
        if not preloaded or not hit or "broker" not in hit[0].get("handle_kinds", []):
            bad.append(f"pid {pid} ptr 0x{ptr:x} preloaded={preloaded} records={len(recs)} hit={hit[:1]}")
        else:
            print(f"worker pid {pid}: tensor 0x{ptr:x} published, api {hit[0].get('api')}, exportable", flush=True)
    print("pair ok" if not bad else "pair FAIL " + "; ".join(bad), flush=True)
dist.barrier()
dist.destroy_process_group()
