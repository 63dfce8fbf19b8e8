"""The Python companion of tests/gpu/xdev_import.sh: one Registry.open_many over allocations of an
owner on GPU 0 and GPU 1 (and a piece of one), from a process whose current device is GPU 1.

  xdev_open_many.py PID LIBFNV ALLOCS
      ALLOCS: the owner's lines, "alloc NAME DEV 0xADDR BYTES FNV" (whole allocations) and
      "range NAME 0xADDR BYTES FNV" (a piece); LIBFNV a shared library with
      `unsigned long long fnv1a(const void *, size_t)` (FNV-1a 64, as the owner computes it).
      Every buffer is taken with torch.from_dlpack (zero-copy: the tensor's data_ptr is the
      buffer's), cloned on its device (a kernel of GPU 1 reading GPU 0's memory over the peer
      mapping) and copied to the host: both must have the owner's FNV.  Buffers are on cuda:1
      (vmm_import_device: the calling thread's device, which may access GPU 0 as a peer).
      One PASS/FAIL line per check; exit 0 when all passed."""
import ctypes
import sys

import torch
import vmmshim

pid, libfnv, allocs = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fnv = ctypes.CDLL(libfnv)
fnv.fnv1a.restype = ctypes.c_ulonglong
fnv.fnv1a.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
failed = 0


def check(ok, what):
    global failed
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    failed += 0 if ok else 1


def host_fnv(t):
    a = t.cpu().contiguous().numpy()
    return f"{fnv.fnv1a(a.ctypes.data, a.nbytes):016x}"


want = []  # (label, address, size or None, fnv, owner's device or None)
for line in open(allocs):
    f = line.split()
    if f and f[0] == "alloc" and f[1] != "W0":
        want.append((f"{f[1]} (GPU {f[2]})", int(f[3], 16), None, f[5], int(f[2])))
    elif f and f[0] == "range":
        want.append((f"a piece of {f[1]}", int(f[2], 16), int(f[3]), f[4], None))

torch.cuda.set_device(1)
torch.zeros(1, device="cuda:1")  # the context, current on this thread
reg = vmmshim.Registry()
bufs = reg.open_many(pid, [(a, z) for _, a, z, _, _ in want])
check(len(bufs) == len(want), f"open_many: {len(bufs)} buffers for {len(want)} ranges of pid {pid}")
devices = sorted({d for *_, d in want if d is not None})
check(devices == [0, 1], f"the ranges lie on GPUs {devices}")
for (label, address, size, sum_, dev), buf in zip(want, bufs):
    n = buf.size
    print(f"{label}: {buf}; record device {buf.allocation.device}, {buf.allocation.n_handles} handles", flush=True)
    check(buf.device == 1, f"{label}: the buffer is for cuda:{buf.device} (want cuda:1)")
    t = torch.from_dlpack(buf)
    check(t.is_cuda and t.data_ptr() == buf.ptr and t.numel() == n, f"{label}: torch.from_dlpack is zero-copy on {t.device}")
    check(host_fnv(t) == sum_, f"{label}: copied to the host, the owner's bytes (fnv {sum_})")
    c = t.clone()  # a kernel on the tensor's device reads the imported memory
    torch.cuda.synchronize(c.device)
    check(host_fnv(c) == sum_, f"{label}: cloned by a kernel on {c.device}, the owner's bytes")
    del t, c
for b in bufs:
    b.close()
reg.close()
sys.exit(1 if failed else 0)
