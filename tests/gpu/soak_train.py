"""The soak's trainer: a deterministic training loop with batch sizes that vary from step to
step (so the allocator sees sizes come and go), run for SOAK_SECONDS.  Prints "step N loss X"
every 10 steps and "done N" at the end; the same seeds give the same losses natively and under
the shim.  Run by tests/gpu/soak.sh."""
import os, time, torch

seconds = float(os.environ.get("SOAK_SECONDS", "1200"))
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.GELU(),
    torch.nn.Linear(4096, 4096), torch.nn.GELU(),
    torch.nn.Linear(4096, 1024)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(1)
start = time.time()
step = 0
print(f"pid {os.getpid()}", flush=True)
while time.time() - start < seconds:
    rows = 64 * (1 + (step * 7) % 16)
    x = torch.randn(rows, 1024, generator=gen).to(dev)
    y = torch.randn(rows, 1024, generator=gen).to(dev)
    scratch = torch.empty(1 + (step * 7919) % (48 << 20), dtype=torch.uint8, device=dev)  # 1 B .. 48 MiB
    scratch.fill_(step & 0xff)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    del scratch
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.9f}", flush=True)
    step += 1
torch.cuda.synchronize()
print(f"done {step}", flush=True)
