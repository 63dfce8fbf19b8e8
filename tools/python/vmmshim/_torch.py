"""vmmshim.to_torch: many views as PyTorch tensors for one DLPack import per stretch of memory.

On an H100 host torch.from_dlpack costs about 10 us a call (its stream handshake and a tensor of
its own for each), most of what taking a whole model cost (issue 16).  Views that lie near each
other here (open_many maps one call's chunks into one reservation) share one uint8 tensor over
their stretch, taken with a single capsule; each view is then that storage seen with its dtype,
offset, shape and strides, as PyTorch's own rebuild_cuda_tensor reuses one storage for every
tensor of a segment.  Torch never reads the bytes between the views.  Each tensor is one
as_strided of a flat tensor of its dtype over the stretch (one per dtype and stretch): one torch
call a tensor, where empty + set_ (what rebuild_cuda_tensor does) are two."""
from . import _dlpack

GAP = 1 << 30  # views farther apart than this start a stretch of their own
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


def stretches(views):
    """[(device, start, end, [indexes into views])]: the views sorted by device and pointer, a new
    stretch wherever the next view starts more than GAP past the end of the one before."""
    out = []
    for i in sorted(range(len(views)), key=lambda k: (views[k].device, views[k].ptr)):
        v = views[i]
        last = out[-1] if out else None
        if last and last[0] == v.device and v.ptr - last[2] <= GAP:
            last[2] = max(last[2], v.ptr + v.nbytes)
            last[3].append(i)
        else:
            out.append([v.device, v.ptr - v.ptr % ALIGN, v.ptr + v.nbytes, [i]])
    return out


def to_torch(views):
    """Tensors of the views (Buffer.view, Registry.open_tensors): a dict of them for a dict, else a
    list in the same order.  Zero-copy, like torch.from_dlpack of each view, but one DLPack import
    serves every view of a stretch; the tensors of a stretch share one storage, and all the imports
    under it stay until the last of those tensors is gone."""
    import torch

    keys = list(views) if isinstance(views, dict) else None
    vs = [views[k] for k in keys] if keys is not None else list(views)
    out = [None] * len(vs)
    for device, start, end, members in stretches(vs):
        owner = _Stretch(list({id(vs[i].buffer): vs[i].buffer for i in members}.values()))
        try:
            capsule = _dlpack.capsule(owner, start, end - start, device)
        except BaseException:
            owner._export_freed()
            raise
        raw = torch.from_dlpack(capsule)  # uint8, the whole stretch
        flats = {}  # dtype name: the stretch as a flat tensor of that dtype
        for i in members:
            v = vs[i]
            flat = flats.get(v.dtype)
            if flat is None:
                size = v._dtype.itemsize
                flat = flats[v.dtype] = raw[:(end - start) // size * size].view(getattr(torch, v.dtype))
            out[i] = flat.as_strided(v.shape, v.strides, (v.ptr - start) // v._dtype.itemsize)
    return dict(zip(keys, out)) if keys is not None else out
