"""Issue 40 on the GPUs a machine has: trainer ranks publish DTensor shards (publish_many), a companion
takes them by name with vmmshim.Group, and a sidecar serves them through torch.distributed.

  python3 tests/gpu/shards.py run [--world 2] [--takes 5] [--race 40]

The trainers are W processes under the shim (LD_PRELOAD), one per GPU where the machine has W, all
on GPU 0 where it has one, in a gloo process group (a mesh of W ranks; DTensor.from_local, no
collective): each holds FSDP2's layout of the Llama-shaped 1B-class model of weight_sync.py (165
bf16 tensors, 1.76 GiB; each tensor's rows split as torch.chunk splits them, in storage padded to
ceil(rows / W) as FSDP2 pads it), small integers so that adding 1 is exact in bf16.  Then:
  take     Group(job).take(into=...): the whole of every tensor, bit-exact against the weights made
           again here; its time and bytes/s; a TP slice (dim 0, each rank of 2) bit-exact; the
           pieces zero-copy (views=True), each on the GPU it lives on
  race     the trainers add 1 to every piece in place, --race times, each inside
           vmmshim.updating(step) (the optimizer step), the ranks meeting at a barrier after each
           as FSDP's collectives make them; meanwhile the companion takes again and again:
           every take holds one version, whole (base + version), and takes that raced a step were
           taken again
  sidecar  a sidecar process (Group of the trainers) and a receiver in a process group of their own
           over gloo (NCCL wants a GPU a rank: NCCL with 2 GPUs a machine), the receiver's refresh
           of every tensor bit-exact, its time
Prints "R ..." lines, PASS/FAIL lines and "shards: N passed, N failed"."""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
JOB = "shards-gpu"


def shapes():
    from weight_sync import llama1b_shapes
    return llama1b_shapes()


def base(torch, i, shape, device):
    g = torch.Generator(device=device)
    g.manual_seed(1000 + i)
    return torch.randint(0, 8, shape, generator=g, device=device).to(torch.bfloat16)


def trainer(rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import vmmshim
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    params, local = {}, []
    for i, (name, shape) in enumerate(shapes()):
        full = base(torch, i, shape, f"cuda:{dev}")
        rows = shape[0]
        per = -(-rows // world)
        start = min(rank * per, rows)
        n = min(start + per, rows) - start
        storage = torch.zeros((per,) + tuple(shape[1:]), dtype=full.dtype, device=full.device)  # FSDP2's padding
        storage[:n].copy_(full[start:start + n])
        piece = storage[:n]
        local.append(piece)
        params[name] = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                          stride=full.stride())
        del full
    torch.cuda.synchronize()
    vmmshim.publish_many(params, version=0, job=JOB)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "race":
            steps, t0 = int(cmd[1]), time.perf_counter()
            for step in range(1, steps + 1):
                with vmmshim.updating(step):
                    for p in local:
                        p.add_(1)
                dist.barrier()  # the next step's collectives keep the ranks in step, as FSDP's do
                time.sleep(0.05)  # the next step's forward and backward (longer than a take): the weights stay
            torch.cuda.synchronize()
            print(json.dumps({"raced": steps, "s": time.perf_counter() - t0}), flush=True)
        elif cmd[0] == "quit":
            break
    dist.destroy_process_group()


def reference(torch, version, device):
    return {name: base(torch, i, shape, device) + version for i, (name, shape) in enumerate(shapes())}


def companion(takes):
    import torch
    import vmmshim
    torch.cuda.set_device(0)
    reg = vmmshim.Registry()
    g = vmmshim.Group(reg, job=JOB)
    ref = reference(torch, 0, "cuda:0")
    into = {n: torch.empty_like(t) for n, t in ref.items()}
    nbytes = sum(t.numel() * t.element_size() for t in ref.values())
    times = []
    for k in range(takes + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = g.take(into=into)
        times.append(time.perf_counter() - t0)
    exact = all(torch.equal(got[n], ref[n]) for n in ref)
    steady = sorted(times[1:])
    med = steady[len(steady) // 2]
    out = {"names": len(got), "bytes": nbytes, "first_s": times[0], "take_s": med, "take_min": steady[0],
           "take_max": steady[-1], "gbps": nbytes / med / 1e9, "exact": exact, "version": got.version,
           "ranks": len(g.pids)}
    tp_ok = True
    for r in range(2):
        sl = g.take(tp=(0, r, 2))
        for n, t in ref.items():
            per = -(-t.shape[0] // 2)
            tp_ok &= torch.equal(sl[n], t[r * per:(r + 1) * per])
    out["tp_exact"] = tp_ok
    views = g.take(views=True)
    out["views_exact"] = all(torch.equal(t, ref[n][p.offset[0]:p.offset[0] + p.shape[0]])
                             for n, ps in views.items() for p, t in ps)
    out["views_devices"] = sorted({str(t.device) for ps in views.values() for _, t in ps})
    print(json.dumps(out), flush=True)
    # the race: the trainers step while this takes
    print(json.dumps({"racing": True}), flush=True)
    line = sys.stdin.readline()
    refs, accepted, retried, torn, deadline = {}, [], 0, 0, time.monotonic() + 120
    target = int(line.split()[1])
    while time.monotonic() < deadline:
        try:
            got = g.take(into=into, retries=20)
        except vmmshim.Busy:
            retried += 21
            continue
        retried += got.attempts - 1
        v = got.version
        if v not in refs:
            refs = {v: reference(torch, v, "cuda:0")}
        torn += not all(torch.equal(got[n], refs[v][n]) for n in refs[v])
        accepted.append(v)
        if v == target:
            break
    print(json.dumps({"accepted": len(accepted), "versions": sorted(set(accepted))[:3] + sorted(set(accepted))[-3:],
                      "last": accepted[-1] if accepted else None, "torn": torn, "retried": retried}), flush=True)


def sidecar_role(rank, version):
    import torch
    import torch.distributed as dist
    import vmmshim
    from vmmshim import _sidecar
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        sc = _sidecar.Sidecar(vmmshim.Group(vmmshim.Registry(), job=JOB), dist, n_sidecars=1)
        rounds = sc.serve()
        print(json.dumps({"rounds": rounds, "retries": sc.retries}), flush=True)
    else:
        rx = _sidecar.Receiver(dist, n_sidecars=1)
        ref = reference(torch, version, "cuda:0")
        into = {n: torch.empty_like(t) for n, t in ref.items()}
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            v, attempts = rx.refresh(into)
            times.append(time.perf_counter() - t0)
        exact = all(torch.equal(into[n], ref[n]) for n in ref)
        rx.stop()
        nbytes = sum(t.numel() * t.element_size() for t in ref.values())
        print(json.dumps({"exact": exact, "version": v, "refresh_s": sorted(times)[1], "times": times,
                          "gbps": nbytes / sorted(times)[1] / 1e9}), flush=True)
    dist.destroy_process_group()


def run(args):
    build = os.environ.get("BUILD", os.path.join(ROOT, "build"))
    shim = os.path.join(build, "libvmmshim.so")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tools", "python"), PYTHONUNBUFFERED="1",
               VMMSHIM_CLIENT_LIB=os.path.join(build, "libvmmshim-client.so"), MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29561", WORLD_SIZE=str(args.world), NCCL_NVLS_ENABLE="0")
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        passed, failed = passed + bool(ok), failed + (not ok)
        return ok

    me = os.path.abspath(__file__)
    trainers = [subprocess.Popen([sys.executable, me, "trainer", str(r), str(args.world)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=dict(env, LD_PRELOAD=shim, RANK=str(r)))
                for r in range(args.world)]
    try:
        ready = [json.loads(t.stdout.readline() or "{}") for t in trainers]
        if not check(all(r.get("ready") for r in ready), f"{args.world} trainer ranks published their shards: {ready}"):
            return 1
        comp = subprocess.Popen([sys.executable, me, "companion", str(args.takes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        r = json.loads(comp.stdout.readline() or "{}")
        print("R take " + json.dumps(r), flush=True)
        check(r.get("exact") and r.get("ranks") == args.world and r.get("names") == 165,
              f"take: every tensor whole from {r.get('ranks')} ranks, bit-exact: {r.get('exact')}")
        check(r.get("tp_exact"), "take: each TP slice (dim 0, 2 ranks) bit-exact")
        check(r.get("views_exact"), f"take: the pieces zero-copy, each where it lives {r.get('views_devices')}")
        comp.stdout.readline()
        comp.stdin.write(f"target {args.race}\n")
        comp.stdin.flush()
        for t in trainers:
            t.stdin.write(f"race {args.race}\n")
            t.stdin.flush()
        raced = [json.loads(t.stdout.readline() or "{}") for t in trainers]
        r = json.loads(comp.stdout.readline() or "{}")
        comp.wait(timeout=60)
        print("R race " + json.dumps(r) + " trainers " + json.dumps(raced), flush=True)
        check(r.get("torn") == 0 and r.get("accepted", 0) >= 3 and r.get("last") == args.race,
              f"race: every take one version whole ({r.get('torn')} torn of {r.get('accepted')}, last {r.get('last')})")
        check(r.get("retried", 0) > 0, f"race: takes that raced a step were taken again ({r.get('retried')})")
        senv = dict(env, MASTER_PORT="29562")
        side = [subprocess.Popen([sys.executable, me, "sidecar", str(k), str(args.race)], stdout=subprocess.PIPE,
                                 text=True, env=senv) for k in range(2)]
        out = [json.loads(p.stdout.readline() or "{}") for p in side]
        for p in side:
            p.wait(timeout=120)
        print("R sidecar " + json.dumps(out), flush=True)
        check(out[1].get("exact") and out[0].get("rounds") == 3,
              f"sidecar over gloo: 3 refreshes bit-exact, {out[1].get('refresh_s')} s each")
    finally:
        for t in trainers:
            try:
                t.stdin.write("quit\n")
                t.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for t in trainers:
            try:
                t.wait(timeout=30)
            except subprocess.TimeoutExpired:
                t.kill()
    print(f"shards: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["run", "trainer", "companion", "sidecar"])
    p.add_argument("args", nargs="*")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--takes", type=int, default=5)
    p.add_argument("--race", type=int, default=40)
    a = p.parse_args()
    if a.role == "run":
        return run(a)
    if a.role == "trainer":
        return trainer(int(a.args[0]), int(a.args[1]))
    if a.role == "companion":
        return companion(int(a.args[0]))
    return sidecar_role(int(a.args[0]), int(a.args[1]))


if __name__ == "__main__":
    sys.exit(main() or 0)
