"""The PyTorch programs of the memory and step-time rows of `make bench-gpu` (issue 15), run by
tests/gpu/bench_mem.py natively and under the shim (PYTORCH_CUDA_ALLOC_CONF set by the caller),
which samples device memory through NVML from its own process meanwhile.

  steps NAME   a transformer training step whose sequence length changes every step (bench_torch.py's
               model and shapes): "M ready", "M steady_begin" after warm-up, "M steady_end" at the
               end, then "R torch/NAME ..." with max_memory_reserved and memory_stats()'s reserved and
               allocated figures (current and peak)
  graphs NAME  an MLP (8 blocks of Linear 512->2048, GELU, Linear 2048->512, LayerNorm; 8192 x 512
               inputs, fixed shapes) through torch.cuda.make_graphed_callables, then graph replays with
               an optimizer step outside the graph: "R graphs/NAME ..." with memory_reserved,
               max_memory_reserved and memory_stats() figures
  gpt NAME     a GPT-2-class decoder (8 layers, width 768, 12 heads, vocabulary 50,304, causal
               attention, bf16 autocast, AdamW) trained on batches of 8 whose sequence length changes
               every step between 96 and 1,024 tokens (GPT_STEPS, default 40): the held-out workload of
               issue 27, where the host runs far ahead of the GPU; output as `steps`
  worker NAME  a GPU-bound step (d_model 1024, 12 layers, 8 x 1024..2048 tokens, bf16 autocast);
               after warm-up prints "M ready", then answers each stdin line "run ROUND K" with K steps
               (shapes seeded by ROUND, so both sides run the same ones) and one line
               "T round=ROUND ms=a,b,..."; "quit" ends it

Without torch or CUDA it prints "SKIP reason" and exits 3."""
import random
import statistics
import sys
import time

try:
    import torch
except Exception as e:  # a machine without PyTorch: the row says skipped
    print(f"SKIP torch not importable: {e}", flush=True)
    sys.exit(3)
if not torch.cuda.is_available():
    print("SKIP torch.cuda.is_available() is False", flush=True)
    sys.exit(3)

mode = sys.argv[1] if len(sys.argv) > 1 else "steps"
name = sys.argv[2] if len(sys.argv) > 2 else "default"
dev = torch.device("cuda")
torch.manual_seed(0)


def mark(what):
    print(f"M {what} t={time.monotonic():.6f}", flush=True)


def model_of(d, heads, layers, dropout):
    layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True, norm_first=True)
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), torch.nn.Linear(d, d)
    ).to(dev)


def mem_fields():
    stats = torch.cuda.memory_stats()

    def stat(key):
        v = stats.get(key)
        return "na" if v is None else str(int(v))

    def call(f):
        try:
            return str(int(f()))
        except Exception:  # a backend without the figure
            return "na"

    try:
        backend = torch.cuda.get_allocator_backend()
    except Exception:
        backend = "na"
    return (
        f"memory_reserved={call(torch.cuda.memory_reserved)} max_reserved={call(torch.cuda.max_memory_reserved)} "
        f"reserved_current={stat('reserved_bytes.all.current')} reserved_peak={stat('reserved_bytes.all.peak')} "
        f"allocated_current={stat('allocated_bytes.all.current')} allocated_peak={stat('allocated_bytes.all.peak')} "
        f"backend={backend}"
    )


def steps():
    warmup, n = 8, 30
    batches, seqs, max_tokens, d = (4, 8, 16, 32), (64, 128, 192, 256, 384, 512, 768, 1024), 16384, 512
    rng = random.Random(0)
    shapes = []
    while len(shapes) < warmup + n:
        b, s = rng.choice(batches), rng.choice(seqs)
        if b * s <= max_tokens:
            shapes.append((b, s))
    model = model_of(d, 8, 6, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    mark("ready")
    times = []
    for i, (b, s) in enumerate(shapes):
        if i == warmup:
            torch.cuda.synchronize()
            mark("steady_begin")
        t0 = time.perf_counter()
        x = torch.randn(b, s, d, device=dev)
        y = torch.randn(b, s, d, device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    mark("steady_end")
    print(f"R torch/{name} step_ms={statistics.median(times):.3f} steps={len(times)} {mem_fields()}", flush=True)


def graphs():
    rows, d, replays = 8192, 512, 40
    blocks = []
    for _ in range(8):
        blocks += [torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d), torch.nn.LayerNorm(d)]
    model = torch.nn.Sequential(*blocks).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(rows, d, device=dev)  # the sample input; real inputs need no grad either
    y = torch.randn(rows, d, device=dev)
    torch.cuda.synchronize()
    mark("ready")
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    torch.cuda.synchronize()
    reserved_after_capture = torch.cuda.memory_reserved()
    times = []
    for i in range(replays):
        if i == 5:
            torch.cuda.synchronize()
            mark("steady_begin")
        t0 = time.perf_counter()
        out = graphed(torch.randn(rows, d, device=dev))
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    mark("steady_end")
    print(
        f"R graphs/{name} step_ms={statistics.median(times):.3f} replays={len(times)} "
        f"reserved_after_capture={reserved_after_capture} {mem_fields()}",
        flush=True,
    )


class _Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class _Gpt(torch.nn.Module):
    def __init__(self, vocab=50304, d=768, heads=12, layers=8, ctx=1024):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def gpt():
    import os

    warmup, n, batch, vocab = 5, int(os.environ.get("GPT_STEPS", "40")), 8, 50304
    rng = random.Random(0)
    seqs = [rng.randint(96, 1024) for _ in range(warmup + n)]
    model = _Gpt(vocab).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    torch.cuda.synchronize()
    mark("ready")
    times = []
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for i, s in enumerate(seqs):
        if i == warmup:
            torch.cuda.synchronize()
            mark("steady_begin")
        t0 = time.perf_counter()
        idx = torch.randint(0, vocab, (batch, s + 1), device=dev, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:  # no synchronize inside the loop: the host runs ahead of the GPU, as in training
            times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    mark("steady_end")
    print(f"R gpt/{name} step_ms={statistics.median(times):.3f} steps={len(times)} loss={loss.item():.6f} "
          f"{mem_fields()}", flush=True)


def worker():
    d, heads, layers, batch, seqs = 1024, 16, 12, 8, (1024, 1536, 2048)
    model = model_of(d, heads, layers, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(s):
        x = torch.randn(batch, s, d, device=dev)
        y = torch.randn(batch, s, d, device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for s in seqs + seqs:  # warm-up: every shape twice
        step(s)
    torch.cuda.synchronize()
    mark("ready")
    while True:
        line = sys.stdin.readline()
        w = line.split()
        if not w or w[0] == "quit":
            break
        rnd, k = int(w[1]), int(w[2])
        rng = random.Random(1000 + rnd)
        ms = []
        for _ in range(k):
            s = rng.choice(seqs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(s)
            torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        print(f"T round={rnd} ms={','.join(f'{v:.3f}' for v in ms)}", flush=True)
    print(f"R worker/{name} {mem_fields()}", flush=True)


{"steps": steps, "graphs": graphs, "gpt": gpt, "worker": worker}[mode]()
