"""PyTorch tensors of imported memory, one DLPack import per stretch of it: vmmshim.to_torch
(views in, tensors out) and Registry.open_torch (another process's tensors in one call).

On an H100 host torch.from_dlpack costs about 10 us a call (its stream handshake and a tensor of
its own for each), most of what taking a whole model cost (issue 16).  Pieces of memory that lie
near each other here (open_many maps one call's chunks into one reservation) share one uint8
tensor over their stretch, taken with a single capsule; each tensor is then that storage seen
with its dtype, offset, shape and strides, as PyTorch's own rebuild_cuda_tensor reuses one storage
for every tensor of a segment.  Torch never reads the bytes between them.  Each tensor is one
as_strided of a flat tensor of its dtype over the stretch (one per dtype and stretch).

open_torch goes from (address, dtype, shape, strides) to tensors with no Buffer or View object
per tensor: on an H100 those, and closing the Buffers, were a third of a GPT-2 take."""
import ctypes
import time

from . import _dlpack, _dtypes, _lib

GAP = 1 << 30  # pieces farther apart than this start a stretch of their own
ALIGN = 256    # a stretch starts at a multiple of this: every dtype's offset into it is whole


class _Stretch:
    """The exports of every buffer under one stretch, let go together once its storage is
    deleted (the capsule's deleter calls _export_freed)."""

    def __init__(self, buffers):
        self.buffers = buffers
        for b in buffers:
            b._export_taken()

    def _export_freed(self):
        for b in self.buffers:
            b._export_freed()


class _Imports:
    """open_torch's imports under one stretch (vmm_imported pointers), released together once
    its storage is deleted."""

    def __init__(self, imps):
        self.imps = imps

    def _export_freed(self):
        imps, self.imps = self.imps, []
        release = _lib.lib().vmm_import_release
        for imp in imps:
            release(imp)


def stretches(pieces):
    """[(device, start, end, [indexes into pieces])] of (device, ptr, nbytes) pieces, sorted by
    device and pointer, a new stretch wherever the next piece starts more than GAP past the end
    of the one before."""
    out = []
    last = None
    for i in sorted(range(len(pieces)), key=pieces.__getitem__):  # by device, then pointer
        device, ptr, nbytes = pieces[i]
        if last and last[0] == device and ptr - last[2] <= GAP:
            if ptr + nbytes > last[2]:
                last[2] = ptr + nbytes
            last[3].append(i)
        else:
            last = [device, ptr - ptr % ALIGN, ptr + nbytes, [i]]
            out.append(last)
    return out


def _tensors(torch, owner, device, start, end, members, out, layout):
    """Tensors of one stretch into out[i] for i in members, layout(i) giving (dtype, shape, strides,
    ptr); owner._export_freed() runs once the stretch's storage is deleted."""
    capsule = _dlpack.capsule(owner, start, end - start, device)
    raw = torch.from_dlpack(capsule)  # uint8, the whole stretch
    flats = {}  # DType: the stretch as a flat tensor of that dtype
    for i in members:
        dt, shape, strides, ptr = layout(i)
        flat = flats.get(dt)
        if flat is None:
            flat = flats[dt] = raw[:(end - start) // dt.itemsize * dt.itemsize].view(getattr(torch, dt.name))
        out[i] = flat.as_strided(shape, strides, (ptr - start) // dt.itemsize)


def to_torch(views):
    """Tensors of the views (Buffer.view, Registry.open_tensors): a dict of them for a dict, else a
    list in the same order.  Zero-copy, like torch.from_dlpack of each view, but one DLPack import
    serves every view of a stretch; the tensors of a stretch share one storage, and all the imports
    under it stay until the last of those tensors is gone."""
    import torch

    keys = list(views) if isinstance(views, dict) else None
    vs = [views[k] for k in keys] if keys is not None else list(views)
    out = [None] * len(vs)
    for device, start, end, members in stretches([(v.device, v.ptr, v.nbytes) for v in vs]):
        owner = _Stretch(list({id(vs[i].buffer): vs[i].buffer for i in members}.values()))
        try:
            _tensors(torch, owner, device, start, end, members, out,
                     lambda i: (vs[i]._dtype, vs[i].shape, vs[i].strides, vs[i].ptr))
        except BaseException:
            owner._export_freed()
            raise
    return dict(zip(keys, out)) if keys is not None else out


def _table_rows(raw, pid):
    """([names], [rows]) of every tensor in vmm_list_tensors' array raw, straight from the owner's
    name table: the owner checked each layout when it published, and the table gives nbytes, so no
    Tensor object is made and no layout is worked out again (on an H200 host Registry.tensors'
    objects were a tenth of a GPT-2 take).  A loop of as few steps a row as it can be."""
    m = _lib.MAX_DIMS
    dtype_of = _dtypes.BY_DLPACK.get
    names, rows = [], []
    for f in _lib.TENSOR_UNPACK.iter_unpack(raw):
        raw_name = f[0]
        name = raw_name[:raw_name.find(b"\0")].decode("utf-8", "replace")  # the library ends every name with a NUL
        dt = dtype_of(f[2:5]) or _dtypes.of_published(name, pid, f[2:5])
        n = f[5] if f[5] <= m else m
        names.append(name)
        rows.append((f[6], f[7], dt, f[8:8 + n], f[8 + m:8 + m + n], f[8 + 2 * m]))
    return names, rows


def _check_rows(rows):
    for address, nbytes, dt, shape, _, _ in rows:
        if address <= 0 or nbytes == 0 or address % dt.itemsize:
            raise ValueError(f"vmmshim: open_torch takes tensors of at least one element at an address aligned for "
                             f"their dtype, not {dt.name}{list(shape)} at 0x{address:x}")


def _row(spec):
    """(address, nbytes, dtype, shape, strides, alloc_id bytes or None) of one open_torch spec."""
    from . import _index, _layout
    if not isinstance(spec, tuple):  # a Tensor of Registry.tensors: its layout as the owner published it
        dt = _dtypes.resolve(spec.dtype)
        return spec.address, spec.nbytes, dt, spec.shape, spec.strides, bytes.fromhex(spec.alloc_id)
    if not 3 <= len(spec) <= 4:
        raise TypeError(f"vmmshim: open_torch wants (address, dtype, shape[, strides]), not {spec!r}")
    address, dtype, shape, strides = (spec + (None,))[:4]
    dt = _dtypes.resolve(dtype)
    shape, strides, nbytes = _layout(shape, strides, dt)
    return _index(address, "address"), nbytes, dt, shape, strides, None


def _begin_all(reg, pid):
    """vmm_import_tensors_begin of every tensor pid publishes: (the tensor table's bytes, n, the
    begun import's descriptions, its job); no job when there is no tensor."""
    from . import _check
    begin, n, job, room = _lib.lib().vmm_import_tensors_begin, ctypes.c_size_t(), ctypes.c_void_p(), 256
    while True:
        raw = ctypes.create_string_buffer(room * _lib.TENSOR_UNPACK.size)
        begun = ctypes.create_string_buffer(room * _lib.IMPORT_DESC.size)
        _check(begin(reg._h(), pid, raw, room, ctypes.byref(n), begun, ctypes.byref(job)))
        if n.value <= room:
            break
        room = n.value + 64  # more names than room: again, with room for them and some more
    return memoryview(raw).cast("B")[:n.value * _lib.TENSOR_UNPACK.size], n.value, begun.raw[:n.value * _lib.IMPORT_DESC.size], job


def open_torch(reg, pid, tensors, timing):
    """Registry.open_torch (see there)."""
    from . import _check, _timing_of
    import torch

    t0 = time.perf_counter_ns()
    L = _lib.lib()
    c_timing, t_lib, t_before, t_build, t_wait, t_names = None, 0, 0, 0, 0, 0
    if tensors is None:
        # One call lists the names and begins their import from the records the table points at;
        # the rows (names, dtypes, shapes) are read while the library's thread grants access.
        raw, n, begun, job = _begin_all(reg, pid)
        t_lib = time.perf_counter_ns() - t0
        keys, rows = [], None
    else:
        keys = list(tensors) if isinstance(tensors, dict) else None
        rows = [_row(tensors[k]) for k in keys] if keys is not None else [_row(t) for t in tensors]
        _check_rows(rows)
        n = len(rows)
        if n:
            addresses = (_lib.c_u64 * n)(*(r[0] for r in rows))
            sizes = (_lib.c_u64 * n)(*(r[1] for r in rows))
            described = ctypes.create_string_buffer(n * _lib.IMPORT_DESC.size)
            job = ctypes.c_void_p()
            t1 = time.perf_counter_ns()
            t_before = t1 - t0
            status = L.vmm_import_many_begin(reg._h(), pid, addresses, sizes, n, described, ctypes.byref(job))
            t_lib = time.perf_counter_ns() - t1
            _check(status)
            begun = described.raw
    out = [None] * n
    if n:
        imps = (_lib._P * n)()
        t_build = time.perf_counter_ns()
        # The driver grants access on the library's thread meanwhile: the tensors are made over the
        # pointers (nothing touches the memory), their stretches' owners holding no import until the
        # end says the memory is there.
        try:
            if rows is None:
                t1 = time.perf_counter_ns()
                keys, rows = _table_rows(raw, pid)
                _check_rows(rows)
                t_names = time.perf_counter_ns() - t1
            owners = _build(torch, pid, rows, begun, out)
        except BaseException:
            _end(L, job, imps, n)
            raise
        t1 = time.perf_counter_ns()
        t_build = t1 - t_build
        status = L.vmm_import_many_end(job, imps)
        t_wait = time.perf_counter_ns() - t1
        t_lib += t_wait
        _check(status)
        try:
            if timing:
                c_timing = _lib.ManyTiming()
                L.vmm_import_many_last_timing(c_timing)
            ended = ctypes.create_string_buffer(n * _lib.IMPORT_DESC.size)
            _check(L.vmm_import_describe(imps, n, ended))
            if ended.raw != begun:  # another thread mapped a chunk first: its mapping serves
                out[:] = [None] * n
                owners = _build(torch, pid, rows, ended.raw, out)
        except BaseException:
            for i in range(n):
                L.vmm_import_release(imps[i])
            raise
        for owner, members in owners:
            owner.imps = [imps[i] for i in members]
    result = dict(zip(keys, out)) if keys is not None else out
    if not timing:
        return result
    times = _timing_of(c_timing, time.perf_counter_ns() - t0, t_lib)
    times.update(names_ns=t_names, before_ns=t_before, build_ns=t_build, end_ns=t_wait)
    return result, times


def _build(torch, pid, rows, described, out):
    """open_torch's tensors into out over the places described (vmm_import_desc each); the
    [(_Imports, members)] of their stretches, each holding no import yet."""
    from . import Stale
    pieces = []  # (device, ptr, nbytes)
    for row, (ptr, _, device, n_records, alloc_id) in zip(rows, _lib.IMPORT_DESC.iter_unpack(described)):
        # the allocation imported is the one the name was read from (ids are never reused)
        if row[5] is not None and (n_records < 1 or alloc_id != row[5]):
            raise Stale(f"pid {pid}'s allocation holding a tensor at 0x{row[0]:x} was freed since its "
                        f"name was read", _lib.STALE)
        pieces.append((device, ptr, row[1]))
    owners = []
    for device, start, end, members in stretches(pieces):
        owner = _Imports([])
        owners.append((owner, members))
        _tensors(torch, owner, device, start, end, members, out,
                 lambda i: (rows[i][2], rows[i][3], rows[i][4], pieces[i][1]))
    return owners


def _end(L, job, imps, n):
    """End a begun import whose tensors could not be made, and let every import go."""
    if L.vmm_import_many_end(job, imps) == 0:
        for i in range(n):
            L.vmm_import_release(imps[i])


