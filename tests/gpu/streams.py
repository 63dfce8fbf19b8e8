"""Issue 38's bench: memory and step time of a two-GPU PyTorch job, natively and under the shim, run by
tests/gpu/streams.sh.

  streams.py run fsdp|ddp      mp.spawn of two ranks over NCCL (file:// store), one GPU each: STREAMS_BLOCKS
        (8) MLP blocks of width STREAMS_WIDTH (2048), AdamW, batch 16x512 tokens, STREAMS_STEPS (20)
        steps; fsdp: fully_shard per block and the root (FSDP2: all-gathers on their own streams);
        ddp: DistributedDataParallel.  No step waits for the GPU (losses stay on it until the end), so
        the host runs ahead of a GPU-bound step as a training job's does.  Prints each rank's losses
        ("rank R loss S V") and "R streams rank=R mode=.. backend=.. step_ms=.. reserved_mib=..
        allocated_mib=.. nvml_peak_mib=..": the mean step after STREAMS_WARM (5) steps,
        torch.cuda.max_memory_reserved / max_memory_allocated (under backend:cudaMallocAsync the
        pool's ReservedMemHigh and UsedMemHigh) and the GPU's NVML peak, sampled every 5 ms.
  streams.py table DIR         the table and the criteria over DIR/ROUND.SIDE.CONF.MODE.out (SIDE native
        or shim), per mode, allocator setting and GPU: medians over the rounds; ends with
        "streams: N passed, N failed".
  streams.py dry DIR CASE      writes made-up run outputs into DIR for the table, so CI checks the
        analysis without a GPU.  CASE: good; bimodal (DDP's live peak a bucket set higher on one rank
        in some runs, native and shim alike, as on the H200s); twice (the shim holding twice native
        under cudaMallocAsync, as before db253d3); usedhigh (the pool's UsedMemHigh 512 MiB off);
        drift (one loss differing and a slow step).

Memory is judged by what a run holds beyond its own allocated peak (PyTorch's count of live bytes):
reserved and NVML over it within 5% of native's total + 64 MiB of native's; under cudaMallocAsync, whose
allocated peak the shim answers (UsedMemHigh), each shim run's peak one that a native run reached."""
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 2**20
CONFS = ("default", "expandable", "async")
MODES = ("fsdp", "ddp")
# shim/native: memory within 5% plus 64 MiB per GPU (issue 38's target), statistics within 5% both
# ways (a shim that reports less than it holds is as wrong as one that holds more), the step 5%.
MEM_SLACK, MEM_PAD_MIB, STEP_MAX = 0.05, 64, 1.05


def knob(name, default):
    return int(os.environ.get(name, default))


def worker(rank, init, out, mode):
    import fsdp_sleep
    torch, dist = fsdp_sleep.setup(rank, init)
    dev = torch.device("cuda", rank)
    width, nblocks = knob("STREAMS_WIDTH", 2048), knob("STREAMS_BLOCKS", 8)
    steps, warm = knob("STREAMS_STEPS", 20), knob("STREAMS_WARM", 5)
    peak = fsdp_sleep.Peak(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*fsdp_sleep.mlp_blocks(torch, width, nblocks)).to(dev)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for blk in model:
            fully_shard(blk)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1 + rank)
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        if s == warm:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        x = torch.randn(16, 512, width, device=dev, generator=g)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize(dev)
    step_ms = (time.perf_counter() - t0) * 1e3 / max(1, steps - warm)
    lines = [f"rank {rank} loss {s} {v:.9g}" for s, v in enumerate(torch.stack(losses).tolist())]
    lines.append(f"R streams rank={rank} mode={mode} backend={torch.cuda.get_allocator_backend()} "
                 f"step_ms={step_ms:.2f} reserved_mib={torch.cuda.max_memory_reserved(dev) / MIB:.1f} "
                 f"allocated_mib={torch.cuda.max_memory_allocated(dev) / MIB:.1f} "
                 f"nvml_peak_mib={peak.close() / MIB:.1f}")
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def run(mode):
    import fsdp_sleep
    fsdp_sleep.run_ranks(worker, mode)


def parse(path):
    """A run's losses (rank, step) -> text and measurements rank -> {key: float}; None if it printed none."""
    losses, meas = {}, {}
    with open(path) as f:
        for line in f:
            m = re.match(r"rank (\d+) loss (\d+) (\S+)$", line.strip())
            if m:
                losses[(int(m[1]), int(m[2]))] = m[3]
            elif line.startswith("R streams "):
                kv = dict(w.split("=", 1) for w in line.split()[2:])
                meas[int(kv["rank"])] = {k: float(v) for k, v in kv.items() if k.endswith(("_ms", "_mib"))}
    return (losses, meas) if len(meas) == 2 else None


def spread(values):
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def table(d):
    runs = {}
    for name in os.listdir(d):
        m = re.match(r"(\d+)\.(native|shim)\.(\w+)\.(fsdp|ddp)\.out$", name)
        if m:
            runs[(int(m[1]), m[2], m[3], m[4])] = parse(os.path.join(d, name))
    rounds = sorted({k[0] for k in runs})
    npass = nfail = 0
    lines = []

    def check(cond, what):
        nonlocal npass, nfail
        npass, nfail = npass + bool(cond), nfail + (not cond)
        lines.append(("PASS " if cond else "FAIL ") + what)

    print(f"{'mode':5} {'allocator':11} {'gpu':3} {'reserved MiB nat/shim':>22} {'x':>5} {'allocated MiB nat/shim':>23} "
          f"{'x':>5} {'NVML peak MiB nat/shim':>23} {'x':>5} {'step ms nat/shim':>17} {'x':>5} {'per round':>10}")
    for mode in MODES:
        for conf in CONFS:
            have = [r for r in rounds if (r, "native", conf, mode) in runs or (r, "shim", conf, mode) in runs]
            if not have:
                continue
            what = f"{mode} {conf}"
            bad = [f"{r}.{side}" for r in have for side in ("native", "shim") if not runs.get((r, side, conf, mode))]
            check(not bad, f"{what}: every run finished with both ranks' measurements ({len(have)} rounds)"
                  + (f": missing {' '.join(bad)}" if bad else ""))
            ok = [r for r in have if runs.get((r, "native", conf, mode)) and runs.get((r, "shim", conf, mode))]
            if not ok:
                continue
            differ = [r for r in ok if runs[(r, "shim", conf, mode)][0] != runs[(r, "native", conf, mode)][0]
                      or not runs[(r, "native", conf, mode)][0]]
            nloss = len(runs[(ok[0], "native", conf, mode)][0])
            check(not differ, f"{what}: losses bit-identical to native in each round ({nloss} a run)"
                  + (f": differ in round {' '.join(map(str, differ))}" if differ else ""))
            step_ratios = []
            for r in ok:  # a run's step is its slower rank's
                nat = max(v["step_ms"] for v in runs[(r, "native", conf, mode)][1].values())
                shim = max(v["step_ms"] for v in runs[(r, "shim", conf, mode)][1].values())
                step_ratios.append(shim / nat)
            for rank in (0, 1):
                def med(side, key):
                    return statistics.median(runs[(r, side, conf, mode)][1][rank][key] for r in ok)
                row = {}
                for key in ("reserved_mib", "allocated_mib", "nvml_peak_mib", "step_ms"):
                    row[key] = (med("native", key), med("shim", key))
                cells = " ".join(f"{row[k][0]:>10.0f}/{row[k][1]:<11.0f} {row[k][1] / row[k][0]:5.3f}"
                                 for k in ("reserved_mib", "allocated_mib", "nvml_peak_mib"))
                sr = statistics.median(step_ratios)
                print(f"{mode:5} {conf:11} {rank:3} {cells} {row['step_ms'][0]:8.1f}/{row['step_ms'][1]:<8.1f} "
                      f"{sr:5.3f} {spread(step_ratios):>10}")
                # What the shim answers for is what is held beyond PyTorch's own peak of live bytes in
                # the same run: DDP's peak moves by a whole bucket set from run to run natively too (a
                # free waiting on NCCL's stream lands before or after the next step's allocations).
                def over(side, key):
                    return statistics.median(runs[(r, side, conf, mode)][1][rank][key]
                                             - runs[(r, side, conf, mode)][1][rank]["allocated_mib"] for r in ok)
                for key, label, both in (("reserved_mib", "max_memory_reserved", True),
                                         ("nvml_peak_mib", "NVML peak", False)):
                    nat, shim, room = over("native", key), over("shim", key), MEM_SLACK * row[key][0] + MEM_PAD_MIB
                    check(shim <= nat + room and (not both or shim >= nat - room),
                          f"{what} GPU {rank}: {label} {shim:.0f} MiB over the run's allocated peak under the shim, "
                          f"native {nat:.0f} (within 5% of native's {row[key][0]:.0f} + {MEM_PAD_MIB} MiB"
                          f"{' either way' if both else ''})")
                if conf == "async":  # the pool's UsedMemHigh, which the shim answers: a peak native reached too
                    seen = sorted({v["allocated_mib"] for (_, side, c, m_), x in runs.items()
                                   if x and side == "native" and (c, m_) == (conf, mode) for v in x[1].values()})
                    mine = [runs[(r, "shim", conf, mode)][1][rank]["allocated_mib"] for r in ok]
                    check(all(any(abs(a - b) <= MEM_PAD_MIB for b in seen) for a in mine),
                          f"{what} GPU {rank}: max_memory_allocated (UsedMemHigh) under the shim "
                          f"{' '.join(f'{a:.0f}' for a in mine)} MiB, each one native reached "
                          f"({' '.join(f'{b:.0f}' for b in seen)})")
            sr = statistics.median(step_ratios)
            check(sr <= STEP_MAX, f"{what}: step {sr:.3f}x native (median of {len(step_ratios)} rounds, "
                  f"{spread(step_ratios)}; <= {STEP_MAX}x)")
    print("\n".join(lines))
    print(f"streams: {npass} passed, {nfail} failed")
    return nfail == 0


def dry(d, case, rounds=2):
    """Made-up outputs in the shape run() prints: the shim as native, or with issue 38's fault."""
    os.makedirs(d, exist_ok=True)
    for r in range(1, rounds + 1):
        for conf in CONFS:
            for mode in MODES:
                for side in ("native", "shim"):
                    res, step = (7800.0 if mode == "fsdp" else 6200.0), 276.0 + r
                    nvml, alloc = res + 2200, res - 300
                    loss = [f"{1.0 + s / 64:.9g}" for s in range(20)]
                    if side == "shim" and case == "twice" and conf == "async" and mode == "fsdp":
                        res, nvml = 2 * res, nvml + res
                    if side == "shim" and case == "drift" and conf == "default" and mode == "ddp":
                        loss[7], step = "1.11", step * 1.2
                    lifted = {}  # rank -> MiB PyTorch's live peak rose by, everything following it
                    if case == "bimodal" and mode == "ddp":  # DDP's peak, a bucket set up or not
                        lifted = {0: 1024.0} if side == "shim" else {1: 1024.0} if r == 1 else {}
                    usedhigh = side == "shim" and case == "usedhigh" and conf == "async" and mode == "fsdp"
                    with open(os.path.join(d, f"{r}.{side}.{conf}.{mode}.out"), "w") as f:
                        for rank in (0, 1):
                            f.writelines(f"rank {rank} loss {s} {v}\n" for s, v in enumerate(loss))
                        for rank in (0, 1):
                            up = lifted.get(rank, 0.0)
                            f.write(f"R streams rank={rank} mode={mode} backend=x step_ms={step:.2f} "
                                    f"reserved_mib={res + up:.1f} allocated_mib={alloc + up + 512 * usedhigh:.1f} "
                                    f"nvml_peak_mib={nvml + up:.1f}\n")


def main():
    if sys.argv[1] == "run":
        run(sys.argv[2])
    elif sys.argv[1] == "table":
        sys.exit(0 if table(sys.argv[2]) else 1)
    elif sys.argv[1] == "dry":
        dry(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"streams.py: unknown command {sys.argv[1]!r} (run, table, dry)")


if __name__ == "__main__":
    main()
