"""The trainer of tests/gpu/keep.sh, run under the shim: a small model trained for STEPS steps,
printing after each synchronized step the FNV-1a of every parameter's bytes ("fnv STEP NAME HEX")
and the logits of a fixed probe batch ("logits STEP HEX..." as float.hex), then, after the last
step, the XXH3-64 of each of its exportable allocations as the registry lists them ("alloc ADDRESS
SIZE HEX": what `vmmctl dump` writes, and its manifest's checksum), "final STEP", and dies: it sleeps for the script's SIGKILL
(die=kill), or segfaults itself (die=segv, os.kill SIGSEGV, no handler).  Its parameters are
published by name (vmmshim.publish_many) after every step.
  keep_train.py FRAMEWORK STEPS DIE      FRAMEWORK: torch, jax or stub (the emulated runtime's
                                          libcudart, for the dry run on a machine without a GPU)
It starts by printing "ready PID" and waiting for a line on stdin (the keeper attaches first).
Both checksums run in C: $KEEP_SUM_LIB (build/tests/libchecksums.so).  Device bytes are read with the driver's
cuMemcpyDtoH in the device's primary context (stub: the emulated pointers are host addresses)."""
import ctypes
import os
import signal
import sys
import time

import vmmshim

PROBE = (4, 16)  # logits of a probe batch of 4, 16 outputs

# The companion (keep_check.py, which imports this first) recomputes the logits from the same
# bytes: XLA's autotuner times GEMM algorithms per process and may pick another one there, which
# moved the logits by ~1e-5 on an H100 with bit-identical parameters.  Its heuristics alone pick
# the same algorithm in both processes.
if "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()


_SUMS = None


def sums_lib():
    global _SUMS
    if _SUMS is None:
        lib = ctypes.CDLL(os.environ["KEEP_SUM_LIB"])
        lib.vmm_test_fnv1a.restype = lib.vmm_test_xxh3.restype = ctypes.c_uint64
        lib.vmm_test_fnv1a.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
        lib.vmm_test_xxh3.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _SUMS = lib
    return _SUMS


def _buffer(data):
    return ctypes.create_string_buffer(bytes(data), len(data)) if not isinstance(data, ctypes.Array) else data


def fnv(data):
    return f"{sums_lib().vmm_test_fnv1a(_buffer(data), len(data), 0xCBF29CE484222325):016x}"


def xxh3(data):
    return f"{sums_lib().vmm_test_xxh3(_buffer(data), len(data)):016x}"


class Device:
    """Reads device bytes of this process (or, for stub, host addresses)."""

    def __init__(self, stub):
        self.stub = stub
        if stub:
            return
        cu = ctypes.CDLL("libcuda.so.1")
        self.cu = cu
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        ctx, dev = ctypes.c_void_p(), ctypes.c_int()
        assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
        self.ctx = ctx

    def read(self, ptr, n):
        if self.stub:
            return ctypes.string_at(ptr, n)
        buf = ctypes.create_string_buffer(n)
        assert self.cu.cuCtxPushCurrent_v2(self.ctx) == 0
        rc = self.cu.cuMemcpyDtoH_v2(buf, ptr, n)
        out = ctypes.c_void_p()
        self.cu.cuCtxPopCurrent_v2(ctypes.byref(out))
        if rc:
            raise RuntimeError(f"cuMemcpyDtoH of 0x{ptr:x}, {n} bytes: CUDA error {rc}")
        return buf


# ---- the models (keep_check.py builds the same ones) ------------------------------------------

def torch_model():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                                torch.nn.GELU(), torch.nn.LayerNorm(2048), torch.nn.Linear(2048, PROBE[1])).cuda()
    g = torch.Generator(device="cuda").manual_seed(1234)
    probe = torch.randn(PROBE[0], 512, device="cuda", generator=g)
    return model, probe


def jax_model():
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (512, 2048)) * 0.03, "b1": jnp.zeros((2048,)),
              "w2": jax.random.normal(k[1], (2048, PROBE[1])) * 0.03, "b2": jnp.zeros((PROBE[1],))}
    probe = jax.random.normal(k[2], (PROBE[0], 512))
    return params, probe


def jax_forward(params, x):
    import jax
    return jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def stub_logits(blobs):
    """The stub's "logits": FNV-1a of every parameter's bytes in name order, 64 of them."""
    h = fnv(b"".join(blobs[n] for n in sorted(blobs)))
    return [float(int(h[i % 16], 16) + i) for i in range(PROBE[0] * PROBE[1])]


def hexes(values):
    return " ".join(float(v).hex() for v in values)


# ---- training ---------------------------------------------------------------------------------

def run_torch(steps, report):
    import torch
    model, probe = torch_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(7)
    for step in range(steps):
        x = torch.randn(256, 512, device="cuda", generator=g)
        y = torch.randn(256, PROBE[1], device="cuda", generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            logits = model(probe)
        torch.cuda.synchronize()
        state = {n: t.detach() for n, t in model.state_dict().items()}
        vmmshim.publish_many(state)
        report(step, {n: t.data_ptr() for n, t in state.items()}, {n: t.numel() * t.element_size() for n, t in state.items()},
               logits.flatten().tolist())
    return model, opt, probe


def run_jax(steps, report):
    import jax
    import jax.numpy as jnp
    params, probe = jax_model()

    def loss(p, x, y):
        return jnp.mean((jax_forward(p, x) - y) ** 2)

    @jax.jit
    def update(p, x, y):
        grads = jax.grad(loss)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - 1e-2 * b, p, grads)

    key = jax.random.PRNGKey(7)
    for step in range(steps):
        key, kx, ky = jax.random.split(key, 3)
        x, y = jax.random.normal(kx, (256, 512)), jax.random.normal(ky, (256, PROBE[1]))
        params = update(params, x, y)
        logits = jax_forward(params, probe)
        logits.block_until_ready()
        jax.tree_util.tree_map(lambda a: a.block_until_ready(), params)
        vmmshim.publish_many(params)  # new buffers every step: the names move with them
        ptrs = {n: a.unsafe_buffer_pointer() for n, a in params.items()}
        report(step, ptrs, {n: a.nbytes for n, a in params.items()}, [float(v) for v in logits.reshape(-1).tolist()])
    return params, probe


def run_stub(steps, report):
    """The emulated runtime: "parameters" are buffers of known words, changed every step."""
    rt = ctypes.CDLL("libcudart.so.13")
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    sizes = {"layer.weight": 4 << 20, "layer.bias": 64 << 10}
    ptrs = {}
    for n, size in sizes.items():
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), size) == 0
        ptrs[n] = p.value

    class CAI:
        def __init__(self, ptr, size):
            self.__cuda_array_interface__ = {"version": 3, "data": (ptr, False), "shape": (size // 4,), "typestr": "<f4",
                                             "strides": None}

    for step in range(steps):
        blobs = {}
        for i, (n, size) in enumerate(sorted(sizes.items())):
            words = (ctypes.c_uint64 * (size // 8))(*(((step * 131 + i) * 0x9E3779B97F4A7C15 + k) & (2**64 - 1)
                                                      for k in range(size // 8)))
            assert rt.cudaMemcpy(ptrs[n], words, size, 1) == 0
            blobs[n] = bytes(words)
        vmmshim.publish_many({n: CAI(ptrs[n], sizes[n]) for n in sizes})
        report(step, ptrs, sizes, stub_logits(blobs))
    return ptrs


def warm(framework):
    """One allocation: a process joins the registry (and can be kept) at its first."""
    if framework == "torch":
        import torch
        return torch.zeros(1, device="cuda")
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.zeros(1).block_until_ready()
    rt = ctypes.CDLL("libcudart.so.13")
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), 4096) == 0
    return p


def main():
    framework, steps, die = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    keep_alive = warm(framework)  # noqa: F841 (held to the end)
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    dev = Device(framework == "stub")

    def report(step, ptrs, sizes, logits):
        for n in sorted(ptrs):
            print(f"fnv {step} {n} {fnv(dev.read(ptrs[n], sizes[n]))}")
        print(f"logits {step} {hexes(logits)}", flush=True)

    # The model lives until the process dies: a trainer killed mid-run still holds it.  (Dropped
    # on return, PyTorch's cudaMallocAsync backend frees every tensor with cudaFreeAsync, and their
    # records and names go with them, as they must; the caching allocator and JAX's arena keep
    # the memory cached, which hid this.)
    model = {"torch": run_torch, "jax": run_jax, "stub": run_stub}[framework](steps, report)  # noqa: F841
    # what vmmctl dump writes: each exportable allocation's requested bytes from its start
    with vmmshim.Registry() as reg:
        for a in reg.allocations(os.getpid()):
            if a.exportable:
                print(f"alloc 0x{a.address:x} {a.size} {xxh3(dev.read(a.address, a.size))}")
    print(f"final {steps - 1}", flush=True)
    time.sleep(1.0)  # every allocation older than the keeper's settle time: all of it held
    if die == "segv":
        print("segv", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(600)  # the script's SIGKILL


if __name__ == "__main__":
    main()
