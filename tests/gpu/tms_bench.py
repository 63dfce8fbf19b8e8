"""The torch_memory_saver rows of issue 39: one process that sleeps the way SGLang's colocated engine
does, through torch_memory_saver's API only, so the same file runs over the real TMS and over
vmmshim's stand-in (tests/gpu/tms.sh starts both, alternated):

  LD_PRELOAD=$TMS/torch_memory_saver_hook_mode_preload_cu13.abi3.so PYTHONPATH=$TMS python3 tms_bench.py
  vmmshim run --torch-memory-saver -- python3 tms_bench.py

  weights     the sleep table's trainer (llama_train.py, SLEEP_* knobs: TinyLlama's shape), its
              parameters, gradients and fused AdamW state made inside region("weights",
              enable_cpu_backup=True);
  kv_cache    TMS_KV_GB (16) GB made inside region("kv_cache"): discarded at each pause;
  cuda_graph  a greedy decoding step (the model's logits over a TMS_WINDOW (64) token window, the
              argmax of the last), captured with cuda_graph(g, tag="cuda_graph"): its memory sleeps
              too, discarded, and the graph is replayed after each resume.

First a reference: STEPS x (ROUNDS + 1) training steps, each followed by TMS_TOKENS (16) greedy
tokens from the graph, with no pause.  Then the same from the same seed, and after every STEPS
steps a cycle: pause("kv_cache"), pause("weights"), pause("cuda_graph") (SGLang's
release_memory_occupation), NVML, torch.cuda.empty_cache() and NVML again (what a framework does
after TMS), resume in the opposite order.  Losses and tokens must equal the reference's bit for bit.

Prints "R ..." lines (sleep_common.say): R setup, R cycle per round (pause_s and resume_s: the three
calls each, wall clock after a synchronize; nvml_before, nvml_paused, nvml_emptied, nvml_resumed: the
process's own NVML share), R exact (losses, tokens, and a digest of both for comparing processes),
R done.  Exit 0; 1 when losses or tokens differ; 3 when it cannot run here."""
import gc
import hashlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from sleep_common import ROUNDS, STEPS, DeviceView, knob, say  # noqa: E402

KV_GB = knob("TMS_KV_GB", 16.0, float)
WINDOW = knob("TMS_WINDOW", 64)
TOKENS = knob("TMS_TOKENS", 16)
view = DeviceView()

try:
    import torch  # noqa: E402
    from torch_memory_saver import torch_memory_saver as saver  # noqa: E402
except Exception as e:
    print(f"SKIP {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
if not torch.cuda.is_available():
    print("SKIP no CUDA device", flush=True)
    sys.exit(3)
from llama_train import Llama, steps  # noqa: E402

dev = torch.device("cuda")
TAGS = ("kv_cache", "weights", "cuda_graph")


def build(seed):
    torch.manual_seed(seed)
    with saver.region(tag="weights", enable_cpu_backup=True):
        with torch.device(dev):
            model = Llama()
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for p in model.parameters():  # the state fused AdamW makes at its first step, made here
            st = opt.state[p]
            st["step"] = torch.zeros((), dtype=torch.float32, device=dev)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
    with saver.region(tag="kv_cache"):
        kv = torch.zeros(int(KV_GB * (1 << 30)), dtype=torch.uint8, device=dev)
    window = torch.zeros((1, WINDOW), dtype=torch.long, device=dev)

    def decode():
        with torch.no_grad():
            return model(window)[0, -1].argmax()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(graph, tag="cuda_graph"):
        out = decode()
    torch.cuda.synchronize()
    return model, opt, kv, window, graph, out


def generate(window, graph, out, start):
    window.copy_(torch.arange(start, start + WINDOW, device=dev).remainder(1000)[None])
    toks = []
    for _ in range(TOKENS):
        graph.replay()
        toks.append(int(out.item()))
        window.copy_(torch.cat([window[:, 1:], out.view(1, 1)], 1))
    return toks


def timed(fn, *args):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    torch.use_deterministic_algorithms(True, warn_only=True)
    mode = os.environ.get("TMS_BENCH_MODE", "tms")
    say("setup", mode=mode, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default") or "default",
        kv_gb=KV_GB, rounds=ROUNDS, steps=STEPS, device=torch.cuda.get_device_name(0).replace(" ", "_"))
    model, opt, kv, window, graph, out = build(1)
    gen = torch.Generator(device=dev).manual_seed(7)
    ref_losses, ref_tokens = [], []
    for r in range(ROUNDS + 1):
        ref_losses += steps(model, opt, STEPS, gen)
        ref_tokens += generate(window, graph, out, r)
    del model, opt, kv, window, graph, out
    gc.collect()
    torch.cuda.empty_cache()

    model, opt, kv, window, graph, out = build(1)
    gen = torch.Generator(device=dev).manual_seed(7)
    losses = steps(model, opt, STEPS, gen)
    tokens = generate(window, graph, out, 0)
    for r in range(ROUNDS):
        before = view.own()
        pause_s = sum(timed(saver.pause, t) for t in TAGS)
        paused = view.own()
        torch.cuda.empty_cache()
        emptied = view.own()
        resume_s = sum(timed(saver.resume, t) for t in reversed(TAGS))
        resumed = view.own()
        say("cycle", round=r, pause_s=pause_s, resume_s=resume_s, nvml_before=before, nvml_paused=paused,
            nvml_emptied=emptied, nvml_resumed=resumed)
        kv.zero_()  # discarded: a real engine starts its cache afresh
        losses += steps(model, opt, STEPS, gen)
        tokens += generate(window, graph, out, r + 1)
    same_l, same_t = losses == ref_losses, tokens == ref_tokens
    digest = hashlib.sha1(repr((losses, tokens)).encode()).hexdigest()[:16]
    say("exact", losses=int(same_l), tokens=int(same_t), steps=len(losses), n_tokens=len(tokens), digest=digest)
    say("done")
    return 0 if same_l and same_t else 1


if __name__ == "__main__":
    sys.exit(main())
