"""Rows d, e, f: a small deterministic PyTorch training loop (losses to 6 decimals) and a few
buffers of assorted sizes, under whichever allocator PYTORCH_CUDA_ALLOC_CONF selects.  Pauses
once ("# pause PID", then a line on stdin) while everything is live; just before, one line
"# param NAME 0xADDR NBYTES" per model parameter (row f checks each lies in an exportable
cuMemMap record).  Volatile lines start '#'."""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

torch.manual_seed(0)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
print(f"# torch {torch.__version__} cuda {torch.version.cuda} "
      f"alloc_conf {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
dev = "cuda"
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x = torch.randn(512, 64, device=dev)
y = torch.randint(0, 10, (512,), device=dev)
for step in range(12):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")

bufs = [torch.full((n,), i + 1, dtype=torch.uint8, device=dev)
        for i, n in enumerate([1 << 10, 1 << 20, (3 << 20) + 17, 17 << 20, 65 << 20])]
print("buffers", [int(b.sum().item()) for b in bufs])
w = model[0].weight.detach()
print(f"# first weight at 0x{w.data_ptr():x}, reserved {torch.cuda.memory_reserved()}")
for name, p in model.named_parameters():
    print(f"# param {name} 0x{p.data_ptr():x} {p.numel() * p.element_size()}")
torch.cuda.synchronize()
print(f"# pause {os.getpid()}", flush=True)
sys.stdin.readline()
del bufs
torch.cuda.empty_cache()
print("weight sum", f"{w.double().sum().item():.6f}")
print("done")
