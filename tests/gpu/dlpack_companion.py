"""The Python companion on a GPU, run by tests/gpu/python_dlpack.sh: opens the parameter a trainer
under the shim published (PID ADDR NBYTES FNV, from tests/gpu/torch_train.py's "param" line) with
tools/python's vmmshim, takes it zero-copy with torch.from_dlpack (and cupy.from_dlpack when CuPy
imports), and compares the bytes' FNV-1a with the trainer's.  One PASS/FAIL line per check."""
import gc
import sys

import torch
import vmmshim
from vmmshim import _dlpack

pid, addr, n, want = int(sys.argv[1]), int(sys.argv[2], 16), int(sys.argv[3]), sys.argv[4]


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)


reg = vmmshim.Registry()
with reg.open(pid, addr) as buf:
    off = addr - buf.address
    print(f"{buf}; the parameter at offset {off} of {buf.allocation}", flush=True)
    check(0 <= off and off + n <= buf.size, "the parameter lies inside the allocation opened")
    check(fnv1a(buf.read(off, n)) == want, f"buf.read: the trainer's bytes (fnv {want})")
    t = torch.from_dlpack(buf)
    check(t.is_cuda and t.device.index == buf.device and t.dtype == torch.uint8 and tuple(t.shape) == (buf.size,),
          f"torch.from_dlpack: a 1-D uint8 tensor of the allocation ({t.device}, {t.dtype}, {tuple(t.shape)})")
    check(t.data_ptr() == buf.ptr, "torch.from_dlpack is zero-copy (its data_ptr is the import's)")
    check(fnv1a(t[off:off + n].cpu().numpy().tobytes()) == want, "torch.from_dlpack: the trainer's bytes")
# the tensor keeps the import after the buffer is closed, until it is freed
check(fnv1a(t[off:off + n].cpu().numpy().tobytes()) == want, "the tensor outlives the buffer's close()")
del t
gc.collect()
check(_dlpack.live_exports() == 0, "freeing the tensor releases the import")

try:
    import cupy
except ImportError:
    print("note: CuPy does not import here: cupy.from_dlpack not checked")
else:
    with reg.open(pid, addr) as buf:
        c = cupy.from_dlpack(buf)
        check(c.data.ptr == buf.ptr and c.shape == (buf.size,) and c.dtype == cupy.uint8,
              "cupy.from_dlpack: zero-copy, 1-D uint8")
        check(fnv1a(cupy.asnumpy(c[off:off + n]).tobytes()) == want, "cupy.from_dlpack: the trainer's bytes")
        del c
reg.close()
