"""A Python owner for test_names.py, run under the shim over the emulated runtime (ctypes over
libcudart.so.13, which the shim's hooks serve): it prints "ready <pid>", then runs each line read
on stdin as Python (an expression, else a statement) and answers one line, "ok <repr of the
result>" or "error <exception type> <message>"; "quit" ends it.  Not a test by itself (no
test_ prefix).  Helpers: alloc(n), free(p), fill(p, n, seed) (64-bit words seed *
0x9e3779b97f4a7c15 + word index), and tensor stand-ins: CAI (__cuda_array_interface__ only), DL
(__dlpack__ only, its __cuda_array_interface__ raising TypeError as torch's does for bfloat16),
Grad (both raising until detach(), as a torch tensor that requires grad), Model (state_dict())."""
import ctypes
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, sys.argv[1])
import vmmshim  # noqa: E402
from vmmshim import _dlpack  # noqa: E402

_rt = ctypes.CDLL("libcudart.so.13")
_rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
_rt.cudaFree.argtypes = [ctypes.c_void_p]
_rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
K = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def alloc(n):
    p = ctypes.c_void_p()
    rc = _rt.cudaMalloc(ctypes.byref(p), n)
    if rc:
        raise RuntimeError(f"cudaMalloc: {rc}")
    return p.value


def free(p):
    rc = _rt.cudaFree(p)
    if rc:
        raise RuntimeError(f"cudaFree: {rc}")


def fill(p, n, seed):
    words = (ctypes.c_uint64 * (n // 8))(*(((seed * K) + k) & MASK for k in range(n // 8)))
    rc = _rt.cudaMemcpy(p, words, n, 1)  # host to device
    if rc:
        raise RuntimeError(f"cudaMemcpy: {rc}")


def row_major(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.insert(0, step)
        step *= max(n, 1)
    return tuple(out)


class CAI:
    def __init__(self, ptr, shape, typestr, strides=None, mask=None):
        self.__cuda_array_interface__ = {"version": 3, "data": (ptr, False), "shape": tuple(shape),
                                         "typestr": typestr, "strides": strides, "mask": mask}


class DL:
    def __init__(self, ptr, shape, dtype=(4, 16, 1), strides=None, device=(2, 0)):
        self.ptr, self.shape, self.dtype, self.device = ptr, tuple(shape), dtype, device
        self.strides = strides if strides is not None else row_major(shape)
        self.exported = self.freed = 0

    @property
    def __cuda_array_interface__(self):
        raise TypeError("Got unsupported ScalarType BFloat16")

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.exported += 1
        return _dlpack.capsule(self, self.ptr, 0, self.device[1], self.shape, self.strides, self.dtype)

    def _export_freed(self):
        self.freed += 1


class Grad:
    def __init__(self, plain):
        self.plain = plain

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    def __dlpack__(self, stream=None):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def detach(self):
        return self.plain


class Model:
    def __init__(self, tensors):
        self.tensors = dict(tensors)

    def state_dict(self):
        return dict(self.tensors)


print("ready", os.getpid(), flush=True)
space = dict(globals())
for line in sys.stdin:
    src = line.strip()
    if src == "quit":
        break
    try:
        try:
            code = compile(src, "<command>", "eval")
        except SyntaxError:
            code = compile(src, "<command>", "exec")
        result = eval(code, space)
        print("ok", repr(result).replace("\n", " "), flush=True)
    except Exception as e:
        print("error", type(e).__name__, str(e).replace("\n", " "), flush=True)
