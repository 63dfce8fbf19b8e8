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
    for i in sorted(range(len(pieces)), key=lambda k: (pieces[k][0], pieces[k][1])):
        device, ptr, nbytes = pieces[i]
        last = out[-1] if out else None
        if last and last[0] == device and ptr - last[2] <= GAP:
            last[2] = max(last[2], ptr + nbytes)
            last[3].append(i)
        else:
            out.append([device, ptr - ptr % ALIGN, ptr + nbytes, [i]])
    return out


def _tensors(torch, owner, device, start, end, members, out):
    """Tensors of one stretch into out[i] for i in members: ((dtype, shape, strides, ptr) each);
    owner._export_freed() runs once the stretch's storage is deleted."""
    capsule = _dlpack.capsule(owner, start, end - start, device)
    raw = torch.from_dlpack(capsule)  # uint8, the whole stretch
    flats = {}  # dtype name: the stretch as a flat tensor of that dtype
    for i, (dt, shape, strides, ptr) in members:
        flat = flats.get(dt.name)
        if flat is None:
            flat = flats[dt.name] = raw[:(end - start) // dt.itemsize * dt.itemsize].view(getattr(torch, dt.name))
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
            _tensors(torch, owner, device, start, end,
                     [(i, (vs[i]._dtype, vs[i].shape, vs[i].strides, vs[i].ptr)) for i in members], out)
        except BaseException:
            owner._export_freed()
            raise
    return dict(zip(keys, out)) if keys is not None else out


def open_torch(reg, pid, tensors, timing):
    """Registry.open_torch (see there)."""
    from . import _check, _index, _layout, _timing_of, Stale
    import torch

    t0 = time.perf_counter_ns()
    t_names = 0
    if tensors is None:
        tensors = reg.tensors(pid)
        t_names = time.perf_counter_ns() - t0
    keys = list(tensors) if isinstance(tensors, dict) else None
    specs = [tensors[k] for k in keys] if keys is not None else list(tensors)
    rows = []  # (address, nbytes, dtype, shape, strides, alloc_id or None)
    for spec in specs:
        if isinstance(spec, tuple):
            if not 3 <= len(spec) <= 4:
                raise TypeError(f"vmmshim: open_torch wants (address, dtype, shape[, strides]), not {spec!r}")
            address, dtype, shape, strides = (spec + (None,))[:4]
            alloc_id = None
        else:  # a Tensor of Registry.tensors
            address, dtype, shape, strides, alloc_id = spec.address, spec.dtype, spec.shape, spec.strides, spec.alloc_id
        address = _index(address, "address")
        dt = _dtypes.resolve(dtype)
        shape, strides, nbytes = _layout(shape, strides, dt)
        if address <= 0 or nbytes == 0 or address % dt.itemsize:
            raise ValueError(f"vmmshim: open_torch takes tensors of at least one element at an address aligned for "
                             f"their dtype, not {dt.name}{list(shape)} at 0x{address:x}")
        rows.append((address, nbytes, dt, shape, strides, alloc_id))
    n = len(rows)
    out = [None] * n
    c_timing, t_lib = None, 0
    if n:
        L = _lib.lib()
        addresses = (_lib.c_u64 * n)(*(r[0] for r in rows))
        sizes = (_lib.c_u64 * n)(*(r[1] for r in rows))
        imps = (_lib._P * n)()
        t1 = time.perf_counter_ns()
        status = L.vmm_import_many(reg._h(), pid, addresses, sizes, n, imps)
        t_lib = time.perf_counter_ns() - t1
        _check(status)
        if timing:
            c_timing = _lib.ManyTiming()
            L.vmm_import_many_last_timing(c_timing)
        owned = set(range(n))  # imports no stretch holds yet: released here on a failure
        try:
            ptr_of, device_of, records = L.vmm_import_ptr, L.vmm_import_device, L.vmm_import_records
            rec = _lib.AllocInfo()
            for i, r in enumerate(rows):
                # the allocation imported is the one the name was read from (ids are never reused)
                if r[5] is not None and (records(imps[i], rec, 1) < 1 or bytes(rec.alloc_id).hex() != r[5]):
                    raise Stale(f"pid {pid}'s allocation holding a tensor at 0x{r[0]:x} was freed since its name "
                                f"was read", _lib.STALE)
            pieces = [(device_of(imps[i]), ptr_of(imps[i]), rows[i][1]) for i in range(n)]
            for device, start, end, members in stretches(pieces):
                owner = _Imports([imps[i] for i in members])
                owned.difference_update(members)
                try:
                    _tensors(torch, owner, device, start, end,
                             [(i, (rows[i][2], rows[i][3], rows[i][4], pieces[i][1])) for i in members], out)
                except BaseException:
                    owner._export_freed()
                    raise
        except BaseException:
            for i in owned:
                L.vmm_import_release(imps[i])
            raise
    result = dict(zip(keys, out)) if keys is not None else out
    if not timing:
        return result
    times = _timing_of(c_timing, time.perf_counter_ns() - t0, t_lib)
    times["names_ns"] = t_names
    return result, times
