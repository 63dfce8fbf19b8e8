"""Registry.open(pid, address, size) and Buffer.view() over the emulated driver.  Owners run
tests/progs/owner (pooled cudaMalloc buffers) and tests/progs/own_vmm (a program that maps three
pages of two handles itself, as PyTorch's expandable segments do) under the shim.  Checks: a range
inside one allocation, across pooled allocations of one chunk and across a program's own
mappings reads the owner's bytes; the emulated driver's counters show what each open maps (an
allocation's chunk once however often it is opened; a range import its own mappings, gone at
close) and that a failed open leaves nothing behind; the DLPack capsule of a view (DLManagedTensor
read with ctypes: data, device, ndim, dtype, shape, strides, byte_offset) for every dtype and
several shapes, strides and offsets; __cuda_array_interface__; dtypes given as names, torch-like,
NumPy-like and Python types; bad views raise ValueError; a view and its tensors keep the import
alive after close() and after the Buffer is dropped.  Ends with "N passed, N failed"."""
import ctypes
import gc
import os
import re
import shutil
import signal
import subprocess
import weakref

import harness
from harness import BUILD, ROOT, Owner, fnv1a, pattern

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)
from vmmshim import _dlpack  # noqa: E402

T = harness.Tally()
MiB = 1 << 20

def counters():
    return harness.fakecuda_counters()


def delta(before, after, *names):
    return tuple(after[n] - before[n] for n in names)


# ---- a consumer's reading of a capsule, through the C API as torch.from_dlpack does ----------

_api = ctypes.PyDLL(None)
_get_pointer = _api.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_set_name = _api.PyCapsule_SetName
_set_name.restype, _set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]


def parse(capsule):
    """(the DLManagedTensor's address, its fields as a dict)."""
    address = _get_pointer(capsule, b"dltensor")
    t = _dlpack.DLManagedTensor.from_address(address).dl_tensor
    return address, {
        "data": t.data, "device": (t.device.device_type, t.device.device_id), "ndim": t.ndim,
        "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes), "shape": tuple(t.shape[i] for i in range(t.ndim)),
        "strides": tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None, "byte_offset": t.byte_offset}


def consume(capsule):
    """Take the tensor as a consumer does: rename the capsule; returns its deleter's call."""
    address, fields = parse(capsule)
    _set_name(capsule, b"used_dltensor")
    managed = _dlpack.DLManagedTensor.from_address(address)
    return fields, lambda: managed.deleter(address)


# ---- owners ------------------------------------------------------------------------------------


class OwnVmm:
    """tests/progs/own_vmm hold under the shim: one page of handle 1, then two pages of handle 2,
    mapped back to back at va; byte k is (k*7+3) & 0xff.  step() lets it go on: after the first,
    it has released handle 1 (still mapped); after the second, unmapped everything."""

    def __init__(self):
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(BUILD / "libvmmshim.so")) if p)
        self.proc = subprocess.Popen([str(BUILD / "progs" / "own_vmm"), "hold"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self._out = Owner.__new__(Owner)  # borrow Owner's line reader
        self._out.proc, self._out._pending = self.proc, b""
        self.pid = self.proc.pid
        line = ""
        while True:
            line = self._out.readline(60)
            if not line or line.startswith("ready "):
                break
        parts = line.split()
        if len(parts) != 6:
            self.end()
            raise RuntimeError(f"own_vmm did not start: {line!r}")
        self.va, self.page, self.fnv = int(parts[2], 16), int(parts[3]), parts[5]

    def step(self, until):
        self.proc.stdin.write(b"next\n")
        while True:
            line = self._out.readline(30)
            if not line or line.startswith(until):
                return line

    def end(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def own_pattern(start, length):
    return bytes(((start + k) * 7 + 3) & 0xFF for k in range(length))


# ---- open(pid, address, size) -----------------------------------------------------------------


def test_range_in_one_allocation(reg, own):
    address, size, _ = own.buffers[0]
    c0 = counters()
    with reg.open(own.pid, address) as whole, reg.open(own.pid, address + 4096, 10000) as part:
        c1 = counters()
        T.check(part.size == 10000 and part.address == address + 4096 and part.ptr == whole.ptr + 4096 and
                part.allocation.address == address and [a.address for a in part.allocations] == [address],
                f"a range inside one allocation: {part} vs {whole}")
        T.check(part.read() == pattern(0, 4096, 10000) and part.read(9990, 10) == pattern(0, 4096 + 9990, 10),
                "its bytes are the owner's from the range's start")
        T.raises(vmmshim.InvalidArgument, lambda: part.read(9990, 11), "a read past the range's end", "10000")
        # the chunk is imported once: the whole-allocation open mapped it, the range shares it
        T.check(delta(c0, c1, "imports", "mappings_live") == (1, 1),
                f"two overlapping opens of one allocation import and map its chunk once: "
                f"{delta(c0, c1, 'imports', 'mappings_live')}")
        with reg.open(own.pid, address + 8192, 4096) as again:
            T.check(delta(c1, counters(), "imports", "mappings_live") == (0, 0) and again.ptr == whole.ptr + 8192,
                    "a third overlapping open maps nothing more")
        part.check()
        with reg.open(own.pid, address, 100) as head:
            T.check(head.ptr == whole.ptr and head.read() == pattern(0, 0, 100), "a range at the allocation's start")
            T.raises(vmmshim.InvalidArgument, lambda: head.read(50, 51), "a read past its end, at offset 0", "100")
    T.check(counters()["handles_live"] >= c0["handles_live"], "counters readable after close")


def test_range_across_pooled(reg, pooled):
    (a0, s0, _), (a1, s1, _) = pooled.buffers[0], pooled.buffers[1]
    recs = reg.allocations(pooled.pid)
    T.check(recs[0].chunk_id == recs[1].chunk_id and recs[0].address + recs[0].extent == recs[1].address,
            f"the owner's first two buffers lie back to back in one chunk: {recs[:2]}")
    start, end = a0 + 100, a1 + 500
    c0 = counters()
    with reg.open(pooled.pid, start, end - start) as buf:
        c1 = counters()
        T.check(buf.size == end - start and [a.address for a in buf.allocations] == [a0, a1],
                f"a range across two pooled allocations: {buf} {buf.allocations}")
        data = buf.read()
        T.check(data[:s0 - 100] == pattern(0, 100, s0 - 100) and data[a1 - start:] == pattern(1, 0, 500),
                "its bytes are both allocations' at their places")
        T.check(delta(c0, c1, "imports", "mappings_live", "reservations_live") == (1, 1, 1),
                f"one chunk, one mapping: {delta(c0, c1, 'imports', 'mappings_live', 'reservations_live')}")
        buf.check()
    T.check(delta(c0, counters(), "mappings_live", "reservations_live", "handles_live") == (0, 0, 0),
            "close() of a range import unmaps it and frees its reservation")
    # the owner dies while a range is held: a range inside it is refused as a first open would be
    held = reg.open(pooled.pid, start, end - start)
    pooled.kill()
    T.raises(vmmshim.OwnerDead, lambda: reg.open(pooled.pid, start + 10, a1 + 100 - start - 10),
             "a range inside a held one, of a killed owner", str(pooled.pid))
    T.check(held.read(0, 16) == pattern(0, 100, 16), "the held range reads after its owner died")
    T.raises(vmmshim.OwnerDead, held.check, "check() of a range whose owner died", str(pooled.pid))
    held.close()
    T.check(delta(c0, counters(), "mappings_live", "reservations_live") == (0, 0), "and is released at close()")


def test_range_across_mappings(reg):
    own = OwnVmm()
    try:
        va, page = own.va, own.page
        recs = reg.allocations(own.pid)
        T.check([(a.address, a.api) for a in recs] == [(va, "cuMemMap"), (va + page, "cuMemMap")],
                f"own_vmm's two mappings are published: {recs}")
        keys = ("imports", "mappings_live", "reservations_live")
        c0 = counters()
        first = reg.open(own.pid, va, page + 4096)
        c1 = counters()
        T.check(first.size == page + 4096 and first.address == va and len(first.allocations) == 2 and
                first.read() == own_pattern(0, page + 4096),
                f"a range from the first mapping into the second: {first} {first.allocations}")
        T.check(delta(c0, c1, *keys) == (2, 2, 1),
                f"two handles, each mapped once, in one reservation: {delta(c0, c1, *keys)}")
        edge = reg.open(own.pid, va + page - 100, 200)
        c2 = counters()
        T.check(edge.read() == own_pattern(page - 100, 200) and edge.ptr == first.ptr + page - 100 and
                len(edge.allocations) == 2, "a range across the handles' boundary, inside the first")
        T.check(delta(c1, c2, *keys) == (0, 0, 0),
                f"a range inside one imported already shares its mappings: {delta(c1, c2, *keys)}")
        # a range reaching past every range imported here: one contiguous mapping needs a
        # reservation of its own (vmm_import_range shares nothing), so its handles are mapped again
        whole = reg.open(own.pid, va, 3 * page)
        c3 = counters()
        T.check(whole.size == 3 * page and len(whole.allocations) == 2 and fnv1a(whole.read()) == own.fnv,
                f"a range over both mappings: the program's three pages (fnv): {whole}")
        T.check(delta(c2, c3, *keys) == (2, 2, 1),
                f"a range past the ones imported maps its own: {delta(c2, c3, *keys)}")
        inside = reg.open(own.pid, va + 2 * page + 10, 1000)
        inside2 = reg.open(own.pid, va + 2 * page + 500, 1000)
        T.check(inside.read() == own_pattern(2 * page + 10, 1000) and inside2.ptr == inside.ptr + 490 and
                inside.ptr == whole.ptr + 2 * page + 10 and delta(c3, counters(), *keys) == (0, 0, 0),
                f"ranges inside one mapping, inside the whole range: its mappings: {delta(c3, counters(), *keys)}")
        T.raises(vmmshim.InvalidArgument, lambda: edge.read(100, 101), "a read past a shared range's end", "200")
        first.close()
        T.check(edge.read(0, 8) == own_pattern(page - 100, 8) and delta(c0, counters(), "mappings_live")[0] == 4,
                "closing the range a later open shares keeps its mappings for it")
        edge.close()
        T.check(delta(c0, counters(), "mappings_live", "reservations_live") == (2, 1),
                "the last Buffer of a range releases it")
        whole.check()
        edge.close()
        inside2.close()

        readme_view(own)

        # failures: clear errors, nothing left mapped or imported
        c4 = counters()
        T.raises(vmmshim.NotFound, lambda: reg.open(own.pid, va, 4 * page), "a range past the mappings",
                 f"no live allocation at 0x{va + 3 * page:x}")
        T.raises(vmmshim.NotFound, lambda: reg.open(own.pid, va - page, 2 * page), "a range starting before them",
                 "no live allocation")
        T.raises(ValueError, lambda: reg.open(own.pid, va, 0), "size 0", "size > 0")
        T.raises(ValueError, lambda: reg.open(own.pid, va, -5), "a negative size")
        T.raises(TypeError, lambda: reg.open(own.pid, va, 1.5), "a float size", "integer")
        T.check(delta(c4, counters(), "imports_live", "mappings_live", "reservations_live", "handles_live",
                      "fds_open") == (0, 0, 0, 0, 0),
                f"failed opens leave nothing behind: {delta(c4, counters(), 'imports_live', 'mappings_live', 'reservations_live', 'handles_live', 'fds_open')}")

        # the program unmaps and releases everything: the imports still read, check() says Stale
        own.step("released")
        whole.check()
        own.step("unmapped")
        T.raises(vmmshim.Stale, whole.check, "check() of a range whose mappings the program undid",
                 f"0x{va:x}")
        T.check(fnv1a(whole.read()) == own.fnv, "a range import reads after the program unmapped it")
        view = whole.view((3, page // 4), "int32")
        whole.close()
        inside.close()
        T.check(ctypes.string_at(view.ptr + page, 8) == own_pattern(page, 8), "a view of it outlives close()")
        del view
        gc.collect()
        T.check(delta(c0, counters(), "mappings_live", "reservations_live", "handles_live") == (0, 0, 0),
                f"everything unmapped once the view is gone: "
                f"{delta(c0, counters(), 'mappings_live', 'reservations_live', 'handles_live')}")
        own.step("")
    finally:
        own.end()


class StandInTorch:
    """torch.from_dlpack as far as the README's example needs it: takes the capsule as a
    consumer does and hands back its fields (and the deleter a tensor's death would call)."""

    class Tensor:
        def __init__(self, fields, delete):
            self.fields, self.delete = fields, delete
            self.shape = fields["shape"]

    @classmethod
    def from_dlpack(cls, obj):
        return cls.Tensor(*consume(obj.__dlpack__()))


def readme_view(own):
    """The README's view example, as it stands there, over own_vmm's two mappings."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- python-view -->\n```python\n(.*?)```\n", readme, re.S)
    if not T.check(len(blocks) == 1, f"README.md has {len(blocks)} ```python blocks after <!-- python-view -->"):
        return
    T.check(3 * own.page == 3072 * 1024 * 2, f"own_vmm's three pages are the example's 6 MiB ({own.page})")
    space = {"vmmshim": vmmshim, "torch": StandInTorch, "pid": own.pid, "address": own.va}
    try:
        exec(compile(blocks[0], "README.md (python-view)", "exec"), space)
    except Exception as e:
        T.check(False, f"the README's view example raised {type(e).__name__}: {e}")
        return
    buf, w = space["buf"], space["w"]
    f = w.fields
    T.check(f["shape"] == (3072, 1024) and f["strides"] == (1024, 1) and f["dtype"] == (4, 16, 1) and
            f["data"] == buf.ptr and f["device"] == (2, 0) and buf.size == 3 * own.page and len(buf.allocations) == 2,
            f"the README's view example: {f}, {buf}")
    T.check(ctypes.string_at(f["data"] + own.page - 8, 16) == own_pattern(own.page - 8, 16),
            "the README example's tensor reads the program's bytes across its two handles")
    buf.close()
    T.check(buf._imp is not None, "the example's tensor holds the import")
    w.delete()
    gc.collect()
    T.check(buf._imp is None, "its deleter releases it")


# ---- views ------------------------------------------------------------------------------------

DLCODES = {"bool": (6, 8), "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8),
           "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16),
           "float8_e4m3fn": (10, 8), "float8_e5m2": (12, 8)}


def row_major(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.insert(0, step)
        step *= n
    return tuple(out)


def test_capsules(reg, own):
    address, size, _ = own.buffers[0]
    buf = reg.open(own.pid, address)
    before = _dlpack.live_exports()
    cases = 0
    for name, (code, bits) in DLCODES.items():
        item = bits // 8
        for shape, strides, offset in [((16,), None, 0), ((4, 8), None, item * 8), ((2, 3, 5), None, 256),
                                       ((4, 4), (1, 4), 0), ((3, 2), (8, 2), item * 3), ((), None, item),
                                       ((0, 5), None, 0), ((7, 1), (1, 0), 0)]:
            v = buf.view(shape, name, offset=offset, strides=strides)
            cap = v.__dlpack__()
            _, f = parse(cap)
            want_strides = row_major(shape) if strides is None else strides
            ok = T.check(f == {"data": buf.ptr + offset, "device": (2, 0), "ndim": len(shape),
                               "dtype": (code, bits, 1), "shape": shape, "strides": want_strides, "byte_offset": 0},
                         f"{name} {shape} strides {strides} offset {offset}: {f}")
            if ok and len(shape) and all(shape):
                T.check(ctypes.string_at(f["data"], item) == pattern(0, offset, item),
                        f"{name} {shape}: the first element is the owner's byte at offset {offset}")
            T.check((v.shape, v.strides, v.dtype, v.dlpack_dtype, v.offset, v.ptr) ==
                    (shape, want_strides, name, (code, bits, 1), offset, buf.ptr + offset), f"{name}: the view's fields")
            del cap, v
            cases += 1
    gc.collect()
    T.check(_dlpack.live_exports() == before and buf._exports == 0,
            f"{cases} unconsumed capsules and their views are all let go: {_dlpack.live_exports()} {buf._exports}")
    # an int is a 1-D shape; lists are taken for tuples
    v = buf.view(10, "float32", strides=[1])
    T.check(v.shape == (10,) and v.strides == (1,) and v.nbytes == 40, f"shape 10: {v}")
    T.check(buf.view((4, 5), "float32", strides=(5, 1)).nbytes == 80 and
            buf.view((4, 5), "int8", strides=(10, 2)).nbytes == 39, "nbytes spans first to last element")
    T.check(v.__dlpack_device__() == (2, 0), "the view's __dlpack_device__")
    T.raises(BufferError, lambda: v.__dlpack__(copy=True), "a view's copy=True", "without copying")
    T.raises(BufferError, lambda: v.__dlpack__(dl_device=(1, 0)), "a view to another device")
    cap = v.__dlpack__(stream=1, max_version=(1, 1), dl_device=(2, 0))
    T.check(parse(cap)[1]["shape"] == (10,), "stream, max_version and dl_device are taken")
    del cap, v
    # a view of a range that starts inside an allocation points at the range's bytes
    with reg.open(own.pid, address + 4096, 8192) as part:
        _, f = parse(part.view((2, 512), "float32", offset=64).__dlpack__())
        T.check(f["data"] == part.ptr + 64 and ctypes.string_at(f["data"], 4) == pattern(0, 4096 + 64, 4),
                f"a view of a range opened at an interior address: {f}")
        # the buffer's own export stays 1-D uint8 of its size
        _, f = parse(part.__dlpack__())
        T.check(f["dtype"] == (1, 8, 1) and f["shape"] == (8192,) and f["data"] == part.ptr,
                f"a range's own capsule: {f}")
    gc.collect()
    buf.close()


def test_cuda_array_interface(reg, own):
    address, size, _ = own.buffers[0]
    with reg.open(own.pid, address) as buf:
        cai = buf.view((4, 8), "float32", offset=128).__cuda_array_interface__
        T.check(cai == {"version": 3, "shape": (4, 8), "typestr": "<f4", "data": (buf.ptr + 128, False),
                        "strides": None, "descr": [("", "<f4")], "stream": None},
                f"a contiguous float32 view: {cai}")
        cai = buf.view((4, 4), "int16", strides=(1, 4)).__cuda_array_interface__
        T.check(cai["strides"] == (2, 8) and cai["typestr"] == "<i2" and cai["shape"] == (4, 4),
                f"a transposed int16 view: strides in bytes: {cai}")
        cai = buf.view((3, 1, 2), "float64", strides=(2, 99, 1)).__cuda_array_interface__
        T.check(cai["strides"] is None, f"a dimension of 1 with any stride is still contiguous: {cai}")
        for name, typestr in (("bool", "|b1"), ("uint8", "|u1"), ("int8", "|i1"), ("int64", "<i8"),
                              ("float16", "<f2"), ("int32", "<i4"), ("float64", "<f8")):
            T.check(buf.view(8, name).__cuda_array_interface__["typestr"] == typestr, f"{name}'s typestr")
        T.check(buf.view((0, 3), "float32").__cuda_array_interface__["data"] == (0, False), "an empty view's data")
        for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            v = buf.view(8, name)
            T.check(not hasattr(v, "__cuda_array_interface__") and hasattr(v, "__dlpack__"),
                    f"{name} (no NumPy typestr) offers DLPack only")
            T.raises(AttributeError, lambda: v.__cuda_array_interface__, f"{name}'s interface", "DLPack")
        gc.collect()


class FakeTorchDtype:
    """Stands in for torch.dtype, which str()s as "torch.<name>"."""

    def __init__(self, name):
        self.name_ = name

    def __str__(self):
        return f"torch.{self.name_}"


FakeTorchDtype.__module__ = "torch"


class FakeNumpyDtype:
    """Stands in for numpy.dtype: .name, .byteorder."""

    def __init__(self, name, byteorder="="):
        self.name, self.byteorder = name, byteorder


def test_dtypes(reg, own):
    address, _, _ = own.buffers[0]
    with reg.open(own.pid, address) as buf:
        forms = [("bfloat16", "bfloat16"), ("BFloat16", "bfloat16"), ("bf16", "bfloat16"), ("half", "float16"),
                 ("f4", "float32"), ("double", "float64"), ("bool_", "bool"), (FakeTorchDtype("bfloat16"), "bfloat16"),
                 (FakeTorchDtype("float8_e4m3fn"), "float8_e4m3fn"), (FakeTorchDtype("bool"), "bool"),
                 (FakeNumpyDtype("float16"), "float16"), (FakeNumpyDtype("uint8", "|"), "uint8"),
                 (type("float32", (), {}), "float32"), (type("float8_e5m2", (), {}), "float8_e5m2"),
                 (bool, "bool"), (float, "float64"), (int, "int64")]
        for given, name in forms:
            try:
                got = buf.view(4, given).dtype
            except Exception as e:
                got = f"{type(e).__name__}: {e}"
            T.check(got == name, f"dtype {given!r}: {got}, not {name}")
        T.raises(ValueError, lambda: buf.view(4, "complex64"), "an unsupported dtype", "complex64")
        T.raises(ValueError, lambda: buf.view(4, FakeTorchDtype("complex64")), "an unsupported torch dtype",
                 "complex64")
        T.raises(ValueError, lambda: buf.view(4, FakeNumpyDtype("float32", ">")), "a big-endian dtype", "big-endian")
        T.raises(TypeError, lambda: buf.view(4, 3.5), "no dtype at all", "not a dtype")
        gc.collect()


def test_bad_views(reg, own):
    address, size, _ = own.buffers[0]
    with reg.open(own.pid, address + 4096, 4096) as buf:
        T.check(buf.view(1024, "float32").nbytes == 4096 and buf.view(1, "float64", offset=4088).nbytes == 8,
                "views up to the last byte")
        T.raises(ValueError, lambda: buf.view(1025, "float32"), "one element past the end", "past the end")
        T.raises(ValueError, lambda: buf.view(2, "float64", offset=4088), "a view running past the end", "4096")
        T.raises(ValueError, lambda: buf.view((32, 32), "float32", strides=(33, 1)), "strides reaching past the end",
                 "past the end")
        T.raises(ValueError, lambda: buf.view(1, "uint8", offset=4096), "offset at the end", "past the end")
        T.check(buf.view(0, "uint8", offset=4096).nbytes == 0, "an empty view at the end")
        T.raises(ValueError, lambda: buf.view(0, "uint8", offset=4097), "an empty view past the end")
        T.raises(ValueError, lambda: buf.view(4, "float32", offset=-4), "a negative offset", "negative offset")
        T.raises(ValueError, lambda: buf.view(4, "float32", offset=2), "a misaligned offset", "not aligned")
        T.raises(ValueError, lambda: buf.view(4, "int64", offset=4), "an int64 at a 4-byte offset", "not aligned")
        T.raises(ValueError, lambda: buf.view(4, "bfloat16", offset=1), "a misaligned bfloat16", "not aligned")
        T.raises(ValueError, lambda: buf.view((2, 2), "float32", strides=(2,)), "too few strides", "1 strides")
        T.raises(ValueError, lambda: buf.view((2, 2), "float32", strides=(2, 1, 1)), "too many strides")
        T.raises(ValueError, lambda: buf.view((2, 2), "float32", strides=(-2, 1)), "a negative stride", "negative")
        T.raises(ValueError, lambda: buf.view((2, 2), "float32", strides=3), "strides not a tuple")
        T.raises(TypeError, lambda: buf.view((2, 2), "float32", strides=(2.0, 1)), "a float stride", "integer")
        T.raises(ValueError, lambda: buf.view((2, -1), "float32"), "a negative extent", "negative extent")
        T.raises(TypeError, lambda: buf.view((2, "x"), "float32"), "a shape of strings", "integer")
        T.raises(TypeError, lambda: buf.view(2, "float32", offset=1.0), "a float offset", "integer")
    with reg.open(own.pid, address + 1, 64) as odd:
        T.check(odd.view(8, "uint8").ptr == odd.ptr, "a byte view of an odd address")
        T.raises(ValueError, lambda: odd.view(4, "int16"), "an int16 view at an odd device address", "not aligned")
    buf.close()
    T.raises(ValueError, lambda: buf.view(4, "float32"), "a view of a closed buffer", "closed")
    gc.collect()


def test_lifetime(reg, own):
    address, size, fnv = own.buffers[0]
    before = _dlpack.live_exports()
    # the view outlives the Buffer object
    buf = reg.open(own.pid, address)
    ref = weakref.ref(buf)
    view = buf.view((size // 4,), "int32")
    del buf
    gc.collect()
    T.check(ref() is not None and view.buffer._imp is not None, "a view keeps its Buffer and the import")
    T.check(fnv1a(ctypes.string_at(view.ptr, size)) == fnv, "the view's bytes after the Buffer is dropped")
    # a tensor taken from the view outlives the view too
    fields, delete = consume(view.__dlpack__())
    del view
    gc.collect()
    T.check(ref() is not None and ref()._imp is not None and _dlpack.live_exports() == before + 1,
            "the tensor keeps the import after the view is gone")
    T.check(ctypes.string_at(fields["data"], 64) == pattern(0, 0, 64), "the tensor's bytes")
    delete()
    gc.collect()
    T.check(ref() is None and _dlpack.live_exports() == before, "the tensor's deleter lets it all go")

    # close() with a live view: the import stays until the view is gone
    buf = reg.open(own.pid, address + 4096, 4096)
    view = buf.view((2, 512), "float32")
    buf.close()
    T.raises(ValueError, buf.read, "the closed buffer itself", "closed")
    T.check(buf._imp is not None and ctypes.string_at(view.ptr, 16) == pattern(0, 4096, 16),
            "close() with a live view keeps the import")
    cap = view.__dlpack__()
    T.check(parse(cap)[1]["shape"] == (2, 512), "a closed buffer's view still exports")
    del view
    gc.collect()
    T.check(buf._imp is not None, "its unconsumed capsule still holds the import")
    del cap
    gc.collect()
    T.check(buf._imp is None and buf._exports == 0, "the last export gone, close() takes effect")


def main():
    own = pooled = None
    try:
        own = Owner("3")
        pooled = Owner("0.01", "0.01")
        reg = vmmshim.Registry()
        test_range_in_one_allocation(reg, own)
        test_range_across_pooled(reg, pooled)
        test_range_across_mappings(reg)
        test_capsules(reg, own)
        test_cuda_array_interface(reg, own)
        test_dtypes(reg, own)
        test_bad_views(reg, own)
        test_lifetime(reg, own)
        reg.close()
    finally:
        for o in (own, pooled):
            if o:
                o.end()
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
