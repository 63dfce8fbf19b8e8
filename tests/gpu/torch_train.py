"""A small training loop; prints its losses, and on request pauses so a companion can import a
parameter tensor.  Run natively and under the shim by tests/gpu/run.sh."""
import os, sys, time, torch

torch.manual_seed(0)
dev = "cuda"
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(1024, 256, device=dev)
y = torch.randint(0, 10, (1024,), device=dev)
for step in range(30):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
torch.cuda.synchronize()
if os.environ.get("PAUSE_FOR_COMPANION"):
    w = model[0].weight.detach()
    data = w.cpu().numpy().tobytes()
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    print(f"param {os.getpid()} 0x{w.data_ptr():x} {len(data)} fnv {h:016x}", flush=True)
    sys.stdin.readline()
