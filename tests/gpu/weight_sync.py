"""Issue 16's benchmark: a second process takes every parameter of a trainer, zero-copy, three ways,
run by tests/gpu/weight_sync.sh (`make bench-gpu BENCH_ONLY=weightsync`).

  run --part gpt2   a GPT-2 from config (12 layers, width 1024, tied head: 148 parameters, 777 MiB
                    fp32, built here with torch alone) trained under PYTORCH_CUDA_ALLOC_CONF unset,
                    backend:cudaMallocAsync and expandable_segments:True.  Per setting a native
                    trainer and one under the shim; companions take every parameter by
                    (a) reduce_tensor + rebuild (torch.multiprocessing, legacy CUDA IPC: the
                        baseline, from the native trainer; from the shim's trainer too, the
                        companion under the shim, reported only),
                    (b) Registry.open_many(pid, [(address, nbytes)...]) + torch.from_dlpack,
                    (c) Registry.open_tensors(pid) after the trainer's vmmshim.publish_many(
                        model.state_dict()) + torch.from_dlpack,
                    (d) to_torch: (b)'s open_many + vmmshim.to_torch (one DLPack import per
                        stretch of nearby views, each tensor a view of its storage),
                    (e) open_torch: Registry.open_torch(pid), the README's companion: (c)'s names
                        straight to tensors in one call, no Buffer or View made per tensor (the
                        stand-in run, without torch, takes (d)'s path),
                    each in a companion process of its own, the ways' order rotating from round to
                    round; a warm-up round (the owner's first exports: reported as "first"), then
                    ROUNDS rounds.  Every take computes logits with the taken tensors and compares
                    them with the trainer's; then the trainers take an in-place optimizer step and
                    every companion computes them again without importing again.  Each (address,
                    nbytes) is also opened alone once (none may fail, expandable segments too), and
                    (b) is timed under VMMSHIM_IMPORT_THREADS=1,2,4,8 (the default setting only).
  run --part 7b     a 7B-class layout (32 layers x 9 bf16 tensors of Llama-7B's shapes, embedding and
                    head: 291 tensors, 13.5 GB) taken by (a) natively, (b) and (c): time, and the
                    fraction of it in each step (vmm_import_many_last_timing), threads 1,2,4,8.
  run --part first  the first take from a freshly started owner (issue 27): a Llama-shaped 1B-class layout
                    (18 layers of width 2048, GQA, 165 bf16 tensors, 1.76 GiB); every round fresh trainers
                    (native with reduce_tensor, under the shim with publish_many, and under the shim with
                    VMMSHIM_PREEXPORT_MS=-1, reported) and cold companions: each way's first take and a
                    later cold companion's ("steady"), per-round ratios to reduce_tensor's rebuild of the
                    same take, and the owner's export time inside the takes.
  run --part load   8 companions take the whole GPT-2 at the same moment as a step of a trainer under
                    the shim begins (open_torch by name, the README's way; let go): no take may
                    fail; the trainer's step time with them against without, and the broker's
                    latency (a take's wait on the broker) under that load against one companion
                    alone.  Blocks of --steps steps (4 of each kind by turns); in a block every step
                    is drawn at random to be one with takes or one without, and each step with takes
                    is set against the nearest steps without on either side (the machine's step
                    moves between two levels ~10% apart in runs of a few to tens of steps, whatever
                    the companions do; target: the median of those ratios <= 1.02).  Two kinds of
                    block: "with", companions as the library leaves them (what they let go stays
                    mapped in its chunk cache, so a take imports again through the registry without
                    driver calls), and "fresh", each take from nothing (vmmshim.drop_idle after it:
                    every take maps and unmaps the whole model; reported).

Each part prints PASS/FAIL lines, its tables, and "weight-sync PART: N passed, N failed"; raw
results go to OUT_DIR/raw-PART.jsonl, each process's stderr to OUT_DIR/*.log.  --standin runs the
same orchestration without torch and without a GPU: trainers are Python programs under the shim over
the emulated runtime (build/fakecuda, ctypes cudaMalloc), "tensors" are buffers of the same names and
(scaled) shapes, "logits" a fingerprint of their first bytes, and (a) is skipped: a check of the
script itself (tests/python/test_weight_sync.py runs it).

Roles (one process each, JSON lines on stdin/stdout): trainer, companion; run orchestrates them."""
import argparse
import ctypes
import gc
import json
import math
import os
import pathlib
import pickle
import random
import select
import signal
import statistics
import struct
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
WAYS = ("reduce-native", "reduce-shim", "open_many", "open_tensors", "to_torch", "open_torch")
CONFS = ("default", "backend:cudaMallocAsync", "expandable_segments:True")
STEPS = ("python_ns", "find_ns", "context_ns", "connect_ns", "broker_wait_ns", "export_ns", "import_ns",
         "reserve_ns", "map_ns", "access_ns", "release_ns")


def now_ms():
    return time.perf_counter() * 1e3


def reply(**msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------
# Shapes

def gpt2_shapes(scale=1):
    """GPT-2 from config (HF names; nn.Linear weights are (out, in)): 148 parameters, 777 MiB fp32."""
    w, v, p, f = 1024 // scale, 50257 // scale, 1024 // scale, 4096 // scale
    out = [("transformer.wte.weight", (v, w)), ("transformer.wpe.weight", (p, w))]
    for i in range(12):
        h = f"transformer.h.{i}."
        out += [(h + "ln_1.weight", (w,)), (h + "ln_1.bias", (w,)),
                (h + "attn.c_attn.weight", (3 * w, w)), (h + "attn.c_attn.bias", (3 * w,)),
                (h + "attn.c_proj.weight", (w, w)), (h + "attn.c_proj.bias", (w,)),
                (h + "ln_2.weight", (w,)), (h + "ln_2.bias", (w,)),
                (h + "mlp.c_fc.weight", (f, w)), (h + "mlp.c_fc.bias", (f,)),
                (h + "mlp.c_proj.weight", (w, f)), (h + "mlp.c_proj.bias", (w,))]
    return out + [("transformer.ln_f.weight", (w,)), ("transformer.ln_f.bias", (w,))]


def llama7b_shapes(scale=1):
    """Llama-7B's tensors: embedding, 32 layers of 9, final norm, head: 291, 13.5 GB bf16."""
    d, m, v = 4096 // scale, 11008 // scale, 32000 // scale
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(32):
        h = f"model.layers.{i}."
        out += [(h + f"self_attn.{k}_proj.weight", (d, d)) for k in "qkvo"]
        out += [(h + "mlp.gate_proj.weight", (m, d)), (h + "mlp.up_proj.weight", (m, d)),
                (h + "mlp.down_proj.weight", (d, m)),
                (h + "input_layernorm.weight", (d,)), (h + "post_attention_layernorm.weight", (d,))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


def llama1b_shapes(scale=1):
    """A Llama-shaped 1B-class model: 18 layers of width 2048, GQA (16 query heads, 4 key/value heads
    of 128), MLP 5632, vocabulary 32000, head untied: 165 tensors, 1.76 GiB bf16."""
    d, kv, m, v = 2048 // scale, 512 // scale, 5632 // scale, 32000 // scale
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(18):
        h = f"model.layers.{i}."
        out += [(h + "self_attn.q_proj.weight", (d, d)), (h + "self_attn.k_proj.weight", (kv, d)),
                (h + "self_attn.v_proj.weight", (kv, d)), (h + "self_attn.o_proj.weight", (d, d)),
                (h + "mlp.gate_proj.weight", (m, d)), (h + "mlp.up_proj.weight", (m, d)),
                (h + "mlp.down_proj.weight", (d, m)),
                (h + "input_layernorm.weight", (d,)), (h + "post_attention_layernorm.weight", (d,))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


LAYOUTS = {"gpt2": gpt2_shapes, "7b": llama7b_shapes, "llama1b": llama1b_shapes}
N_TENSORS = {"gpt2": 148, "7b": 291, "llama1b": 165}


# ------------------------------------------------------------------------------------------------
# Backends: torch on a GPU, or the stand-in over the emulated runtime

class TorchBackend:
    """The real thing."""

    def __init__(self, scale):
        import torch
        self.torch, self.scale = torch, scale
        self.dev = torch.device("cuda")
        torch.manual_seed(0)
        self.tokens = torch.randint(0, 50257 // scale, (2, 64), device=self.dev,
                                    generator=torch.Generator(device=self.dev).manual_seed(1234))

    def gpt2(self, device):
        """The model: token and position embeddings, 12 blocks (attention, MLP), tied head."""
        torch, s = self.torch, self.scale
        nn, F = torch.nn, torch.nn.functional
        W, V, P, heads = 1024 // s, 50257 // s, 1024 // s, 16

        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_attn, self.c_proj = nn.Linear(W, 3 * W), nn.Linear(W, W)

            def forward(self, x):
                B, T, C = x.shape
                q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.c_fc, self.c_proj = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)

            def forward(self, x):
                return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(W), Attn(), nn.LayerNorm(W), MLP()

            def forward(self, x):
                x = x + self.attn(self.ln_1(x))
                return x + self.mlp(self.ln_2(x))

        class GPT2(nn.Module):
            def __init__(self):
                super().__init__()
                self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, W), wpe=nn.Embedding(P, W),
                                                      h=nn.ModuleList(Block() for _ in range(12)),
                                                      ln_f=nn.LayerNorm(W)))

            def forward(self, idx):
                t = self.transformer
                x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
                for b in t.h:
                    x = b(x)
                return t.ln_f(x) @ t.wte.weight.t()  # the head is the embedding (tied)

        with torch.device(device):
            return GPT2()

    # trainer side
    def make(self, kind):
        torch = self.torch
        if kind == "gpt2":
            self.model = self.gpt2(self.dev)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            return dict(self.model.state_dict())
        self.model = None
        g = torch.Generator(device=self.dev).manual_seed(7)
        return {n: torch.empty(s, dtype=torch.bfloat16, device=self.dev).normal_(generator=g)
                for n, s in LAYOUTS[kind](self.scale)}

    def describe(self, name, t):
        return {"name": name, "address": t.data_ptr(), "nbytes": t.numel() * t.element_size(),
                "shape": list(t.shape), "strides": list(t.stride()), "dtype": str(t.dtype).replace("torch.", "")}

    def fingerprint(self, params, path):
        """What a companion must reproduce: the GPT-2's last-position logits on fixed tokens, or a sum of
        each tensor's first 1024 elements (the layout)."""
        torch = self.torch
        with torch.no_grad():
            if self.model is not None:
                out = self.logits_of(self.model, None)
            else:
                out = torch.stack([t.reshape(-1)[:1024].float().sum() for t in params.values()]).cpu()
        torch.save(out, path)

    def logits_of(self, model, params):
        torch = self.torch
        with torch.no_grad():
            if params is None:
                y = model(self.tokens)
            else:
                y = torch.func.functional_call(model, params, (self.tokens,))
            return y[:, -1, :].float().cpu()

    def step(self):
        """One training step, in place (AdamW's foreach updates keep every parameter where it is)."""
        torch, F = self.torch, self.torch.nn.functional
        V = 50257 // self.scale
        x = torch.randint(0, V, (8, 256), device=self.dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(x).float().view(-1, V), x.view(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def reduce(self, params, path):
        from torch.multiprocessing.reductions import reduce_tensor
        t0 = now_ms()
        out = [(n, *reduce_tensor(t)) for n, t in params.items()]
        with open(path, "wb") as f:
            pickle.dump(out, f)
        return now_ms() - t0

    def sync(self):
        self.torch.cuda.synchronize()

    # companion side
    def skeleton(self, kind):
        return self.gpt2("meta") if kind == "gpt2" else None

    def rebuild(self, path):
        with open(path, "rb") as f:
            reduced = pickle.load(f)
        t0 = now_ms()
        out = {n: fn(*args) for n, fn, args in reduced}
        self.torch.cuda.synchronize()
        return out, now_ms() - t0

    def from_views(self, views):
        return {n: self.torch.from_dlpack(v) for n, v in views.items()}

    def from_views_at_once(self, views):
        import vmmshim
        return vmmshim.to_torch(views)

    def open_torch(self, reg, pid):
        return reg.open_torch(pid, timing=True)

    def compare(self, kind, skel, tensors, path):
        """(max abs difference, scale) of the companion's fingerprint against the trainer's file."""
        torch = self.torch
        want = torch.load(path)
        if kind == "gpt2":
            got = self.logits_of(skel, tensors)
        else:
            with torch.no_grad():
                got = torch.stack([tensors[n].reshape(-1)[:1024].float().sum() for n, _ in
                                   LAYOUTS[kind](self.scale)]).cpu()
        return float((got - want).abs().max()), float(want.abs().max())


class StandinBackend:
    """No torch, no GPU: buffers of the emulated runtime (libcudart.so.13 of build/fakecuda, through
    ctypes, under the shim in a trainer), "tensors" described by __cuda_array_interface__, and a
    fingerprint of the first 16 elements of each.  Device pointers of the emulated driver are host
    addresses, so a companion reads its views with ctypes."""

    TYPESTR = {"float32": "<f4", "float16": "<f2"}

    def __init__(self, scale):
        self.scale = scale
        self.rt = None

    def _runtime(self):
        if self.rt is None:
            rt = ctypes.CDLL("libcudart.so.13")
            rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self.rt = rt
        return self.rt

    class Tensor:
        def __init__(self, ptr, shape, dtype):
            self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype
            self.__cuda_array_interface__ = {"version": 3, "data": (ptr, False), "shape": self.shape,
                                             "typestr": StandinBackend.TYPESTR[dtype], "strides": None}

    def make(self, kind):
        rt = self._runtime()
        self.kind = kind
        dtype = "float32" if kind == "gpt2" else "float16"
        shapes = LAYOUTS[kind](self.scale)
        params = {}
        for i, (name, shape) in enumerate(shapes):
            p = ctypes.c_void_p()
            n = math.prod(shape) * (4 if dtype == "float32" else 2)
            if rt.cudaMalloc(ctypes.byref(p), n):
                raise RuntimeError(f"cudaMalloc({n})")
            head = (ctypes.c_float * 16)(*[float(i * 16 + k) for k in range(16)]) if dtype == "float32" else \
                (ctypes.c_uint16 * 16)(*[(i * 16 + k) & 0x7FFF for k in range(16)])
            rt.cudaMemcpy(p, head, min(64 if dtype == "float32" else 32, n), 1)
            params[name] = self.Tensor(p.value, shape, dtype)
        self.params = params
        return params

    def describe(self, name, t):
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.insert(0, step)
            step *= n
        return {"name": name, "address": t.ptr, "nbytes": math.prod(t.shape) * (4 if t.dtype == "float32" else 2),
                "shape": list(t.shape), "strides": strides, "dtype": t.dtype}

    @staticmethod
    def _head(ptr, dtype):
        if dtype == "float32":
            return list(struct.unpack("<16f", ctypes.string_at(ptr, 64)))
        return list(struct.unpack("<16H", ctypes.string_at(ptr, 32)))

    def fingerprint(self, params, path):
        rt, out = self._runtime(), {}
        for name, t in params.items():
            n = 64 if t.dtype == "float32" else 32
            buf = ctypes.create_string_buffer(n)
            rt.cudaMemcpy(buf, t.ptr, n, 2)
            out[name] = sum(struct.unpack("<16f" if t.dtype == "float32" else "<16H", buf.raw))
        with open(path, "w") as f:
            json.dump(out, f)

    def step(self):
        """In place: the first element of every buffer grows by one."""
        rt = self._runtime()
        time.sleep(0.02)  # stands for the GPU work of a step
        for t in self.params.values():
            if t.dtype != "float32":
                continue
            buf = ctypes.create_string_buffer(4)
            rt.cudaMemcpy(buf, t.ptr, 4, 2)
            v = struct.pack("<f", struct.unpack("<f", buf.raw)[0] + 1.0)
            rt.cudaMemcpy(t.ptr, v, 4, 1)

    def reduce(self, params, path):
        return None  # no torch: no reduce_tensor

    def sync(self):
        pass

    def skeleton(self, kind):
        return None

    def rebuild(self, path):
        raise RuntimeError("reduce_tensor needs torch")

    def from_views(self, views):
        return dict(views)

    def from_views_at_once(self, views):  # no torch: what (b) gives, so the orchestration runs
        return dict(views)

    open_torch = None  # no torch: (d)'s path

    def compare(self, kind, skel, tensors, path):
        with open(path) as f:
            want = json.load(f)
        if set(want) != set(tensors):
            return float("inf"), 1.0
        return (max(abs(sum(self._head(v.ptr, v.dtype)) - want[n]) for n, v in tensors.items()),
                max(abs(w) for w in want.values()))


def backend(args):
    return StandinBackend(args.scale) if args.standin else TorchBackend(args.scale)


# ------------------------------------------------------------------------------------------------
# The trainer: holds the model (or the layout), publishes it, answers commands

def trainer_main(args):
    be = backend(args)
    params = be.make(args.kind)
    work = pathlib.Path(args.work)
    tag = f"{args.name}"
    logits = work / f"{tag}.fp"
    be.fingerprint(params, logits)
    published = False
    if args.publish:
        import vmmshim
        vmmshim.publish_many(params)
        published = True
    reduce_ms = None
    reduce_path = None
    if args.reduce:
        reduce_path = work / f"{tag}.reduce"
        try:
            reduce_ms = be.reduce(params, reduce_path)
        except Exception as e:  # e.g. legacy IPC under an allocator that offers none
            reduce_ms, reduce_path = f"{type(e).__name__}: {e}", None
        if reduce_ms is None:
            reduce_path = None
    be.sync()
    reply(ready=True, pid=os.getpid(), params=[be.describe(n, t) for n, t in params.items()], fp=str(logits),
          reduce=str(reduce_path) if reduce_path else None, reduce_ms=reduce_ms, published=published,
          nbytes=sum(be.describe(n, t)["nbytes"] for n, t in params.items()))
    n_fp = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "step":
                t0 = now_ms()
                be.step()
                ms = now_ms() - t0
                n_fp += 1
                path = work / f"{tag}.fp{n_fp}"
                be.fingerprint(params, path)
                reply(step_ms=ms, fp=str(path))
            elif cmd["cmd"] == "train":
                times = []
                for k in range(cmd["n"]):
                    t0 = now_ms()
                    be.step()
                    times.append(now_ms() - t0)
                    if cmd.get("notify"):
                        reply(stepdone=k, ms=times[-1])
                reply(trained=len(times), ms=times)
            else:
                reply(error=f"unknown command {cmd['cmd']}")
        except Exception as e:
            reply(error=f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------------
# A companion: takes every parameter one way, checks what it took

def take(be, reg, way, cmd):
    """Every tensor, one way: ({name: tensor}, the library's timing or None).  A function of its own
    so that nothing but the tensors outlives it (a Buffer or View left in a local would keep its
    import, and the next take would find it mapped)."""
    if way.startswith("reduce"):
        return be.rebuild(cmd["reduce"])[0], None
    if way == "open_torch" and be.open_torch:
        return be.open_torch(reg, cmd["pid"])
    if way in ("open_many", "to_torch", "open_torch"):
        params = cmd["params"]
        bufs, timing = reg.open_many(cmd["pid"], [(p["address"], p["nbytes"]) for p in params], timing=True)
        views = {p["name"]: b.view(tuple(p["shape"]), p["dtype"], 0, tuple(p["strides"])) for p, b in zip(params, bufs)}
        for b in bufs:
            b.close()  # the views hold the imports
        if way in ("to_torch", "open_torch"):
            return be.from_views_at_once(views), timing
    else:
        views, timing = reg.open_tensors(cmd["pid"], timing=True)
    return be.from_views(views), timing


def companion_main(args):
    be = backend(args)
    vm = None
    if args.way != "reduce-native" and args.way != "reduce-shim":
        import vmmshim
        vm = vmmshim
    skel = be.skeleton(args.kind)
    held = {}
    reg = vm.Registry() if vm else None
    if not args.standin:
        import torch
        torch.zeros(1, device="cuda")  # CUDA started before anything is timed
    reply(ready=True, pid=os.getpid())
    last = {}  # the last take's pid and params: a "cycle" (the load part) names none, staying small
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] in ("take", "cycle"):
                for k in ("pid", "params", "reduce"):
                    if k in cmd:
                        last[k] = cmd[k]
                cmd = dict(last, **cmd)
                if "threads" in cmd:
                    os.environ["VMMSHIM_IMPORT_THREADS"] = str(cmd["threads"])
                else:
                    os.environ.pop("VMMSHIM_IMPORT_THREADS", None)
                held = {}
                gc.collect()
                t0 = now_ms()
                held, timing = take(be, reg, args.way, cmd)
                be.sync()
                ms = now_ms() - t0
                out = {"ms": ms, "n": len(held)}
                if timing:
                    out["timing"] = timing
                    out["import_ms"] = timing["total_ns"] / 1e6
                if cmd["cmd"] == "take" and cmd.get("fp"):
                    diff, scale = be.compare(args.kind, skel, held, cmd["fp"])
                    out["diff"], out["scale"] = diff, scale
                if cmd["cmd"] == "cycle":  # the load part: take, then let go at once
                    held = {}
                    gc.collect()
                    if vm and cmd.get("fresh", True):
                        vm.drop_idle()
                reply(**out)
            elif cmd["cmd"] == "check":  # the held tensors again, after the trainer stepped in place
                diff, scale = be.compare(args.kind, skel, held, cmd["fp"])
                before, _ = be.compare(args.kind, skel, held, cmd["before"])
                reply(diff=diff, scale=scale, changed=before > 0)
            elif cmd["cmd"] == "drop":
                held = {}
                gc.collect()
                if vm:
                    vm.drop_idle()  # the next take imports afresh, as a new companion would
                reply(dropped=True)
            elif cmd["cmd"] == "probe":  # each (address, nbytes) alone: how many fail
                failed, why = 0, []
                for p in cmd["params"]:
                    try:
                        reg.open(cmd["pid"], p["address"], p["nbytes"]).close()
                    except Exception as e:
                        failed += 1
                        if len(why) < 3:
                            why.append(f"{p['name']}: {e}")
                vm.drop_idle()
                reply(failed=failed, of=len(cmd["params"]), why=why)
            else:
                reply(error=f"unknown command {cmd['cmd']}")
        except Exception as e:
            held = {}
            reply(error=f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------------
# The orchestrator

class Proc:
    """A role in a process of its own, JSON lines both ways; its stderr goes to a log."""

    def __init__(self, name, argv, env, log):
        self.name = name
        self.err = open(log, "ab")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env)
        self.buf = b""
        self.log = log

    def send(self, **msg):
        self.p.stdin.write((json.dumps(msg) + "\n").encode())
        self.p.stdin.flush()

    def line_ready(self):
        return b"\n" in self.buf

    def fill(self, timeout):
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            return False
        chunk = os.read(self.p.stdout.fileno(), 1 << 20)
        if not chunk:
            raise RuntimeError(f"{self.name} exited (rc {self.p.poll()}); see {self.log}")
        self.buf += chunk
        return True

    def recv(self, timeout=300):
        end = time.monotonic() + timeout
        while not self.line_ready():
            left = end - time.monotonic()
            if left <= 0 or not self.fill(left):
                raise RuntimeError(f"{self.name}: no answer within {timeout} s; see {self.log}")
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg

    def ask(self, timeout=300, **msg):
        self.send(**msg)
        return self.recv(timeout)

    def close(self):
        try:
            self.send(cmd="quit")
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
            self.p.wait()
        self.err.close()


class Run:
    def __init__(self, args):
        self.args = args
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = self.out / "work"
        self.work.mkdir(exist_ok=True)
        self.build = pathlib.Path(args.build).resolve()
        self.raw = open(self.out / f"raw-{args.part}.jsonl", "a")
        self.passed = self.failed = 0
        self.deadline = time.monotonic() + args.budget
        self.procs = []
        self.n = 0

    def check(self, ok, what):
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1

    def target(self, ok, what):
        """A speed criterion: counted on a GPU; a stand-in run measures nothing real, and says so."""
        if self.args.standin:
            print(f"REPORT (stand-in, not counted) {'met' if ok else 'missed'}: {what}", flush=True)
        else:
            self.check(ok, what)

    def record(self, **row):
        self.raw.write(json.dumps(row) + "\n")
        self.raw.flush()

    def left(self):
        return self.deadline - time.monotonic()

    def env(self, shim, conf, registry):
        e = dict(os.environ)
        e.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf != "default":
            e["PYTORCH_CUDA_ALLOC_CONF"] = conf
        e["VMMSHIM_REGISTRY"] = registry
        e["VMMSHIM_CLIENT_LIB"] = str(self.build / "libvmmshim-client.so")
        e["PYTHONPATH"] = str(ROOT / "tools" / "python") + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        e["PYTHONDONTWRITEBYTECODE"] = "1"
        # whatever is preloaded already stays first (a sanitizer's runtime, in the tests)
        base = os.environ.get("LD_PRELOAD", "")
        e["LD_PRELOAD"] = " ".join(x for x in (base, str(self.build / "libvmmshim.so") if shim else "") if x)
        if not e["LD_PRELOAD"]:
            del e["LD_PRELOAD"]
        if self.args.standin:
            fake = str(self.build / "fakecuda")
            e["LD_LIBRARY_PATH"] = fake + (":" + e["LD_LIBRARY_PATH"] if e.get("LD_LIBRARY_PATH") else "")
        return e

    def spawn(self, role, name, shim, conf, registry, *extra, env_add=None):
        self.n += 1
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()), role, "--name", name, "--work", str(self.work),
                "--scale", str(self.args.scale), *(["--standin"] if self.args.standin else []), *extra]
        p = Proc(name, argv, dict(self.env(shim, conf, registry), **(env_add or {})), self.out / f"{name}.log")
        self.procs.append(p)
        return p

    def close_all(self):
        for p in self.procs:
            p.close()
        self.procs = []

    def registry(self, tag):
        return f"/vmmshim-ws-{os.getpid()}-{tag}"

    def unlink(self, name):
        try:
            os.unlink("/dev/shm" + name)
        except FileNotFoundError:
            pass


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def paired_ratios(labels, ms, kind, reach=3):
    """Each `kind` step's time over the geometric mean of the nearest "without" steps before and after
    it, at most `reach` steps away (one side where the other has none): the machine's step moves
    between two levels ~10% apart in runs of a few to tens of steps, whatever the companions do, and
    a neighbour is nearly always at the same level, where a median over many steps is not."""
    out = []
    for i, lab in enumerate(labels):
        if lab != kind:
            continue
        before = next((ms[j] for j in range(i - 1, max(i - reach, 0) - 1, -1) if labels[j] == "without"), None)
        after = next((ms[j] for j in range(i + 1, min(i + reach + 1, len(ms))) if labels[j] == "without"), None)
        sides = [m for m in (before, after) if m]
        if sides:
            out.append(ms[i] / math.prod(sides) ** (1 / len(sides)))
    return out


def spread(xs):
    return f"{min(xs):.2f}–{max(xs):.2f}" if xs else "n/a"


def fmt(x, unit="ms"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f} {unit}"


def steps_of(timing, total_ns):
    """A take's time by step, in ns, each step once (the broker's wait less the owner's export)."""
    out = {k: timing.get(k, 0) for k in ("python_ns", "find_ns", "context_ns", "connect_ns", "export_ns",
                                         "import_ns", "reserve_ns", "map_ns", "access_ns", "release_ns")}
    out["broker_wait_ns"] = max(timing.get("broker_ns", 0) - timing.get("export_ns", 0), 0)
    out["other_ns"] = max(total_ns - sum(out.values()), 0)
    return out


def fractions_table(title, rows):
    """rows: {label: [timing dicts]}: the median share of each step of a take."""
    print(f"\n{title}")
    cols = list(STEPS) + ["other_ns"]
    print("| way | take (median) | " + " | ".join(c[:-3] for c in cols) + " | driver calls |")
    print("|---|---|" + "---|" * len(cols) + "---|")
    for label, timings in rows.items():
        if not timings:
            continue
        totals = [t["total_ns"] for t in timings]
        shares = {c: median([steps_of(t, t["total_ns"])[c] / max(t["total_ns"], 1) for t in timings]) for c in cols}
        t = timings[-1]
        calls = (f"{t['requests']} req, {t['messages']} msg, {t['handles']} handles, "
                 f"{t['handles'] - t.get('shared', 0)} import, {t['reserves']} reserve, "
                 f"{t['maps']} map, {t['access_calls']} SetAccess, {t['threads']} thr")
        print(f"| {label} | {median(totals) / 1e6:.2f} ms | " + " | ".join(f"{100 * shares[c]:.0f}%" for c in cols) +
              f" | {calls} |")


def take_row(run, label, ms_list, first, base_list):
    ratios = [a / b for a, b in zip(ms_list, base_list) if b] if base_list else []
    med = median(ms_list)
    print(f"| {label} | {fmt(first)} | {fmt(med)} | {spread(ms_list)} | "
          f"{(f'{median(ratios):.2f}x' if ratios else 'n/a')} | {spread(ratios) if ratios else 'n/a'} |")
    return med, median(ratios) if ratios else None


# ---- part gpt2 / 7b ------------------------------------------------------------------------------

def part_takes(run, kind):
    args = run.args
    confs = [c for c in args.confs.split(",") if c] if kind == "gpt2" else ["default"]
    rounds = args.rounds
    summary = []
    for conf in confs:
        if run.left() < (10 if args.standin else 60 if kind == "gpt2" else 100):
            print(f"== {kind} {conf}: skipped, {run.left():.0f} s of the budget left")
            run.record(part=kind, conf=conf, skipped="budget")
            continue
        print(f"== {kind}, PYTORCH_CUDA_ALLOC_CONF={'' if conf == 'default' else conf} ({'stand-in' if args.standin else 'GPU'})",
              flush=True)
        reg = run.registry(f"{kind}-{conf.split(':')[0]}")
        tag = f"{kind}-{conf.replace(':', '-')}"
        t_start = time.monotonic()
        try:
            ways = [w for w in WAYS if not (args.standin and w.startswith("reduce"))]
            native = run.spawn("trainer", f"{tag}-trainer-native", False, conf, reg + "-native", "--kind", kind,
                               *(["--reduce"] if "reduce-native" in ways else []))
            shim = run.spawn("trainer", f"{tag}-trainer-shim", True, conf, reg, "--kind", kind, "--publish",
                             *(["--reduce"] if "reduce-shim" in ways else []))
            tn, ts = native.recv(600), shim.recv(600)
            print(f"trainers: native pid {tn['pid']}, shim pid {ts['pid']}: {len(ts['params'])} tensors, "
                  f"{ts['nbytes'] / 2**20:.0f} MiB; reduce_tensor of all: native {tn['reduce_ms']}, shim "
                  f"{ts['reduce_ms']} ms", flush=True)
            run.check(len(ts["params"]) == N_TENSORS[kind] and ts["published"],
                      f"{tag}: the trainer under the shim has {len(ts['params'])} tensors, published")
            base_conf = conf
            if "reduce-native" in ways and not tn["reduce"] and conf != "default":
                # PyTorch cannot share this allocator's memory: the baseline is a native trainer under
                # the default setting, taken in the same rounds, so that a drift of the machine
                # between parts is not counted against either side
                print(f"note: {tag}: reduce_tensor failed natively: {tn['reduce_ms']}; the baseline is a native "
                      f"trainer under the default setting, taken in the same rounds")
                native = run.spawn("trainer", f"{tag}-trainer-native-default", False, "default", reg + "-native",
                                   "--kind", kind, "--reduce")
                tn, base_conf = native.recv(600), "default"
            comps = {}
            for w in ways:
                if w == "reduce-native" and not tn["reduce"]:
                    print(f"note: {tag}: reduce_tensor failed natively: {tn['reduce_ms']}")
                    continue
                if w == "reduce-shim" and not ts["reduce"]:
                    print(f"note: {tag}: reduce_tensor failed under the shim: {ts['reduce_ms']} (reported only)")
                    continue
                comps[w] = run.spawn("companion", f"{tag}-{w}", w == "reduce-shim", base_conf if w == "reduce-native" else conf,
                                     reg + ("-native" if w == "reduce-native" else ""), "--kind", kind, "--way", w)
            for c in comps.values():
                c.recv(300)
            src = {w: (tn if w == "reduce-native" else ts) for w in comps}
            fp = {"native": tn["fp"], "shim": ts["fp"]}
            res = {w: [] for w in comps}
            timings = {w: [] for w in comps}
            first = {}
            order = list(comps)
            for r in range(rounds + 1):  # round 0: the owner's first exports, reported as "first"
                if run.left() < 30:
                    print(f"note: {tag}: stopped after round {r - 1}: the budget is spent")
                    break
                rot = order[r % len(order):] + order[:r % len(order)]
                for w in rot:
                    t = src[w]
                    side = "native" if w == "reduce-native" else "shim"
                    try:
                        a = comps[w].ask(pid=t["pid"], cmd="take", params=t["params"], reduce=t["reduce"], fp=fp[side])
                    except RuntimeError as e:
                        run.check(False, f"{tag} round {r} {w}: {e}")
                        continue
                    ok = a["diff"] <= 1e-3 * max(a["scale"], 1.0)
                    run.record(part=kind, conf=conf, round=r, way=w, **{k: v for k, v in a.items()})
                    if not ok or r == 0:
                        how = "exact" if a["diff"] == 0 else f"within {a['diff']:.3g}"
                        run.check(ok, f"{tag} round {r} {w}: {a['n']} tensors in {a['ms']:.2f} ms, fingerprint {how} "
                                      f"of the trainer's")
                    if r == 0:
                        first[w] = a["ms"]
                    else:
                        res[w].append(a["ms"])
                        if "timing" in a:
                            timings[w].append(dict(a["timing"], total_ns=a["ms"] * 1e6))
                # an in-place optimizer step in both trainers; every companion looks again without importing
                if kind == "gpt2":
                    sn, ss = native.ask(cmd="step"), shim.ask(cmd="step")
                    for w in rot:
                        side_new, side_old = (sn["fp"], fp["native"]) if w == "reduce-native" else (ss["fp"], fp["shim"])
                        try:
                            a = comps[w].ask(cmd="check", fp=side_new, before=side_old)
                        except RuntimeError as e:
                            run.check(False, f"{tag} round {r} {w} after a step: {e}")
                            continue
                        ok = a["diff"] <= 1e-3 * max(a["scale"], 1.0) and a["changed"]
                        if not ok or r == 0:
                            run.check(ok, f"{tag} round {r} {w}: after an in-place optimizer step, not imported again: "
                                          f"{'the new' if a['changed'] else 'NOT the new'} fingerprint, within "
                                          f"{a['diff']:.3g}")
                    fp = {"native": sn["fp"], "shim": ss["fp"]}
                for w in rot:
                    comps[w].ask(cmd="drop")
            # each tensor alone: none may fail (expandable segments' tensors span pages)
            probe_c = comps.get("open_many")
            if probe_c:
                pr = probe_c.ask(cmd="probe", pid=ts["pid"], params=ts["params"])
                run.check(pr["failed"] == 0, f"{tag}: each tensor opened alone: {pr['failed']} of {pr['of']} fail"
                                             + (f" ({'; '.join(pr['why'])})" if pr["why"] else ""))
            # threads (default setting only): VMMSHIM_IMPORT_THREADS for open_many
            sweep = {}
            if probe_c and conf == "default" and args.threads:
                for th in [int(x) for x in args.threads.split(",")]:
                    ms = []
                    for _ in range(3):
                        a = probe_c.ask(cmd="take", pid=ts["pid"], params=ts["params"], fp=None, threads=th)
                        ms.append(a["import_ms"])
                        probe_c.ask(cmd="drop")
                    sweep[th] = median(ms)
                    run.record(part=kind, conf=conf, threads=th, import_ms=ms)
            # the table
            print(f"\n{tag}: taking all {len(ts['params'])} tensors ({rounds} rounds after a first; ratio: per round "
                  f"against reduce_tensor's rebuild in the native trainer's companion"
                  f"{'' if base_conf == conf else ', the trainer under the default setting'})")
            print(f"| way | round 0 (the owner exports each handle once: {order[0]} paid, with its companion's first "
                  f"take) | median | spread | vs reduce_tensor native | ratio spread |")
            print("|---|---|---|---|---|---|")
            base = res.get("reduce-native", [])
            meds = {}
            for w in comps:
                meds[w] = take_row(run, w, res[w], first.get(w), base if w != "reduce-native" else [])
            if sweep:
                best = min(sweep, key=sweep.get)
                print("VMMSHIM_IMPORT_THREADS (open_many's import call, median of 3): " +
                      ", ".join(f"{k}: {v:.2f} ms" for k, v in sweep.items()) + f"; fastest: {best}")
            fractions_table(f"{tag}: where a take's time went (median shares; python = outside the C library, "
                            f"other = tensors and views)",
                            {w: timings[w] for w in ("open_many", "open_tensors", "to_torch", "open_torch") if w in timings})
            for w in ("open_many", "open_tensors", "to_torch", "open_torch"):
                if w in meds and meds[w][1] is not None:
                    run.target(meds[w][1] <= 1.0, f"{tag}: {w} median {meds[w][0]:.2f} ms against reduce_tensor "
                                                   f"{median(base):.2f} ms"
                                                   f"{'' if base_conf == conf else ' (default setting, same rounds)'}: "
                                                   f"{meds[w][1]:.2f}x (target <= 1.00x)")
            summary.append((tag, {w: meds[w][0] for w in meds}))
        except RuntimeError as e:
            run.check(False, f"{tag}: {e}")
        finally:
            run.close_all()
            run.unlink(reg)
            run.unlink(reg + "-native")
            print(f"({tag}: {time.monotonic() - t_start:.0f} s)", flush=True)
    return summary


# ---- part first ----------------------------------------------------------------------------------

def part_first(run):
    """The first take from a freshly started owner against later ones (issue 27), under each allocator
    setting of --confs (issue 38), the budget left shared between them: every round starts its own
    trainers (native, reduce_tensor: under the default setting where the setting is
    backend:cudaMallocAsync, which PyTorch cannot share; under the shim, publish_many; under the shim
    with VMMSHIM_PREEXPORT_MS=-1, reported only) holding the Llama-shaped 1B-class layout, then cold
    companions (a process each, CUDA started, nothing taken yet), once the trainers are up as a
    rollout process would start: "first" is each way's first take from its fresh owner, "steady" a
    second cold companion's take after it.  Ratios round by round against reduce_tensor's rebuild of
    the same take in the same round."""
    confs = [c for c in run.args.confs.split(",") if c]
    for i, conf in enumerate(confs):
        first_setting(run, conf, i, run.left() / (len(confs) - i))


def first_setting(run, conf, index, share):
    """part first under one allocator setting, in about `share` seconds."""
    args = run.args
    kind, rounds = "llama1b", args.rounds
    reg = run.registry(f"first{index}")
    base_conf = "default" if "cudaMallocAsync" in conf else conf
    P = "first" if conf == "default" else f"first [{conf}]"
    t_start = time.monotonic()
    ways = ["open_torch"] if args.standin else ["reduce-native", "open_torch"]
    res = {(k, w): [] for k in ("first", "steady") for w in ways}
    off_first, exports, gaps = [], {"first": [], "steady": [], "off": []}, []
    timings = {"first": [], "steady": [], "off": []}
    print(f"== {P}: the {kind} layout ({'stand-in' if args.standin else 'GPU'}), {rounds} rounds, fresh owners each",
          flush=True)
    try:
        for r in range(rounds):
            if run.left() < (10 if args.standin else 45) or (r and time.monotonic() - t_start > share):
                print(f"note: {P}: stopped after round {r - 1}: the budget is spent")
                break
            tag = f"first{index}-r{r}"
            owners = {"open_torch": run.spawn("trainer", f"{tag}-trainer-shim", True, conf, reg, "--kind", kind,
                                              "--publish"),
                      "off": run.spawn("trainer", f"{tag}-trainer-shim-off", True, conf, reg, "--kind", kind,
                                       "--publish", env_add={"VMMSHIM_PREEXPORT_MS": "-1"})}
            if "reduce-native" in ways:
                owners["reduce-native"] = run.spawn("trainer", f"{tag}-trainer-native", False, base_conf,
                                                    reg + "-native", "--kind", kind, "--reduce")
            up = {k: p.recv(600) for k, p in owners.items()}
            t_up = time.monotonic()
            for k in ("open_torch", "off"):
                run.check(len(up[k]["params"]) == N_TENSORS[kind] and up[k]["published"],
                          f"{tag}: the trainer under the shim ({k}) has {len(up[k]['params'])} tensors, published")
            if "reduce-native" in up and not up["reduce-native"]["reduce"]:
                raise RuntimeError(f"reduce_tensor failed natively: {up['reduce-native']['reduce_ms']}")
            comps = {}
            for k in ("first", "steady"):
                for w in ways:
                    comps[(k, w)] = run.spawn("companion", f"{tag}-{k}-{w}", False, base_conf,
                                              reg + ("-native" if w == "reduce-native" else ""), "--kind", kind,
                                              "--way", w)
            comps[("first", "off")] = run.spawn("companion", f"{tag}-first-off", False, base_conf, reg, "--kind", kind,
                                                "--way", "open_torch")
            for c in comps.values():
                c.recv(300)
            gaps.append((time.monotonic() - t_up) * 1e3)
            order = ways[r % len(ways):] + ways[:r % len(ways)]
            for k in ("first", "steady"):
                for w in order + (["off"] if k == "first" else []):
                    t = up[w]
                    a = comps[(k, w)].ask(pid=t["pid"], cmd="take", params=t["params"], reduce=t["reduce"], fp=t["fp"])
                    ok = a["diff"] <= 1e-3 * max(a["scale"], 1.0) and a["n"] == N_TENSORS[kind]
                    run.record(part="first", conf=conf, round=r, take=k, way=w, **a)
                    if not ok or r == 0:
                        how = "exact" if a["diff"] == 0 else f"within {a['diff']:.3g}"
                        run.check(ok, f"{tag} {k} {w}: {a['n']} tensors in {a['ms']:.2f} ms, fingerprint {how} of the "
                                      f"trainer's")
                    if "timing" in a:
                        exports["off" if w == "off" else k].append(a["timing"].get("export_ns", 0) / 1e6)
                        timings["off" if w == "off" else k].append(dict(a["timing"], take_ms=a["ms"]))
                    if w == "off":
                        off_first.append(a["ms"])
                    else:
                        res[(k, w)].append(a["ms"])
            run.close_all()
        # the table
        print(f"\n{P}: taking all {N_TENSORS[kind]} tensors of the {kind} layout from a freshly started owner, "
              f"each take in a cold companion; ratio per round against reduce_tensor's rebuild of the same take "
              f"(companions up {median(gaps):.0f} ms, median, after the owners"
              f"{'' if base_conf == conf else '; reduce_tensor from a trainer under the default setting'})")
        print("| take | open_torch (median) | spread | owner's export in it (median) | reduce_tensor rebuild | "
              "vs reduce_tensor | ratio spread |")
        print("|---|---|---|---|---|---|---|")
        meds = {}
        for k, label in (("first", "first take, fresh owner"), ("steady", "steady (a later cold companion)")):
            ms, base = res[(k, "open_torch")], res.get((k, "reduce-native"), [])
            ratios = [x / y for x, y in zip(ms, base) if y]
            meds[k] = (median(ms), median(ratios) if ratios else None)
            print(f"| {label} | {fmt(median(ms))} | {spread(ms)} | {fmt(median(exports[k]))} | {fmt(median(base))} | "
                  f"{f'{median(ratios):.2f}x' if ratios else 'n/a'} | {spread(ratios) if ratios else 'n/a'} |")
        print(f"| first take, VMMSHIM_PREEXPORT_MS=-1 (reported) | {fmt(median(off_first))} | {spread(off_first)} | "
              f"{fmt(median(exports['off']))} | | | |")
        fractions_table(f"{P}: where open_torch's time went (median shares of its own total; python = outside the C "
                        "library, names = reading the published names)",
                        {"first take": timings["first"], "steady": timings["steady"],
                         "first, VMMSHIM_PREEXPORT_MS=-1": timings["off"]})
        for k, ts in timings.items():
            if ts:
                print(f"report: {P}: {k}: the harness's take {median([t['take_ms'] for t in ts]):.2f} ms, open_torch's own "
                      f"total {median([t['total_ns'] for t in ts]) / 1e6:.2f} ms, names {median([t.get('names_ns', 0) for t in ts]) / 1e6:.2f} ms"
                      + "".join(f", {step} {median([t.get(step + '_ns', 0) for t in ts]) / 1e6:.2f} ms"
                                for step in ("before", "find", "broker", "import", "access", "build", "end")))
        if exports["first"] and exports["off"]:
            run.check(median(exports["first"]) <= 0.25 * median(exports["off"]),
                      f"{P}: the owner's exports in a first take {median(exports['first']):.2f} ms (median) with "
                      f"pre-export, {median(exports['off']):.2f} ms without: exported before the take")
        for k in ("first", "steady"):
            if meds[k][1] is not None:
                run.target(meds[k][1] <= 1.0, f"{P}: {k} take {meds[k][0]:.2f} ms against reduce_tensor's rebuild in "
                                              f"the same rounds: {meds[k][1]:.2f}x (target <= 1.00x)")
        if res[("steady", "open_torch")]:
            print(f"report: {P}: the first take over the steady one {meds['first'][0] / meds['steady'][0]:.2f}x; "
                  f"without pre-export {median(off_first) / meds['steady'][0]:.2f}x")
    except RuntimeError as e:
        run.check(False, f"{P}: {e}")
    finally:
        run.close_all()
        run.unlink(reg)
        run.unlink(reg + "-native")
        print(f"({P}: {time.monotonic() - t_start:.0f} s)", flush=True)


# ---- part load -----------------------------------------------------------------------------------

def part_load(run):
    args = run.args
    reg = run.registry("load")
    t_start = time.monotonic()
    try:
        tr = run.spawn("trainer", "load-trainer", True, "default", reg, "--kind", "gpt2", "--publish")
        t = tr.recv(600)
        comps = [run.spawn("companion", f"load-companion-{i}", False, "default", reg, "--kind", "gpt2", "--way",
                           "open_torch") for i in range(args.companions)]
        for c in comps:
            c.recv(300)
        # every companion takes once (and learns the parameters: a cycle after a step names none, so the
        # eight messages after each step stay small); then one alone, the trainer idle: the broker's
        # latency without load
        for c in comps:
            c.ask(cmd="cycle", pid=t["pid"], params=t["params"])
        alone = []
        for _ in range(args.load_alone):
            a = comps[0].ask(cmd="cycle")
            alone.append(a["timing"]["broker_ns"] / 1e6)
        tr.ask(cmd="train", n=3)  # warm-up (AdamW's state, cuBLAS)
        # Blocks of steps, "with" and "fresh" by turns; inside a block each step is drawn at random to
        # be one during which the 8 companions take the model (sent the moment the step before it
        # ends) or one without: a drift of the machine falls on both alike.  A "fresh" take lets go
        # of everything (drop_idle), so the two kinds cannot share a block.
        rng = random.Random(16)
        steps = {"without": [], "with": [], "fresh": []}
        take_ms = {"with": [], "fresh": []}
        paired = {"with": [], "fresh": []}
        per_block = []  # (kind, its taking steps' median over its steps without's)
        under = []
        failures = takes = asked = 0
        for kind in ["with", "fresh"] * args.load_blocks:
            if run.left() < 20:
                print("note: load: stopped early: the budget is spent")
                break
            n = args.steps
            # the first steps settle the clocks; a "with" block's first taking step maps afresh (the
            # block before let go of everything), and is not counted either
            labels = ["without"] * 2 + [kind if rng.random() < 0.5 else "without" for _ in range(n - 2)]
            tr.send(cmd="train", n=n, notify=True)
            take = dict(cmd="cycle", fresh=kind == "fresh")
            outstanding = {c: 0 for c in comps}
            done = None
            while done is None or any(outstanding.values()):
                ready = [p for p in [tr] + comps if p.line_ready()]
                if not ready:
                    r, _, _ = select.select([p.p.stdout for p in [tr] + comps], [], [], 120)
                    if not r:
                        raise RuntimeError("load: nothing answered for 120 s")
                    for p in [tr] + comps:
                        if p.p.stdout in r:
                            p.fill(0)
                    continue
                for p in ready:
                    if p is tr:
                        m = tr.recv()
                        if "stepdone" in m:
                            if m["stepdone"] + 1 < n and labels[m["stepdone"] + 1] == kind:
                                for c in comps:  # all at the same moment, as the next step starts
                                    c.send(**take)
                                    outstanding[c] += 1
                                    asked += 1
                        elif "trained" in m:
                            done = m["ms"]
                    else:
                        outstanding[p] -= 1
                        takes += 1
                        try:
                            a = p.recv()
                            broker_ms = a["timing"]["broker_ns"] / 1e6
                            if kind == "fresh":  # a take that the chunk cache serves asks no broker
                                under.append(broker_ms)
                            take_ms[kind].append(a["ms"])
                            run.record(part="load", block=kind, take_ms=a["ms"], broker_ms=broker_ms)
                        except RuntimeError as e:
                            failures += 1
                            print(f"take failed: {e}")
            if kind == "with" and kind in labels:
                labels[labels.index(kind)] = "warm-up"
            for lab, ms in zip(labels[2:], done[2:]):
                if lab in steps:
                    steps[lab].append(ms)
            paired[kind] += paired_ratios(labels, done, kind)
            mine = [[m for lab, m in zip(labels[2:], done[2:]) if lab == k] for k in (kind, "without")]
            if all(mine):
                per_block.append((kind, median(mine[0]) / median(mine[1])))
            run.record(part="load", block=kind, labels=labels, step_ms=done)
        run.check(failures == 0 and takes == asked and asked > 0,
                  f"load: {takes} takes by {len(comps)} companions, each as a step began ({asked} asked for), "
                  f"{failures} failed")
        so, sw, sf = (median(steps[k]) if steps[k] else float("nan") for k in ("without", "with", "fresh"))
        ratio, fresh = (median(paired[k]) if paired[k] else float("nan") for k in ("with", "fresh"))
        q = {k: statistics.quantiles(v, n=4) if len(v) >= 4 else [float("nan")] * 3 for k, v in paired.items()}
        print(f"\nload: the trainer's step, {len(steps['without'])} steps without companions, {len(steps['with'])} with "
              f"{len(comps)} taking the model as they began (take median "
              f"{median(take_ms['with']) if take_ms['with'] else 0:.2f} ms, the chunk cache as the library keeps it) and "
              f"{len(steps['fresh'])} with each take from nothing (take median "
              f"{median(take_ms['fresh']) if take_ms['fresh'] else 0:.2f} ms, mapped and unmapped every time), drawn at "
              f"random step by step; medians {so:.2f}, {sw:.2f} ({sw / so:.3f}x) and {sf:.2f} ms ({sf / so:.3f}x)")
        print(f"load: each step with companions against the nearest steps without on either side: with median "
              f"{ratio:.3f} (quartiles {q['with'][0]:.3f}-{q['with'][2]:.3f}, {len(paired['with'])} steps); fresh "
              f"median {fresh:.3f} (quartiles {q['fresh'][0]:.3f}-{q['fresh'][2]:.3f}, {len(paired['fresh'])} steps)")
        print("load: block by block, its steps with takes (median) over its steps without: " +
              " ".join(f"{k} {r:.3f}" for k, r in per_block))
        run.target(ratio <= 1.02, f"load: step time with {len(comps)} companions taking {ratio:.3f}x without (median of "
                                  f"{len(paired['with'])} steps, each against its neighbours without; target <= 1.02)")
        print(f"report: load: step time with {len(comps)} companions taking from nothing {fresh:.3f}x without "
              f"(each take rewrites the GPU's page tables for the whole model twice)")
        if alone and under:
            q = statistics.quantiles(under, n=10) if len(under) >= 10 else [max(under)] * 9
            print(f"load: the broker's latency (a fresh take's wait on it, v3 round trip): alone median {median(alone):.2f} ms; "
                  f"under load median {median(under):.2f} ms, p90 {q[8]:.2f} ms, max {max(under):.2f} ms")
    except RuntimeError as e:
        run.check(False, f"load: {e}")
    finally:
        run.close_all()
        run.unlink(reg)
        print(f"(load: {time.monotonic() - t_start:.0f} s)", flush=True)


def run_main(args):
    # `timeout` ends a part with SIGTERM: unwind, so the processes and registries go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    run = Run(args)
    print(f"weight-sync {args.part}: {'stand-in over the emulated driver' if args.standin else 'GPU'}, rounds "
          f"{args.rounds}, budget {args.budget} s, output in {run.out}", flush=True)
    try:
        if args.part in ("gpt2", "7b"):
            part_takes(run, args.part)
        elif args.part == "load":
            part_load(run)
        elif args.part == "first":
            part_first(run)
    finally:
        run.close_all()
    print(f"weight-sync {args.part}: {run.passed} passed, {run.failed} failed", flush=True)
    return 0 if run.failed == 0 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["run", "trainer", "companion"])
    ap.add_argument("--part", choices=["gpt2", "7b", "load", "first"], default="gpt2")
    ap.add_argument("--kind", choices=list(LAYOUTS), default="gpt2")
    ap.add_argument("--way", choices=WAYS)
    ap.add_argument("--name", default="run")
    ap.add_argument("--work", default="/tmp")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "vmmshim-weightsync"))
    ap.add_argument("--build", default=os.environ.get("BUILD_DIR", str(ROOT / "build")))
    ap.add_argument("--confs", default=",".join(CONFS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--companions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--load-blocks", type=int, default=4)
    ap.add_argument("--load-alone", type=int, default=10)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--scale", type=int, default=1, help="divide the widths (stand-in runs)")
    ap.add_argument("--standin", action="store_true")
    ap.add_argument("--publish", action="store_true")
    ap.add_argument("--reduce", action="store_true")
    args = ap.parse_args()
    if args.role == "trainer":
        trainer_main(args)
    elif args.role == "companion":
        companion_main(args)
    else:
        sys.exit(run_main(args))


if __name__ == "__main__":
    main()
