"""The sleep table of issue 29, under the shim on one GPU, with a real PyTorch:
`LD_PRELOAD=build/libvmmshim.so python3 tests/gpu/sleep_bench.py` (PYTORCH_CUDA_ALLOC_CONF as the row
wants).  One process, so that one run alternates the rows:

  trainer   a Llama-shaped decoder (SLEEP_LAYERS, default 16, of width 2048, GQA 16/4 heads, SwiGLU
            5632, vocabulary 32,000: about 1.1 B parameters) in bf16 with AdamW, its weights made
            untagged and its optimizer state and gradients under the tag "optim" (a MemPool of their
            own inside vmmshim.region, the way _sleep.py says), trained K steps; then, each round:
            pause("optim") kept, a neighbour process cudaMalloc's the bytes released, resume, K
            more steps.  The same model trained without sleeping, from the same seed, gives the
            reference losses: they must be equal bit for bit.
  kv        half the device's free memory under the tag "kv" (one tensor), paused with keep=False
            and resumed, each round.

Prints "R ..." lines: pause and resume times and GB/s, pinned device-to-host and host-to-device
bandwidth measured in the same process, NVML used before, after the pause and after the resume
(read from a thread that never starts CUDA: tests/gpu/nvml_sampler.py), whether the neighbour's
allocation succeeded, and "R losses equal=1" or the first step that differs.  Ends with
"N passed, N failed" over its checks.  Not run yet on a GPU (written without one)."""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch
except Exception as e:
    print(f"SKIP torch not importable: {e}", flush=True)
    sys.exit(3)
if not torch.cuda.is_available():
    print("SKIP torch.cuda.is_available() is False", flush=True)
    sys.exit(3)

import vmmshim  # noqa: E402
from nvml_sampler import Nvml  # noqa: E402

GiB = 1 << 30
ROUNDS = int(os.environ.get("SLEEP_ROUNDS", "3"))
STEPS = int(os.environ.get("SLEEP_STEPS", "4"))
LAYERS = int(os.environ.get("SLEEP_LAYERS", "16"))
dev = torch.device("cuda")
passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}", flush=True)


class Block(torch.nn.Module):
    def __init__(self, d=2048, heads=16, kv_heads=4, ffn=5632):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.up = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        rep = self.heads // self.kv_heads
        k = k.transpose(1, 2).repeat_interleave(rep, 1)
        v = v.transpose(1, 2).repeat_interleave(rep, 1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        g, u = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(g) * u)


class Llama(torch.nn.Module):
    def __init__(self, layers, vocab=32000, d=2048):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def trainer(seed):
    """Weights untagged; gradients and the optimizer's state under "optim", in a pool of their own."""
    torch.manual_seed(seed)
    model = Llama(LAYERS).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    pool = torch.cuda.MemPool()
    with vmmshim.region("optim"), torch.cuda.use_mem_pool(pool):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for group in opt.param_groups:  # the state AdamW makes at its first step, made here instead
            for p in group["params"]:
                st = opt.state[p]
                st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
    return model, opt, pool


def steps(model, opt, n, gen):
    losses = []
    for _ in range(n):
        ids = torch.randint(0, 32000, (4, 512), device=dev, generator=gen)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def pinned_bandwidth(nbytes):
    """Device-to-host and host-to-device GB/s into pinned memory, the ceiling a kept pause aims at."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    host.copy_(src)
    torch.cuda.synchronize()
    d2h = nbytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    src.copy_(host)
    torch.cuda.synchronize()
    h2d = nbytes / (time.perf_counter() - t) / 1e9
    del src, host
    return d2h, h2d


NEIGHBOUR = r"""
import ctypes, sys
rt = ctypes.CDLL("libcudart.so.13")
p = ctypes.c_void_p()
rc = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(int(sys.argv[1])))
print("neighbour", rc)
"""


def neighbour_gets(nbytes):
    """Another process, not under the shim, allocates nbytes right now: True when cudaMalloc succeeded."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", NEIGHBOUR, str(nbytes)], capture_output=True, text=True, env=env,
                         timeout=120)
    return out.stdout.strip() == "neighbour 0"


def main():
    nvml = Nvml()
    d2h, h2d = pinned_bandwidth(2 * GiB)
    print(f"R pinned d2h={d2h:.1f}GB/s h2d={h2d:.1f}GB/s", flush=True)

    ref_model, ref_opt, _ = trainer(1)
    gen = torch.Generator(device=dev).manual_seed(7)
    reference = steps(ref_model, ref_opt, STEPS * (ROUNDS + 1), gen)
    del ref_model, ref_opt
    torch.cuda.empty_cache()

    model, opt, pool = trainer(1)
    gen = torch.Generator(device=dev).manual_seed(7)
    losses = steps(model, opt, STEPS, gen)
    for r in range(ROUNDS):
        torch.cuda.synchronize()
        before = nvml.used()
        rep = vmmshim.pause("optim")
        after_pause = nvml.used()
        got = neighbour_gets(max(rep.bytes_released - 256 * (1 << 20), 0))
        back = vmmshim.resume("optim")
        after_resume = nvml.used()
        print(f"R trainer round={r} pause_s={rep.seconds:.4f} pause_GBps={rep.bytes_kept / rep.seconds / 1e9:.1f} "
              f"released={rep.bytes_released} kept={rep.bytes_kept} resume_s={back.seconds:.4f} "
              f"resume_GBps={back.bytes_kept / back.seconds / 1e9:.1f} nvml_before={before} "
              f"nvml_paused={after_pause} nvml_resumed={after_resume} neighbour={int(got)} "
              f"not_shim={rep.bytes_not_shim}", flush=True)
        check(rep.bytes_released > 0 and before - after_pause >= rep.bytes_released * 0.9,
              f"round {r}: NVML fell by {before - after_pause} for {rep.bytes_released} released")
        check(got, f"round {r}: the neighbour's cudaMalloc of the released bytes")
        losses += steps(model, opt, STEPS, gen)
    same = losses == reference[:len(losses)]
    first = next((i for i, (a, b) in enumerate(zip(losses, reference)) if a != b), -1)
    print(f"R losses equal={int(same)} first_differing_step={first} steps={len(losses)}", flush=True)
    check(same, f"losses after sleeping equal a run that never slept (first differing step {first})")
    del model, opt, pool
    torch.cuda.empty_cache()

    free, _ = torch.cuda.mem_get_info()
    with vmmshim.region("kv"):
        kv = torch.empty(free // 2, dtype=torch.uint8, device=dev)
    for r in range(ROUNDS):
        torch.cuda.synchronize()
        rep = vmmshim.pause("kv", keep=False)
        back = vmmshim.resume("kv")
        print(f"R kv round={r} bytes={kv.numel()} pause_s={rep.seconds:.4f} resume_s={back.seconds:.4f} "
              f"released={rep.bytes_released}", flush=True)
        check(rep.bytes_kept == 0 and rep.bytes_released >= kv.numel(), f"kv round {r}: {rep}")
    print(f"{passed} passed, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
