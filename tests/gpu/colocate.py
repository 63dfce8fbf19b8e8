"""Issue 29's demonstration: the colocated RL loop, a trainer and a rollout process taking turns on one
GPU, run by tests/gpu/colocate.sh (`make test-gpu` runs it too).

Three runs of the same loop, one after the other, each with fresh processes:

  ref   never sleeps: one process, native (no preload), trains and decodes with its own weights and
        a KV cache of its own: the reference every sleeping run is checked against, bit for bit.
  vmm   the trainer and the rollout, both under the shim (LD_PRELOAD=$BUILD/libvmmshim.so).  The
        trainer names its weights once (vmmshim.publish_many) and makes its gradients and AdamW's
        state inside vmmshim.region("optim") from a MemPool of their own; the rollout makes a large
        KV cache inside vmmshim.region("kv") and takes the trainer's weights zero-copy by name once
        (Registry.open_torch): in-place optimizer steps keep every parameter where it is, so each
        iteration it only reads the name table to see that nothing moved.
  tms   today's way: both processes under torch_memory_saver's preload mode (no shim); the
        trainer's gradients and optimizer state in a TMS region with CPU backup, its weights shared
        once by reduce_tensor (legacy CUDA IPC) and copied into the rollout's own parameters every
        iteration; the KV cache in a TMS region, paused and resumed (--tms-weights sleep: the rollout's
        own parameters too, as SGLang's release_memory_occupation does).  Missing TMS: SKIP.

Each iteration (vmm and tms): 1. the trainer takes K steps; 2. it pauses "optim" (kept), not its
weights; 3. the rollout resumes "kv"; 4. it takes the weights and decodes greedily (a prefill of the
prompts, then one token at a time, every key and value written into the KV cache); 5. it pauses
"kv" (discarded); 6. the trainer resumes.  Both empty PyTorch's cache before they pause, as RL
frameworks do.

The driver (role run) starts the processes and speaks JSON lines with them over pipes, every wait
bounded; a process that dies or stops answering gives a FAIL line with its stderr's tail, never a
hang.  It never starts CUDA: a thread samples NVML's used memory (nvml_sampler.py) for the pair's
peak, and reads it around every pause and resume (each must move by 90% of the bytes or more).
Prints R lines, a markdown table (iteration time, peak NVML of the pair, time in pause and resume,
taking the weights, bit-exact losses, weights and rollout outputs), PASS/FAIL lines and
"colocate: N passed, N failed"; exits 1 on a failure.  Logs, raw.jsonl and table.md go to --out.

Bit for bit: every run computes the same kernels on the same inputs, so the losses, a checksum of
every parameter at the end and a checksum of the rollout's logits and tokens at every iteration
must be equal.  Attention is written out (matmul, softmax) because scaled_dot_product_attention's
fast backward kernels accumulate with atomics; CUBLAS_WORKSPACE_CONFIG is set as PyTorch's notes on
reproducibility say.

--dry runs the orchestration on the CPU with a tiny model: nothing sleeps, and the weights reach the
rollout through torch's CPU shared memory (a check of the script, not of the shim; needs torch).

Roles: run (the driver), trainer, rollout."""
import argparse
import contextlib
import ctypes
import gc
import json
import os
import pathlib
import pickle
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GiB = 1 << 30
MODES = ("ref", "vmm", "tms")
LABELS = {"ref": "never sleeps (reference)", "vmm": "vmmshim", "tms": "today's way (TMS + reduce_tensor)"}

torch = None  # imported by the trainer and the rollout only: the driver never starts CUDA
vmmshim = None
torch_memory_saver = None


# ------------------------------------------------------------------------------------------------
# The model: Llama's shapes and names (GQA, SwiGLU, RMSNorm, untied head; no positional encoding:
# the loop needs its memory and its kernels, not its language)

def config(args):
    if args.dry:
        return dict(layers=2, d=64, heads=4, kv_heads=2, ffn=128, vocab=256, batch=2, seq=32, kv_bytes=1 << 20,
                    rollout_batch=2, prompt=8, gen=4, seed=args.seed, lr=1e-3, dry=True)
    return dict(layers=args.layers, d=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000, batch=args.batch,
                seq=args.seq, kv_bytes=int(args.kv_gib * GiB) // (2 << 20) * (2 << 20),
                rollout_batch=args.rollout_batch, prompt=args.prompt, gen=args.gen, seed=args.seed, lr=1e-3,
                dry=False)


def n_params(c):
    d, kv, f = c["d"], c["d"] // c["heads"] * c["kv_heads"], c["ffn"]
    return c["layers"] * (2 * d * d + 2 * kv * d + 3 * f * d + 2 * d) + 2 * c["vocab"] * d + d


def define_model():
    """The model's classes (torch is imported by then)."""
    nn = torch.nn

    class Norm(nn.Module):
        def __init__(self, d, device, dtype):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight

    class Attention(nn.Module):
        def __init__(self, c, device, dtype):
            super().__init__()
            d, self.h, self.kvh, self.hd = c["d"], c["heads"], c["kv_heads"], c["d"] // c["heads"]
            kw = dict(bias=False, device=device, dtype=dtype)
            self.q_proj, self.o_proj = nn.Linear(d, d, **kw), nn.Linear(d, d, **kw)
            self.k_proj, self.v_proj = nn.Linear(d, self.kvh * self.hd, **kw), nn.Linear(d, self.kvh * self.hd, **kw)

        def forward(self, x, cache, start):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
            if cache is not None:  # this step's keys and values into the KV cache, attention over all so far
                kc, vc = cache
                kc[:, :, start:start + t] = k
                vc[:, :, start:start + t] = v
                k, v = kc[:, :, :start + t], vc[:, :, :start + t]
            # each key/value head serves h/kvh query heads; expand's backward is a sum, where
            # repeat_interleave's may be index_select's, which accumulates with atomics on CUDA
            n = k.shape[2]
            k = k[:, :, None].expand(b, self.kvh, self.h // self.kvh, n, self.hd).reshape(b, self.h, n, self.hd)
            v = v[:, :, None].expand(b, self.kvh, self.h // self.kvh, n, self.hd).reshape(b, self.h, n, self.hd)
            s = (q @ k.transpose(-1, -2)).float() * self.hd ** -0.5
            if t > 1:  # causal: position start+i sees keys up to start+i
                s = s.masked_fill(torch.ones(t, s.shape[-1], dtype=torch.bool, device=x.device).triu(start + 1),
                                  float("-inf"))
            a = torch.softmax(s, -1).to(x.dtype) @ v
            return self.o_proj(a.transpose(1, 2).reshape(b, t, self.h * self.hd))

    class MLP(nn.Module):
        def __init__(self, c, device, dtype):
            super().__init__()
            kw = dict(bias=False, device=device, dtype=dtype)
            self.gate_proj, self.up_proj = nn.Linear(c["d"], c["ffn"], **kw), nn.Linear(c["d"], c["ffn"], **kw)
            self.down_proj = nn.Linear(c["ffn"], c["d"], **kw)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self, c, device, dtype):
            super().__init__()
            self.input_layernorm, self.self_attn = Norm(c["d"], device, dtype), Attention(c, device, dtype)
            self.post_attention_layernorm, self.mlp = Norm(c["d"], device, dtype), MLP(c, device, dtype)

        def forward(self, x, cache, start):
            x = x + self.self_attn(self.input_layernorm(x), cache, start)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Llama(nn.Module):
        def __init__(self, c, device, dtype=torch.bfloat16):
            super().__init__()
            self.cfg = c
            self.embed_tokens = nn.Embedding(c["vocab"], c["d"], device=device, dtype=dtype)
            self.layers = nn.ModuleList(Layer(c, device, dtype) for _ in range(c["layers"]))
            self.norm = Norm(c["d"], device, dtype)
            self.lm_head = nn.Linear(c["d"], c["vocab"], bias=False, device=device, dtype=dtype)

        def forward(self, ids, caches=None, start=0):
            x = self.embed_tokens(ids)
            for i, layer in enumerate(self.layers):
                x = layer(x, caches[i] if caches else None, start)
            return self.lm_head(self.norm(x))

    return Llama


class Checksum:
    """Two sums of a tensor's 16-bit words, plain and weighted by position, computed on its device
    in int64: exact, so equal bytes give equal sums whatever order the kernels add in."""
    CHUNK = 1 << 24

    def __init__(self):
        self.s1 = self.s2 = self.n = 0

    def add(self, t):
        words = t.detach().contiguous().reshape(-1).view(torch.int16)
        for i in range(0, words.numel(), self.CHUNK):
            x = words[i:i + self.CHUNK].to(torch.int64) & 0xFFFF
            at = torch.arange(self.n + i, self.n + i + x.numel(), device=x.device) % 65521 + 1
            self.s1 += int(x.sum())
            self.s2 += int((x * at).sum())
        self.n += words.numel()
        return self

    def hex(self):
        return f"{self.s1 % (1 << 64):016x}{self.s2 % (1 << 64):016x}"


def make_grads_and_state(model, opt):
    """The gradients, and the state AdamW makes at its first step (with fused=True its step count
    is a float32 tensor on the device), made here, so they are allocated where the caller says."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_bytes(model, opt):
    """Bytes of the gradients and the optimizer's state."""
    n = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return n


class Data:
    """The training batches: token ids from a generator of their own, the same in every run."""

    def __init__(self, c, dev):
        self.c, self.dev = c, dev
        self.g = torch.Generator(device=dev)
        self.g.manual_seed(c["seed"] + 1)

    def batch(self):
        return torch.randint(0, self.c["vocab"], (self.c["batch"], self.c["seq"] + 1), device=self.dev,
                             generator=self.g)


def train(model, opt, data, k):
    losses = []
    for _ in range(k):
        ids = data.batch()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()  # into the gradients made in make_grads_and_state (accumulated in place)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def kv_views(kv, c):
    """Each layer's (keys, values) in the KV cache's bytes, [rollout batch, kv heads, positions, head
    dim] each; the same geometry in every run, so the decode runs the same kernels."""
    L, B, H, hd = c["layers"], c["rollout_batch"], c["kv_heads"], c["d"] // c["heads"]
    per_pos = L * 2 * B * H * hd
    positions = kv.numel() // 2 // per_pos
    if positions < c["prompt"] + c["gen"]:
        raise ValueError(f"a KV cache of {kv.numel()} bytes holds {positions} positions, fewer than "
                         f"{c['prompt']} + {c['gen']}")
    cache = kv.view(torch.bfloat16)[:per_pos * positions].view(L, 2, B, H, positions, hd)
    return [(cache[i, 0], cache[i, 1]) for i in range(L)]


def generate(model, kv, prompts, n):
    """Greedy decoding of n tokens after the prompts, every key and value written into kv: (tokens,
    a checksum of every step's logits and of the tokens)."""
    caches = kv_views(kv, model.cfg)
    sums, out = Checksum(), []
    with torch.no_grad():
        logits = model(prompts, caches, 0)[:, -1]
        pos = prompts.shape[1]
        for i in range(n):
            sums.add(logits)
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < n:
                logits = model(nxt, caches, pos)[:, -1]
                pos += 1
    tokens = torch.cat(out, 1)
    return tokens, sums.add(tokens).hex()


# ------------------------------------------------------------------------------------------------
# The trainer and the rollout (one process each; in the reference the trainer decodes itself)

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def ms_since(t0):
    return (time.perf_counter() - t0) * 1e3


def sleep_report(rep):
    """A vmmshim SleepReport's numbers (TMS's pause and resume report nothing)."""
    if rep is None:
        return {}
    return dict(released=rep.bytes_released, kept=rep.bytes_kept, not_shim=rep.bytes_not_shim,
                allocations=rep.allocations, shim_ms=rep.seconds * 1e3)


class Trainer:
    def __init__(self, args, c):
        self.mode, self.c = args.mode, c
        self.dev = dev = torch.device("cpu" if c["dry"] else "cuda")
        Llama = define_model()
        torch.manual_seed(c["seed"])
        model = self.model = Llama(c, dev)
        # fused AdamW (the CPU of a --dry run has no fused kernel)
        opt = self.opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], fused=not c["dry"])
        self.data = Data(c, dev)
        self.rollout = None
        if self.mode == "vmm":
            # the trainer: its weights named once, its gradients and AdamW's state under a tag
            vmmshim.publish_many(model.state_dict())
            optim_pool = torch.cuda.MemPool()
            with vmmshim.region("optim"), torch.cuda.use_mem_pool(optim_pool):
                make_grads_and_state(model, opt)    # then zero_grad(set_to_none=False) keeps them there
            self.optim_pool = optim_pool
        elif self.mode == "tms":
            with torch_memory_saver.region(tag="optim", enable_cpu_backup=True):
                make_grads_and_state(model, opt)
            if c["dry"]:
                vmmshim.publish_many(model.state_dict())
            else:
                # legacy CUDA IPC, as torch.multiprocessing shares a CUDA tensor: one handle a storage
                from torch.multiprocessing.reductions import reduce_tensor
                reduced = [(name, *reduce_tensor(t)) for name, t in model.state_dict().items()]
                with open(args.share, "wb") as f:
                    pickle.dump(reduced, f)
        else:
            make_grads_and_state(model, opt)
            self.rollout = Rollout(args, c, model=model)
        sync(dev)
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        self.ready = dict(pid=os.getpid(), params=sum(p.numel() for p in model.parameters()), weights_bytes=weights,
                          optim_bytes=state_bytes(model, opt), torch=torch.__version__,
                          device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")

    def do_train(self, k):
        model, opt, data = self.model, self.opt, self.data
        t0 = time.perf_counter()
        losses = train(model, opt, data, k)     # 1. K steps
        return dict(losses=losses, ms=ms_since(t0))

    def do_sleep(self):
        sync(self.dev)
        torch.cuda.empty_cache()  # the activations' cached blocks go back too
        t0 = time.perf_counter()
        rep = None
        if self.mode == "vmm":
            rep = vmmshim.pause("optim")                  # 2. kept in host memory; the weights stay
        else:
            torch_memory_saver.pause("optim")
        return dict(ms=ms_since(t0), **sleep_report(rep))

    def do_wake(self):
        t0 = time.perf_counter()
        rep = None
        if self.mode == "vmm":
            rep = vmmshim.resume("optim")                 # 6. at the same addresses, the bytes copied back
        else:
            torch_memory_saver.resume("optim")
        return dict(ms=ms_since(t0), **sleep_report(rep))

    def do_generate(self):  # the reference decodes in the trainer's process, with the trainer's weights
        return self.rollout.do_generate()

    def do_finish(self):
        sync(self.dev)
        return dict(weights={name: Checksum().add(t).hex() for name, t in self.model.state_dict().items()})


class Rollout:
    def __init__(self, args, c, model=None):
        self.mode, self.c = args.mode, c
        self.dev = dev = torch.device("cpu" if c["dry"] else "cuda")
        self.trainer_pid = args.trainer_pid
        g = torch.Generator(device=dev)
        g.manual_seed(c["seed"] + 2)
        self.prompts = torch.randint(0, c["vocab"], (c["rollout_batch"], c["prompt"]), device=dev, generator=g)
        kv_bytes = c["kv_bytes"]
        self.sleeps = []  # the TMS tags paused and resumed together
        self.t_open = None
        t0 = time.perf_counter()
        if self.mode == "vmm":
            trainer_pid = self.trainer_pid
            # the rollout: a KV cache under a tag of its own, the trainer's weights by name
            kv_pool = torch.cuda.MemPool()
            with vmmshim.region("kv"), torch.cuda.use_mem_pool(kv_pool):
                kv = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
            model = define_model()(c, "meta")
            reg = vmmshim.Registry()
            t1 = time.perf_counter()
            model.load_state_dict(reg.open_torch(trainer_pid), assign=True)   # zero-copy, once
            self.t_open = ms_since(t1)
            self.reg, self.kv_pool = reg, kv_pool
            self.names = self.where()
        elif self.mode == "tms":
            with torch_memory_saver.region(tag="kv"):
                kv = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
            self.sleeps.append("kv")
            # the rollout's own parameters, which the trainer's weights are copied into every iteration;
            # with --tms-weights sleep in a TMS region of their own, paused with the KV cache (SGLang's
            # release_memory_occupation), else resident
            asleep = args.tms_weights == "sleep"
            with torch_memory_saver.region(tag="weights") if asleep else contextlib.nullcontext():
                model = define_model()(c, dev)
            if asleep:
                self.sleeps.append("weights")
            t1 = time.perf_counter()
            if c["dry"]:
                self.ipc = vmmshim.Registry().open_torch(self.trainer_pid)
            else:
                with open(args.share, "rb") as f:
                    reduced = pickle.load(f)
                self.ipc = {name: rebuild(*rest) for name, rebuild, rest in reduced}
            sync(dev)
            self.t_open = ms_since(t1)
            self.own = model.state_dict()
        else:
            kv = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
        sync(dev)
        self.model, self.kv = model, kv
        self.sleep_bytes = kv_bytes + (sum(t.numel() * t.element_size() for t in self.own.values())
                                       if "weights" in self.sleeps else 0)
        self.ready = dict(pid=os.getpid(), sleep_bytes=self.sleep_bytes, open_ms=self.t_open, setup_ms=ms_since(t0))

    def where(self):
        """(address, allocation) of each tensor the trainer names now."""
        return {name: (t.address, t.alloc_id) for name, t in self.reg.tensors(self.trainer_pid).items()}

    def take(self):
        """Step 4's taking of the weights: vmm, see that every name still points where it did (an
        optimizer that replaced a tensor, or a free, would have moved it: open again); tms, copy the
        trainer's weights into the rollout's parameters.  Returns (ms, opened again)."""
        t0 = time.perf_counter()
        again = False
        if self.mode == "vmm":
            now = self.where()
            if now != self.names:
                self.model.load_state_dict(self.reg.open_torch(self.trainer_pid), assign=True)
                self.names, again = now, True
        elif self.mode == "tms":
            with torch.no_grad():
                for name, t in self.own.items():
                    t.copy_(self.ipc[name])
            sync(self.dev)
        return ms_since(t0), again

    def do_wake(self):
        t0 = time.perf_counter()
        rep = None
        if self.mode == "vmm":
            rep = vmmshim.resume("kv")                    # 3.
        else:
            for tag in self.sleeps:
                torch_memory_saver.resume(tag)
        return dict(ms=ms_since(t0), **sleep_report(rep))

    def do_generate(self):
        take_ms, again = self.take()
        model, kv, prompts, n = self.model, self.kv, self.prompts, self.c["gen"]
        t0 = time.perf_counter()
        tokens, fingerprint = generate(model, kv, prompts, n)   # 4. with this iteration's weights
        sync(self.dev)
        return dict(fingerprint=fingerprint, first=tokens[0].tolist(), ms=ms_since(t0), take_ms=take_ms, again=again)

    def do_sleep(self):
        sync(self.dev)
        torch.cuda.empty_cache()  # the decode's cached blocks go back too
        t0 = time.perf_counter()
        rep = None
        if self.mode == "vmm":
            rep = vmmshim.pause("kv", keep=False)         # 5. discarded
        else:
            for tag in self.sleeps:
                torch_memory_saver.pause(tag)
        return dict(ms=ms_since(t0), **sleep_report(rep))


class DrySleep:
    """vmmshim and torch_memory_saver in a --dry run (the CPU, no preload): regions and pauses do
    nothing, and the weights the trainer publishes reach the rollout through torch's CPU shared
    memory (a file_system handle in a file), zero-copy as open_torch is."""

    def __init__(self, share):
        self.share = share

    def region(self, tag, **_):
        return contextlib.nullcontext()

    def pause(self, tag=None, keep=True):
        return None

    def resume(self, tag=None):
        return None

    def publish_many(self, tensors):
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler
        mp.set_sharing_strategy("file_system")
        for t in tensors.values():
            t.share_memory_()
        with open(self.share, "wb") as f:
            f.write(ForkingPickler.dumps(dict(tensors)))

    def Registry(self):
        return self

    def open_torch(self, pid):
        import torch.multiprocessing as mp
        mp.set_sharing_strategy("file_system")
        with open(self.share, "rb") as f:
            return pickle.load(f)

    def tensors(self, pid):
        class T:
            address, alloc_id = 0, ""
        return {name: T for name in self.open_torch(pid)}


def die_with_parent():
    """SIGKILL when the driver goes (PR_SET_PDEATHSIG), so no process outlives a killed run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit(1)


def child_main(args):
    """A role: JSON commands on stdin, one JSON answer each on the stdout it was started with; fd 1
    then goes to stderr, so nothing torch or a library prints can break an answer."""
    global torch, vmmshim, torch_memory_saver
    die_with_parent()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    c = json.loads(args.cfg)
    import torch as torch_module
    torch = torch_module
    if c["dry"]:
        vmmshim = torch_memory_saver = DrySleep(args.share)
        torch.cuda.MemPool = lambda: None
        torch.cuda.use_mem_pool = lambda pool: contextlib.nullcontext()
    elif args.mode == "vmm":
        import vmmshim as vmmshim_module
        vmmshim = vmmshim_module
    elif args.mode == "tms":
        # the loader skips a preload it cannot load with one line on stderr; then nothing would sleep
        lib = os.path.realpath(os.environ.get("LD_PRELOAD", ""))
        with open("/proc/self/maps") as f:
            if lib not in f.read():
                raise RuntimeError(f"torch_memory_saver's preload library {lib} is not loaded (see ld.so's line above)")
        from torch_memory_saver import torch_memory_saver as tms
        torch_memory_saver = tms
    role = (Trainer if args.role == "trainer" else Rollout)(args, c)
    answers.write(json.dumps(dict(ready=True, **role.ready)) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "quit":
            break
        try:
            out = getattr(role, "do_" + cmd)(**msg)
        except Exception as e:  # say it, and let the driver decide: it ends the run with a FAIL line
            traceback.print_exc()
            out = dict(error=f"{cmd}: {type(e).__name__}: {e}")
        answers.write(json.dumps(out) + "\n")
    # an ordinary exit, its teardown included: the driver checks its status
    del role
    gc.collect()


# ------------------------------------------------------------------------------------------------
# The driver

class Broke(Exception):
    """A process died, answered an error, or said nothing in time."""

    def __init__(self, who, why, tail):
        super().__init__(f"{who}: {why}")
        self.who, self.why, self.tail = who, why, tail


def exit_text(rc):
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited {rc}"


class Child:
    def __init__(self, name, argv, env, log):
        self.name, self.log_path = name, log
        self.log = open(log, "wb")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                  cwd=str(ROOT))
        self.buf = b""
        self.hung = False

    def tail(self, n=15):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 16384))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []
        return lines[-n:]

    def send(self, **msg):
        try:
            self.p.stdin.write((json.dumps(msg) + "\n").encode())
            self.p.stdin.flush()
        except OSError:
            raise Broke(self.name, f"it no longer reads its commands ({exit_text(self.p.poll())})", self.tail())

    def recv(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.hung = True
                raise Broke(self.name, f"no answer in {timeout:.0f} s", self.tail())
            if select.select([self.p.stdout], [], [], min(left, 1.0))[0]:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    try:
                        self.p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                    raise Broke(self.name, exit_text(self.p.poll()), self.tail())
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise Broke(self.name, msg["error"], self.tail())
        return msg

    def ask(self, timeout, **msg):
        self.send(**msg)
        return self.recv(timeout)

    def close(self):
        """quit, then at most 30 s before SIGKILL (at once for one that stopped answering); the exit status."""
        if self.hung and self.p.poll() is None:
            self.p.kill()
        if self.p.poll() is None:
            try:
                self.p.stdin.write(b'{"cmd": "quit"}\n')
                self.p.stdin.flush()
            except OSError:
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        return self.p.returncode


def find_tms():
    """(preload library, site folder, None) of torch_memory_saver as built into .tms/ (TMS_PRELOAD
    and TMS_SITE override), or (None, None, why not)."""
    site = pathlib.Path(os.environ.get("TMS_SITE") or ROOT / ".tms" / "site")
    if not (site / "torch_memory_saver" / "__init__.py").is_file():
        return None, None, f"no torch_memory_saver package in {site} (TMS_SITE)"
    lib = os.environ.get("TMS_PRELOAD")
    if not lib:
        # where the package itself looks (utils.get_binary_path_from_package): beside it, or in it
        found = sorted(str(p) for d in (site, site / "torch_memory_saver")
                       for p in d.glob("torch_memory_saver_hook_mode_preload*.so"))
        # torch 2.11+cu130 on the GPU machine: the CUDA 13 build when there are several
        found = [p for p in found if "_cu13" in os.path.basename(p)] or found
        if len(found) != 1:
            return None, None, f"{len(found)} preload libraries in {site}, not 1 (TMS_PRELOAD names one)"
        lib = str(pathlib.Path(found[0]).resolve())
    if not os.path.isfile(lib) or "torch_memory_saver" not in lib:
        # TMS's preload mode finds itself by that name in LD_PRELOAD
        return None, None, f"TMS_PRELOAD {lib} is no torch_memory_saver library"
    return lib, str(site), None


def cudart_dirs():
    """Folders of pip's nvidia packages (torch's) holding a libcudart: TMS's preload library needs
    one as the loader preloads it, before torch has loaded its own, or the loader skips it with a
    warning and nothing would sleep."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    out = []
    for base in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(pathlib.Path(base).glob("*/lib/libcudart.so.*")):
            if str(lib.parent) not in out:
                out.append(str(lib.parent))
    return out


class Run:
    def __init__(self, args):
        self.args, self.c = args, config(args)
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.build = pathlib.Path(args.build).resolve()
        self.registry = f"/vmmshim-colocate-{os.getpid()}"
        self.raw = open(self.out / "raw.jsonl", "w")
        self.nvml = self.sampler = None
        self.nvml_why = "--dry"
        if not args.dry:
            sys.path.insert(0, str(HERE))
            from nvml_sampler import Nvml, Sampler
            try:
                self.nvml = Nvml()
                self.sampler = Sampler(self.nvml, 2.0).start()
            except RuntimeError as e:
                self.nvml_why = f"no NVML: {e}"
        self.children = []

    def record(self, **row):
        self.raw.write(json.dumps(row) + "\n")
        self.raw.flush()

    def used(self):
        return self.nvml.used() if self.nvml else None

    def samples(self, t0, t1):
        return [u for t, u in (self.sampler.samples if self.sampler else []) if t0 <= t <= t1]

    def env(self, mode, tms):
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1",
                   # cuBLAS run to run the same (PyTorch's notes on reproducibility)
                   CUBLAS_WORKSPACE_CONFIG=":4096:8")
        # the default caching allocator in every run (TMS refuses expandable segments)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("LD_PRELOAD", None)
        path = [p for p in env.get("PYTHONPATH", "").split(":") if p]
        if self.args.dry:
            return env
        if mode == "vmm":
            env.update(LD_PRELOAD=str(self.build / "libvmmshim.so"), VMMSHIM_REGISTRY=self.registry,
                       VMMSHIM_CLIENT_LIB=str(self.build / "libvmmshim-client.so"))
            path.insert(0, str(ROOT / "tools" / "python"))
        elif mode == "tms":
            env["LD_PRELOAD"] = tms[0]
            path.insert(0, tms[1])
            libs = cudart_dirs() + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
            if libs:
                env["LD_LIBRARY_PATH"] = ":".join(libs)
            # what .tms/README says TMS wants besides (COLO_TMS_ENV="NAME=VALUE NAME=VALUE")
            for word in os.environ.get("COLO_TMS_ENV", "").split():
                name, _, value = word.partition("=")
                env[name] = value
        if path:
            env["PYTHONPATH"] = ":".join(path)
        return env

    def start(self, role, mode, env, **extra):
        argv = [sys.executable, str(HERE / "colocate.py"), role, "--mode", mode, "--cfg", json.dumps(self.c),
                "--share", str(self.out / f"{mode}-weights.pickle"), "--tms-weights", self.args.tms_weights]
        for k, v in extra.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        child = Child(f"the {role}", argv, env, self.out / f"{mode}-{role}.log")
        self.children.append(child)
        return child

    def close_all(self):
        rcs = {}
        for ch in reversed(self.children):  # the rollout lets go of the trainer's memory before the trainer exits
            rcs[ch.name] = ch.close()
        self.children = []
        return rcs


class Result:
    def __init__(self, mode):
        self.mode = mode
        self.skipped = self.broke = None
        self.iters = []       # per iteration: dict of times
        self.losses = []
        self.fingerprints = []  # the warm-up's (the weights before training), then one per iteration
        self.weights = {}
        self.moves = []       # (what, NVML change, bytes it should move, ok)
        self.pauses = self.resumes = 0  # that returned
        self.peak = self.peak_all = None
        self.ready = {}
        self.exits = {}


def nvml_moved(run, res, what, before, nbytes, falls):
    after = run.used()
    if before is None or after is None:
        return
    change = before - after if falls else after - before
    ok = change >= 0.9 * nbytes
    res.moves.append((what, change, nbytes, ok))


def run_mode(run, mode, tms):
    a, res = run.args, Result(mode)
    if mode == "tms" and tms[0] is None:
        res.skipped = tms[2]
        return res
    if mode == "vmm" and not a.dry:
        missing = [n for n in ("libvmmshim.so", "libvmmshim-client.so") if not (run.build / n).is_file()]
        if missing:
            res.broke = Broke("vmmshim", f"{', '.join(missing)} missing in {run.build} (carry build/)", [])
            return res
    time.sleep(0.5)  # the last run's processes are gone; NVML settles
    t_start = time.monotonic()
    before = run.samples(t_start - 0.4, t_start)
    base = statistics.median(before) if before else None
    env = run.env(mode, tms)
    run.record(mode=mode, env={k: env.get(k) for k in ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH",
                                                       "VMMSHIM_REGISTRY")})
    t_loop = t_end = None
    try:
        if mode == "ref":
            tr = run.start("trainer", mode, env)
            res.ready = tr.recv(a.setup_timeout)
            res.fingerprints.append(tr.ask(a.timeout, cmd="generate")["fingerprint"])
            t_loop = time.monotonic()
            for i in range(a.iters):
                t0 = time.perf_counter()
                trained = tr.ask(a.timeout, cmd="train", k=a.steps)
                gen = tr.ask(a.timeout, cmd="generate")
                it = dict(ms=ms_since(t0), train_ms=trained["ms"], gen_ms=gen["ms"])
                res.iters.append(it)
                res.losses += trained["losses"]
                res.fingerprints.append(gen["fingerprint"])
                run.record(mode=mode, iter=i, **it, losses=trained["losses"], fingerprint=gen["fingerprint"])
            t_end = time.monotonic()
            res.weights = tr.ask(a.timeout, cmd="finish")["weights"]
        else:
            tr = run.start("trainer", mode, env)
            res.ready = tr.recv(a.setup_timeout)
            optim = res.ready["optim_bytes"]
            # the trainer sleeps before the rollout makes its KV cache: the two never hold all at once
            before = run.used()
            tr.ask(a.timeout, cmd="sleep")
            res.pauses += 1
            nvml_moved(run, res, "setup: the trainer's pause", before, optim, True)
            ro = run.start("rollout", mode, env, trainer_pid=res.ready["pid"])
            rready = ro.recv(a.setup_timeout)
            res.ready["rollout"] = rready
            kv = rready["sleep_bytes"]
            gen = ro.ask(a.timeout, cmd="generate")  # a warm-up, with the weights before training
            res.fingerprints.append(gen["fingerprint"])
            before = run.used()
            ro.ask(a.timeout, cmd="sleep")
            res.pauses += 1
            nvml_moved(run, res, "setup: the rollout's pause", before, kv, True)
            before = run.used()
            tr.ask(a.timeout, cmd="wake")
            res.resumes += 1
            nvml_moved(run, res, "setup: the trainer's resume", before, optim, False)
            t_loop = time.monotonic()
            for i in range(a.iters):
                t0 = time.perf_counter()
                trained = tr.ask(a.timeout, cmd="train", k=a.steps)               # 1.
                before = run.used()
                t_pause = tr.ask(a.timeout, cmd="sleep")                          # 2.
                nvml_moved(run, res, f"iteration {i}: the trainer's pause", before, optim, True)
                before = run.used()
                r_resume = ro.ask(a.timeout, cmd="wake")                          # 3.
                nvml_moved(run, res, f"iteration {i}: the rollout's resume", before, kv, False)
                gen = ro.ask(a.timeout, cmd="generate")                           # 4.
                before = run.used()
                r_pause = ro.ask(a.timeout, cmd="sleep")                          # 5.
                nvml_moved(run, res, f"iteration {i}: the rollout's pause", before, kv, True)
                before = run.used()
                t_resume = tr.ask(a.timeout, cmd="wake")                          # 6.
                res.pauses, res.resumes = res.pauses + 2, res.resumes + 2
                nvml_moved(run, res, f"iteration {i}: the trainer's resume", before, optim, False)
                it = dict(ms=ms_since(t0), train_ms=trained["ms"], gen_ms=gen["ms"], take_ms=gen["take_ms"],
                          reopened=gen["again"], t_pause_ms=t_pause["ms"], r_resume_ms=r_resume["ms"],
                          r_pause_ms=r_pause["ms"], t_resume_ms=t_resume["ms"])
                it["sleep_ms"] = it["t_pause_ms"] + it["r_resume_ms"] + it["r_pause_ms"] + it["t_resume_ms"]
                res.iters.append(it)
                res.losses += trained["losses"]
                res.fingerprints.append(gen["fingerprint"])
                run.record(mode=mode, iter=i, **it, losses=trained["losses"], fingerprint=gen["fingerprint"],
                           trainer_pause=t_pause, trainer_resume=t_resume, rollout_resume=r_resume,
                           rollout_pause=r_pause)
            t_end = time.monotonic()
            res.weights = tr.ask(a.timeout, cmd="finish")["weights"]
    except Broke as e:
        res.broke = e
    finally:
        res.exits = run.close_all()
    t_stop = time.monotonic()
    if base is not None:
        if t_loop is not None and t_end is not None and run.samples(t_loop, t_end):
            res.peak = max(run.samples(t_loop, t_end)) - base
        whole = run.samples(t_start, t_stop)
        res.peak_all = max(whole) - base if whole else None
    run.record(mode=mode, ready=res.ready, peak=res.peak, peak_all=res.peak_all, baseline=base,
               moves=res.moves, exits=res.exits, broke=str(res.broke) if res.broke else None)
    return res


def median_range(xs, fmt="{:.0f}"):
    if not xs:
        return "–"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def gib(n):
    return "–" if n is None else f"{n / GiB:.2f}"


def report(run, results):
    a = run.args
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        if ok:
            passed += 1
        else:
            failed += 1
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
        return ok

    def broke(label, e):
        check(False, f"{label}: {e.who}: {e.why}")
        for line in e.tail or ["(nothing on its stderr)"]:
            print(f"  | {line}")

    ref = results.get("ref")
    equal = {}
    for mode in ("vmm", "tms"):
        r = results.get(mode)
        if r is None or r.skipped or r.broke:
            continue
        ok = ref is not None and not ref.broke
        equal[mode] = dict(losses=ok and r.losses == ref.losses and len(r.losses) == a.iters * a.steps,
                           weights=ok and bool(r.weights) and r.weights == ref.weights,
                           rollout=ok and r.fingerprints == ref.fingerprints and len(r.fingerprints) == a.iters + 1)

    def yes(mode, what):
        return "yes" if equal.get(mode, {}).get(what) else "no"

    # the R lines: one per iteration and run
    for mode, r in results.items():
        for i, it in enumerate(r.iters):
            print(f"R {mode} iter={i} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                 for k, v in it.items()), flush=True)
    print()
    lines = ["| run | iteration, ms: median (min–max) | peak NVML of the pair, GiB | pause + resume per iteration, "
             "ms: median (min–max) | taking the weights, ms | losses bit-exact | weights bit-exact | rollout "
             "bit-exact |", "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        r = results.get(mode)
        if r is None:
            continue
        if r.skipped:
            lines.append(f"| {LABELS[mode]} | skipped: {r.skipped} | | | | | | |")
            continue
        its = r.iters
        if mode == "ref":
            take, sleeps, eq = "its own", "–", ["(itself)"] * 3
        else:
            opened = r.ready.get("rollout", {}).get("open_ms")
            per = median_range([it["take_ms"] for it in its], "{:.1f}")
            if mode == "vmm":
                again = sum(1 for it in its if it["reopened"])
                take = f"open_torch once {opened or 0:.1f}; names read {per} an iteration, opened again {again} times"
            else:
                take = f"reduce_tensor's rebuild once {opened or 0:.1f}; copied {per} an iteration"
            sleeps = median_range([it["sleep_ms"] for it in its], "{:.1f}")
            eq = [yes(mode, w) for w in ("losses", "weights", "rollout")]
        lines.append(f"| {LABELS[mode]}{' (broke)' if r.broke else ''} | {median_range([it['ms'] for it in its])} | "
                     f"{gib(r.peak)} | {sleeps} | {take} | {' | '.join(eq)} |")
    table = "\n".join(lines)
    print(table)
    (run.out / "table.md").write_text(table + "\n")
    print()
    w = next((r.ready["weights_bytes"] for r in results.values() if "weights_bytes" in r.ready), None)
    for mode in ("vmm", "tms"):
        r = results.get(mode)
        if r is None or not r.iters:
            continue
        parts = {k: statistics.median([it[k] for it in r.iters]) for k in ("t_pause_ms", "t_resume_ms", "r_resume_ms",
                                                                      "r_pause_ms")}
        print(f"{LABELS[mode]}: medians per iteration: the trainer's pause {parts['t_pause_ms']:.1f} ms and resume "
              f"{parts['t_resume_ms']:.1f} ms ({gib(r.ready.get('optim_bytes'))} GiB kept), the rollout's resume "
              f"{parts['r_resume_ms']:.1f} ms and pause {parts['r_pause_ms']:.1f} ms "
              f"({gib(r.ready.get('rollout', {}).get('sleep_bytes'))} GiB discarded); peak NVML over the whole run "
              f"{gib(r.peak_all)} GiB")
    print()

    # the checks
    if ref is None:
        pass
    elif ref.broke:
        broke(LABELS["ref"], ref.broke)
    else:
        check(len(set(ref.fingerprints)) == len(ref.fingerprints),
              f"{LABELS['ref']}: the rollout's outputs change from iteration to iteration "
              f"({len(set(ref.fingerprints))} distinct of {len(ref.fingerprints)}), so stale weights would show")
    for mode in ("vmm", "tms"):
        r = results.get(mode)
        if r is None:
            continue
        label = LABELS[mode]
        if r.skipped:
            print(f"SKIP {label}: {r.skipped}")
            continue
        if r.broke:
            broke(label, r.broke)
            continue
        bad = [m for m in r.moves if not m[3]]
        what = (f"{r.pauses} pauses and {r.resumes} resumes returned" +
                (f"; NVML moved by 90% of the bytes or more each time ({len(r.moves)} times)" if run.nvml else
                 f" (NVML not read: {run.nvml_why})"))
        if bad:
            what += "; not: " + "; ".join(f"{m[0]}: {m[1] / GiB:+.2f} GiB for {m[2] / GiB:.2f}" for m in bad[:4])
        check(not bad, f"{label}: every pause and resume succeeded: {what}")
        if ref is None or ref.broke:
            check(False, f"{label}: nothing to compare with: the run that never sleeps did not finish")
            continue
        e = equal[mode]
        first = next((i for i, (x, y) in enumerate(zip(r.losses, ref.losses)) if x != y), None)
        check(e["losses"], f"{label}: its {len(r.losses)} losses equal the never-sleeping run's, bit for bit"
                           + ("" if e["losses"] else f" (first differing step {first})"))
        differ = [n for n in ref.weights if r.weights.get(n) != ref.weights[n]]
        check(e["weights"], f"{label}: every one of its {len(r.weights)} parameters equals the never-sleeping run's "
                            f"at the end (checksum of every 16-bit word)" +
                            ("" if e["weights"] else f"; differing: {', '.join(differ[:3]) or 'none named'}"))
        firstf = next((i for i, (x, y) in enumerate(zip(r.fingerprints, ref.fingerprints)) if x != y), None)
        check(e["rollout"], f"{label}: the rollout's logits and tokens equal the never-sleeping run's at every "
                            f"iteration (and before the first): it decoded with the trainer's weights of the moment"
                            + ("" if e["rollout"] else f" (first differing: {firstf})"))
        bad_exit = {k: v for k, v in r.exits.items() if v != 0}
        check(not bad_exit, f"{label}: both processes exited 0" +
              ("" if not bad_exit else ": " + ", ".join(f"{k} {exit_text(v)}" for k, v in bad_exit.items())))
    v, t = results.get("vmm"), results.get("tms")
    if v and t and not v.skipped and not t.skipped:
        if v.peak is None or t.peak is None:
            if run.nvml is None:
                print(f"SKIP peak NVML of the pair: {run.nvml_why}")
            else:
                check(False, "peak NVML of the pair: a run did not finish its loop")
        else:
            check(v.peak < t.peak, f"peak NVML of the pair during the loop: vmmshim {gib(v.peak)} GiB < today's way "
                                   f"{gib(t.peak)} GiB ({(t.peak - v.peak) / GiB:.2f} GiB less; the weights are "
                                   f"{gib(w)} GiB)")
    print(f"colocate: {passed} passed, {failed} failed", flush=True)
    return failed


def torch_here(dry):
    """None when torch (with CUDA, unless dry) is importable in a child; else why not.  A child
    asks: the driver itself never starts CUDA."""
    probe = "import torch, sys; sys.exit(0 if %s else 3)" % ("True" if dry else "torch.cuda.is_available()")
    try:
        p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "importing torch took over 120 s"
    if p.returncode == 3:
        return "torch.cuda.is_available() is False"
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or ["?"])[-1]
    return None


def run_main(args):
    # `timeout` ends the run with SIGTERM: unwind, so the processes go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    why = torch_here(args.dry)
    if why:
        print(f"SKIP colocate: torch{'' if args.dry else ' with CUDA'} is not importable here ({why})")
        print("colocate: 0 passed, 0 failed (skipped)")
        return 0
    run = Run(args)
    tms = find_tms() if not args.dry else ("(a stand-in)", "", None)
    c = run.c
    modes = [m for m in args.modes.split(",") if m]
    where = "--dry: the CPU, a tiny model, nothing sleeps" if args.dry else "one GPU"
    print(f"colocate: {where}; a Llama-shaped model "
          f"of {c['layers']} layers, width {c['d']}, {n_params(c) / 1e9:.2f} B parameters in bf16, AdamW; "
          f"{args.iters} iterations of {args.steps} steps on {c['batch']} x {c['seq']} tokens; rollout "
          f"{c['rollout_batch']} prompts of {c['prompt']} tokens, {c['gen']} tokens decoded into a KV cache of "
          f"{c['kv_bytes'] / GiB:.2f} GiB; TMS {tms[0] or 'missing: ' + tms[2]} (the rollout's own weights "
          f"{args.tms_weights}); output in {run.out}",
          flush=True)
    results = {}
    t0 = time.monotonic()
    try:
        for mode in modes:
            t = time.monotonic()
            r = results[mode] = run_mode(run, mode, tms)
            state = ("skipped: " + r.skipped) if r.skipped else (f"broke: {r.broke}" if r.broke else "done")
            if mode in ("ref", "vmm") and r.ready.get("device") and not r.skipped:
                state += f" (on {r.ready['device']}, torch {r.ready.get('torch')})"
            print(f"{LABELS[mode]}: {state} in {time.monotonic() - t:.0f} s", flush=True)
    finally:
        run.close_all()
        if run.sampler:
            run.sampler.stop()
        try:
            os.unlink("/dev/shm" + run.registry)
        except FileNotFoundError:
            pass
    print(f"(all runs: {time.monotonic() - t0:.0f} s)")
    return 1 if report(run, results) else 0


def main():
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=["run", "trainer", "rollout"], nargs="?", default="run")
    ap.add_argument("--mode", choices=MODES, default="ref")
    ap.add_argument("--modes", default=env("COLO_MODES", ",".join(MODES)), help="runs, in order")
    ap.add_argument("--layers", type=int, default=int(env("COLO_LAYERS", "12")),
                    help="of width 2048: 12 is 0.68 B parameters, 16 is 0.86 B")
    ap.add_argument("--iters", type=int, default=int(env("COLO_ITERS", "6")))
    ap.add_argument("--steps", type=int, default=int(env("COLO_STEPS", "4")), help="K, training steps an iteration")
    ap.add_argument("--batch", type=int, default=int(env("COLO_BATCH", "4")))
    ap.add_argument("--seq", type=int, default=int(env("COLO_SEQ", "512")))
    ap.add_argument("--kv-gib", type=float, default=float(env("COLO_KV_GIB", "16")),
                    help="the rollout's KV cache, made once (a serving engine's preallocated cache)")
    ap.add_argument("--rollout-batch", type=int, default=int(env("COLO_ROLLOUT_BATCH", "16")))
    ap.add_argument("--prompt", type=int, default=int(env("COLO_PROMPT", "64")))
    ap.add_argument("--gen", type=int, default=int(env("COLO_GEN", "32")))
    ap.add_argument("--tms-weights", choices=["resident", "sleep"], default=env("COLO_TMS_WEIGHTS", "resident"),
                    help="the TMS rollout's own parameters: resident, or paused with its KV cache")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=float(env("COLO_ANSWER_S", "180")),
                    help="seconds a process may take to answer a command")
    ap.add_argument("--setup-timeout", type=float, default=float(env("COLO_SETUP_S", "300")))
    ap.add_argument("--out", default=os.path.join(env("OUT", "/tmp"), "vmmshim-colocate"))
    ap.add_argument("--build", default=env("BUILD_DIR", str(ROOT / "build")))
    ap.add_argument("--dry", action="store_true")
    # a role's own
    ap.add_argument("--cfg")
    ap.add_argument("--share")
    ap.add_argument("--trainer-pid", type=int)
    args = ap.parse_args()
    if args.role == "run":
        sys.exit(run_main(args))
    child_main(args)


if __name__ == "__main__":
    main()
