"""Training steps whose tensor shapes change from step to step, for `make bench-gpu`
(tests/gpu/bench.sh runs it natively and under the shim, PYTORCH_CUDA_ALLOC_CONF set by the
caller; argv[1] names the configuration in the output).  Changing shapes keep the allocator
busy after warm-up, which is where the shim's costs would show.  Prints one line,
"R torch/NAME key=value ...": the median and every step time, and what the allocator says it
reserved (keys it does not report print as na)."""
import os
import random
import statistics
import sys
import time

import torch

WARMUP, STEPS = 8, 40
BATCHES = (4, 8, 16, 32)
SEQS = (64, 128, 192, 256, 384, 512, 768, 1024)
MAX_TOKENS = 16384  # bounds the largest step (and so the run) on an 80 GB H100
D_MODEL, HEADS, LAYERS = 512, 8, 6

name = sys.argv[1] if len(sys.argv) > 1 else "default"
torch.manual_seed(0)
rng = random.Random(0)
shapes = []
while len(shapes) < WARMUP + STEPS:
    b, s = rng.choice(BATCHES), rng.choice(SEQS)
    if b * s <= MAX_TOKENS:
        shapes.append((b, s))

dev = torch.device("cuda")
layer = torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.1, batch_first=True, norm_first=True)
model = torch.nn.Sequential(
    torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False), torch.nn.Linear(D_MODEL, D_MODEL)
).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(b, s):
    x = torch.randn(b, s, D_MODEL, device=dev)
    y = torch.randn(b, s, D_MODEL, device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


times = []
for i, (b, s) in enumerate(shapes):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(b, s)
    torch.cuda.synchronize()
    if i >= WARMUP:
        times.append((time.perf_counter() - t0) * 1e3)

stats = torch.cuda.memory_stats()


def stat(key):
    v = stats.get(key)
    return "na" if v is None else str(int(v))


try:
    max_reserved = str(torch.cuda.max_memory_reserved())
except Exception:  # an allocator backend without the statistic
    max_reserved = "na"
try:
    backend = torch.cuda.get_allocator_backend()
except Exception:
    backend = "na"
print(
    f"R torch/{name} step_ms={statistics.median(times):.3f} mean_ms={statistics.fmean(times):.3f} "
    f"steps={len(times)} max_reserved={max_reserved} reserved_peak={stat('reserved_bytes.all.peak')} "
    f"reserved_current={stat('reserved_bytes.all.current')} allocated_peak={stat('allocated_bytes.all.peak')} "
    f"backend={backend} conf={os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'unset'} "
    f"step_list={','.join(f'{t:.2f}' for t in times)}",
    flush=True,
)
