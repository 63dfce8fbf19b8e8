"""vmmshim.to_torch over the emulated driver, with a stand-in for the few torch calls it makes
(no torch here): from_dlpack consumes the capsule through the C API as torch does and keeps the
managed tensor until its storage is gone; slicing, view(dtype) and as_strided record what a tensor
would see, and as_strided refuses what torch does (past the storage's end).  The
owner (tests/progs/owner under the shim) holds 2 MiB buffers; one open_many takes pieces of them.
Checks: one capsule per stretch of nearby views (views farther apart than vmmshim._torch.GAP get
their own), one flat tensor per dtype in it; each tensor's dtype, shape, strides, and storage offset put its first element at the
view's pointer, the stretch starting at a multiple of 256 below the first view; the stand-in
tensors read the owner's bytes at those pointers; a dict in gives a dict out with the same keys,
a list a list; the imports stay while any tensor of a stretch lives, also after the buffers and
views are dropped, and go when the last does.  open_torch makes its tensors while the driver grants
access (each cuMemSetAccess made to take 0.6 s: the stretch is not accessible when its capsule is
taken, and is when open_torch returns); a failure making them, or a failing grant, leaves no export,
import or mapping.  Ends with "N passed, N failed"."""
import ctypes
import gc
import sys
import types

import harness
from harness import Owner, pattern

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)
from vmmshim import _dlpack, _torch  # noqa: E402

T = harness.Tally()

_api = ctypes.PyDLL(None)
_get_pointer = _api.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_set_name = _api.PyCapsule_SetName
_set_name.restype, _set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]

ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "uint8": 1, "int64": 8, "bool": 1}


class FakeStorage:
    """A consumed capsule's memory: the managed tensor's deleter runs when the storage dies."""
    deleted = 0

    def __init__(self, managed_address, data, nbytes, device):
        self.data, self.nbytes, self.device = data, nbytes, device
        self._managed = _dlpack.DLManagedTensor.from_address(managed_address)
        self._address = managed_address

    def __del__(self):
        FakeStorage.deleted += 1
        self._managed.deleter(self._address)


class FakeTensor:
    def __init__(self, dtype, device, storage=None, offset=0, shape=(), strides=()):
        self.dtype, self.device, self.storage = dtype, device, storage
        self.offset, self.shape, self.strides = offset, tuple(shape), tuple(strides)

    def untyped_storage(self):
        return self.storage

    def __getitem__(self, index):
        assert isinstance(index, slice) and index.start is None and index.step is None and len(self.shape) == 1
        assert 0 <= index.stop <= self.shape[0], f"slice to {index.stop} of {self.shape[0]}"
        return FakeTensor(self.dtype, self.device, self.storage, self.offset, (index.stop,), (1,))

    def view(self, dtype):
        """Tensor.view(dtype) of a flat tensor: its bytes seen as another dtype."""
        CALLS["views"] += 1
        nbytes = self.shape[0] * ITEMSIZE[self.dtype]
        assert self.offset == 0 and self.strides == (1,) and nbytes % ITEMSIZE[dtype] == 0
        return FakeTensor(dtype, self.device, self.storage, 0, (nbytes // ITEMSIZE[dtype],), (1,))

    def as_strided(self, shape, strides, offset):
        """As torch: offset in elements, and the whole window within the storage."""
        CALLS["as_strided"] += 1
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides)) if 0 not in shape else offset - 1
        if (last + 1) * ITEMSIZE[self.dtype] > self.storage.nbytes:
            raise RuntimeError(f"as_strided: out of bounds for storage of size {self.storage.nbytes}")
        return FakeTensor(self.dtype, self.device, self.storage, offset, shape, strides)

    def data_ptr(self):
        return self.storage.data + self.offset * ITEMSIZE[self.dtype]


CALLS = {"from_dlpack": 0, "capsules": [], "views": 0, "as_strided": 0, "access": [], "fail": 0}


def access_at(ptr):
    """What device 0 may do at ptr now (CU_MEM_ACCESS_FLAGS_*: 0 none, 3 read-write), the driver asked."""
    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
    flags = ctypes.c_ulonglong(99)
    fake = ctypes.CDLL("libcuda.so.1")
    r = fake.cuMemGetAccess(ctypes.byref(flags), ctypes.byref(Location(1, 0)), ctypes.c_ulonglong(ptr))  # 1: DEVICE
    return flags.value if r == 0 else -1


def make_torch():
    calls = CALLS
    torch = types.ModuleType("torch")
    for name in ITEMSIZE:
        setattr(torch, name, name)

    def from_dlpack(capsule):
        calls["from_dlpack"] += 1
        if calls["fail"]:
            calls["fail"] -= 1
            raise RuntimeError("from_dlpack: refused (the test's)")
        address = _get_pointer(capsule, b"dltensor")
        t = _dlpack.DLManagedTensor.from_address(address).dl_tensor
        fields = dict(data=t.data, device=(t.device.device_type, t.device.device_id), ndim=t.ndim,
                      dtype=(t.dtype.code, t.dtype.bits), shape=tuple(t.shape[i] for i in range(t.ndim)))
        calls["capsules"].append(fields)
        calls["access"].append(access_at(t.data))
        _set_name(capsule, b"used_dltensor")
        storage = FakeStorage(address, t.data, t.shape[0], f"cuda:{t.device.device_id}")
        return FakeTensor("uint8", storage.device, storage, 0, (t.shape[0],), (1,))

    torch.from_dlpack = from_dlpack
    return torch, calls


def main():
    torch, calls = make_torch()
    sys.modules["torch"] = torch
    MiB = 1 << 20
    own = Owner("2", "2", "2")
    try:
        reg = vmmshim.Registry()
        (b0, _, _), (b1, _, _), (b2, _, _) = own.buffers
        mapped0 = harness.fakecuda_counters()["mappings_live"]
        ranges = [(b0, 4096), (b0 + 8192, 64 * 8), (b1 + 512, 1000), (b2, MiB)]
        bufs = reg.open_many(own.pid, ranges)
        views = {"w": bufs[0].view((32, 32), "float32"),
                 "ids": bufs[1].view((8, 8), "int64", strides=(1, 8)),
                 "mask": bufs[2].view(1000, "bool"),
                 "h": bufs[3].view((512, 1024), "bfloat16")}
        ptrs = {k: v.ptr for k, v in views.items()}
        live0 = _dlpack.live_exports()
        deleted0 = FakeStorage.deleted
        views0, strided0 = calls["views"], calls["as_strided"]
        tensors = vmmshim.to_torch(views)
        T.check(isinstance(tensors, dict) and list(tensors) == list(views),
                f"a dict with the same keys: {list(tensors)}")
        T.check(calls["views"] - views0 == 4 and calls["as_strided"] - strided0 == 4,
                f"one flat tensor per dtype (4 dtypes: {calls['views'] - views0}), one as_strided per view "
                f"({calls['as_strided'] - strided0})")
        spans = _torch.stretches([(v.device, v.ptr, v.nbytes) for v in views.values()])
        T.check(calls["from_dlpack"] == len(spans) == 1 and _dlpack.live_exports() == live0 + 1,
                f"one capsule for views of one open_many: {calls['from_dlpack']} taken, {len(spans)} stretches")
        cap = calls["capsules"][0]
        lo = min(ptrs.values())
        hi = max(v.ptr + v.nbytes for v in views.values())
        T.check(cap["data"] == lo - lo % 256 and cap["shape"] == (hi - cap["data"],) and cap["dtype"] == (1, 8) and
                cap["device"] == (2, 0), f"the stretch's capsule: {cap}, views over 0x{lo:x}..0x{hi:x}")
        for k, v in views.items():
            t = tensors[k]
            T.check(t.dtype == v.dtype and t.shape == v.shape and t.strides == v.strides and t.data_ptr() == v.ptr,
                    f"{k}: {t.dtype} {t.shape} {t.strides} at 0x{t.data_ptr():x} (the view: {v.dtype} {v.shape} "
                    f"{v.strides} at 0x{v.ptr:x})")
        del t, v
        # the stand-in tensors' pointers hold the owner's bytes (emulated device memory is host memory)
        T.check(ctypes.string_at(tensors["w"].data_ptr(), 64) == pattern(0, 0, 64) and
                ctypes.string_at(tensors["mask"].data_ptr(), 32) == pattern(1, 512, 32),
                "the tensors' first bytes are the owner's")
        as_list = vmmshim.to_torch([views["h"], views["w"]])
        T.check(isinstance(as_list, list) and [t.data_ptr() for t in as_list] == [ptrs["h"], ptrs["w"]],
                "a list gives a list in the same order")
        del as_list
        gc.collect()
        # the imports outlive the buffers and views while a tensor lives; the last one lets go
        for b in bufs:
            b.close()
        del bufs, views
        gc.collect()
        T.check(FakeStorage.deleted == deleted0 + 1 and _dlpack.live_exports() == live0 + 1,
                "the stretch's storage stays while its tensors live")
        T.check(ctypes.string_at(tensors["h"].data_ptr(), 16) == pattern(2, 0, 16),
                "a tensor reads the owner's bytes after its buffer and view are gone")
        keep = tensors["ids"]
        del tensors
        gc.collect()
        T.check(_dlpack.live_exports() == live0 + 1, "one tensor left holds the stretch")
        del keep
        gc.collect()
        T.check(FakeStorage.deleted == deleted0 + 2 and _dlpack.live_exports() == live0,
                f"the last tensor gone, the stretch's export is gone ({_dlpack.live_exports()} live, {live0} before)")
        vmmshim.drop_idle()  # the library's chunk cache: what no buffer, view or tensor holds is unmapped now
        T.check(harness.fakecuda_counters()["mappings_live"] == mapped0,
                f"and with it the imports: {harness.fakecuda_counters()['mappings_live'] - mapped0} mappings left")

        # views far apart: a stretch each (the gap, shrunk here, decides)
        bufs = reg.open_many(own.pid, [(b0, 4096), (b2, 4096)])
        far = [bufs[0].view(1024, "float32"), bufs[1].view(1024, "float32")]
        old, _torch.GAP = _torch.GAP, 0
        try:
            before = calls["from_dlpack"]
            got = vmmshim.to_torch(far)
            T.check(calls["from_dlpack"] - before == 2 and [t.data_ptr() for t in got] == [v.ptr for v in far],
                    f"two stretches for views {abs(far[1].ptr - far[0].ptr)} bytes apart with GAP 0")
        finally:
            _torch.GAP = old
        del got, far
        for b in bufs:
            b.close()
        del bufs
        gc.collect()
        T.check(vmmshim.to_torch({}) == {} and vmmshim.to_torch([]) == [], "no views: nothing taken")

        # Registry.open_torch: (address, dtype, shape[, strides]) straight to tensors, no Buffer or View
        vmmshim.drop_idle()
        live1, mapped1, taken1 = _dlpack.live_exports(), harness.fakecuda_counters()["mappings_live"], calls["from_dlpack"]
        specs = {"w": (b0 + 4096, "float32", (16, 16)), "t": (b1 + 1024, "int64", (4, 2), (1, 4)),
                 "h": (b2 + 2 * MiB - 64, "bfloat16", 32)}
        got, tm = reg.open_torch(own.pid, specs, timing=True)
        T.check(isinstance(got, dict) and list(got) == list(specs) and calls["from_dlpack"] - taken1 == 1 and
                _dlpack.live_exports() == live1 + 1 and tm["ranges"] == 3 and tm["library_ns"] > 0,
                f"open_torch: a dict, one capsule for three tensors of one call ({calls['from_dlpack'] - taken1}), "
                f"timing {tm.get('ranges')} ranges")
        T.check(got["w"].dtype == "float32" and got["w"].shape == (16, 16) and got["w"].strides == (16, 1) and
                got["t"].shape == (4, 2) and got["t"].strides == (1, 4) and got["h"].shape == (32,),
                f"open_torch: dtype, shape and strides as asked: {[(t.dtype, t.shape, t.strides) for t in got.values()]}")
        T.check(ctypes.string_at(got["w"].data_ptr(), 32) == pattern(0, 4096, 32) and
                ctypes.string_at(got["t"].data_ptr(), 32) == pattern(1, 1024, 32) and
                ctypes.string_at(got["h"].data_ptr(), 64) == pattern(2, 2 * MiB - 64, 64),
                "open_torch: each tensor reads the owner's bytes at its address")
        as_list = reg.open_torch(own.pid, [specs["h"], specs["w"]])
        T.check(isinstance(as_list, list) and [t.shape for t in as_list] == [(32,), (16, 16)],
                "open_torch: a list gives a list in the same order")
        del as_list, tm
        gc.collect()
        T.check(_dlpack.live_exports() == live1 + 1, "open_torch: the stretch stays while its tensors live")
        del got
        gc.collect()
        vmmshim.drop_idle()
        T.check(_dlpack.live_exports() == live1 and harness.fakecuda_counters()["mappings_live"] == mapped1,
                "open_torch: the last tensor gone, its imports and mappings are gone")
        # bad specs: one clear error, nothing imported or left behind
        T.raises(TypeError, lambda: reg.open_torch(own.pid, [(b0, "float32")]), "open_torch: a spec of two fields")
        T.raises(ValueError, lambda: reg.open_torch(own.pid, [(b0, "float32", (0, 4))]),
                 "open_torch: a tensor of no element", "at least one element")
        T.raises(ValueError, lambda: reg.open_torch(own.pid, [(b0 + 2, "float32", 4)]),
                 "open_torch: an address unaligned for the dtype", "aligned")
        T.raises(vmmshim.NotFound, lambda: reg.open_torch(own.pid, [(b0, "float32", 4), (0x10, "float32", 4)]),
                 "open_torch: an address in no allocation of pid")
        T.check(_dlpack.live_exports() == live1 and harness.fakecuda_counters()["mappings_live"] == mapped1,
                "open_torch: the refused calls left no import or mapping")

        # the tensors are made while the driver grants access (vmm_import_many_begin/_end): with each
        # cuMemSetAccess taking 0.6 s, the stretch is not accessible yet when its capsule is taken,
        # and it is when open_torch returns
        fake = ctypes.CDLL("libcuda.so.1")
        fake.fakecuda_set_access_delay_us(ctypes.c_ulonglong(600000))
        try:
            n_access = len(calls["access"])
            got = reg.open_torch(own.pid, specs)
            at_build = calls["access"][n_access:]
            T.check(at_build == [0] and access_at(got["w"].data_ptr()) == 3 and
                    ctypes.string_at(got["w"].data_ptr(), 32) == pattern(0, 4096, 32),
                    f"open_torch: tensors made before the grant (access then {at_build}), accessible after "
                    f"({access_at(got['w'].data_ptr())})")
            del got
            gc.collect()
            # a failure making the tensors: the job is ended and every import let go
            calls["fail"] = 1
            T.raises(RuntimeError, lambda: reg.open_torch(own.pid, specs), "open_torch: from_dlpack failing",
                     "refused (the test's)")
        finally:
            fake.fakecuda_set_access_delay_us(ctypes.c_ulonglong(0))
            calls["fail"] = 0
        gc.collect()
        vmmshim.drop_idle()
        T.check(_dlpack.live_exports() == live1 and harness.fakecuda_counters()["mappings_live"] == mapped1,
                "open_torch: after a failure making tensors, no import or mapping is left")
        # a grant that fails: an error naming it, the tensors made over the pointers dropped, nothing left
        fake.fakecuda_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        fake.fakecuda_fail_next(b"cuMemSetAccess", 1, 2)
        T.raises(vmmshim.Error, lambda: reg.open_torch(own.pid, specs), "open_torch: a failing grant",
                 "cuMemSetAccess")
        gc.collect()
        vmmshim.drop_idle()
        T.check(_dlpack.live_exports() == live1 and harness.fakecuda_counters()["mappings_live"] == mapped1,
                "open_torch: after a failing grant, no export, import or mapping is left")
    finally:
        own.kill()
        sys.modules.pop("torch", None)
    print(f"{T.passed} passed, {T.failed} failed")
    return 1 if T.failed else 0


if __name__ == "__main__":
    sys.exit(main())
