"""Tensors laid over a device mesh (PyTorch's DTensor, FSDP2's parameters) as the name table holds
them (layout.h SHARDS): the owner side's description of a DTensor, and the arithmetic a reader
needs to place each rank's piece in the whole tensor, or in a tensor-parallel slice of it.  The
arithmetic is plain Python over shapes; assemble() copies with nothing but narrow() and copy_().

A split is torch.chunk's, as DTensor's Shard(dim) is: pieces of ceil(extent / n) along dim, the
last ones shorter or empty; splits of one dimension by several mesh dimensions nest in mesh order.
FSDP2 pads each rank's piece to ceil(extent / n) in its own storage; the padding is not published
(the piece's shape is the real rows), and Piece.padding says how much there is."""
import os

from . import _lib

MAX_MESH_DIMS = _lib.MESH_MAX_DIMS
_KIND_NAMES = {_lib.PLACE_REPLICATE: "Replicate", _lib.PLACE_PARTIAL: "Partial", _lib.PLACE_SHARD: "Shard"}


# ---- the owner side ----

def is_dtensor(obj):
    return all(hasattr(obj, a) for a in ("to_local", "placements", "device_mesh"))


def shard_desc(dt):
    """The vmm_shard of a DTensor: per mesh dimension its placement, the mesh's extent and this
    rank's coordinate; a Shard's whole extent from the DTensor's (global) shape."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    extents = tuple(mesh.mesh.shape) if hasattr(mesh, "mesh") else tuple(mesh.shape)
    places = tuple(dt.placements)
    if coord is None:
        raise ValueError("this rank is not in the DTensor's mesh")
    if len(places) > MAX_MESH_DIMS:
        raise ValueError(f"a mesh of {len(places)} dimensions; at most {MAX_MESH_DIMS}")
    out = _lib.Shard()
    out.mesh_ndim = len(places)
    shape = tuple(dt.shape)
    for i, p in enumerate(places):
        pl = out.place[i]
        pl.mesh, pl.coord = int(extents[i]), int(coord[i])
        if getattr(p, "split_factor", 1) != 1:
            raise ValueError(f"placement {p} (a strided shard, FSDP over tensor parallelism) is not supported")
        if callable(getattr(p, "is_shard", None)) and p.is_shard():
            dim = p.dim + len(shape) if p.dim < 0 else p.dim
            pl.kind, pl.dim, pl.global_extent = _lib.PLACE_SHARD, dim, int(shape[dim])
        elif callable(getattr(p, "is_replicate", None)) and p.is_replicate():
            pl.kind = _lib.PLACE_REPLICATE
        elif callable(getattr(p, "is_partial", None)) and p.is_partial():
            pl.kind = _lib.PLACE_PARTIAL
        else:
            raise ValueError(f"placement {p!r} is none of Shard, Replicate, Partial")
    return out


def default_job():
    """torchrun's run id, else MASTER_ADDR:MASTER_PORT (every rank of one job has the same); None
    outside a launcher."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return run[:23]
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}"[:23] if addr and port else None


def current_stream():
    """The current CUDA stream's handle, where PyTorch runs; else None (the legacy default stream)."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream().cuda_stream or None


# ---- the reader side ----

class Piece:
    """One rank's piece of a name: pid, tensor (vmmshim.Tensor: its local shape, dtype, address),
    version (published at), places [(kind, dim, mesh, coord, global_extent)], global_shape,
    offset and shape (its box in the whole tensor), padding {dim: elements FSDP pads it by}."""

    def __init__(self, tensor, version, shard):
        self.pid, self.tensor, self.version = tensor.pid, tensor, version
        self.places = [(p.kind, p.dim, p.mesh, p.coord, p.global_extent)
                       for p in shard.place[:min(shard.mesh_ndim, MAX_MESH_DIMS)]]
        self.global_shape = global_shape(tensor.shape, self.places)
        self.offset, self.shape, self.padding = box(self.global_shape, self.places)
        if tuple(self.shape) != tuple(tensor.shape):
            raise ValueError(f"{tensor.name!r} of pid {tensor.pid}: its shape {list(tensor.shape)} is not the piece "
                             f"{list(self.shape)} its place {self.placement_text()} gives")

    @property
    def partial(self):
        return any(k == _lib.PLACE_PARTIAL for k, *_ in self.places)

    def placement_text(self):
        return ", ".join(f"{_KIND_NAMES.get(k, '?')}{f'({d})' if k == _lib.PLACE_SHARD else ''} {c}/{m}"
                         for k, d, m, c, _ in self.places) or "whole"

    def __repr__(self):
        return (f"<vmmshim.Piece {self.tensor.name!r} of pid {self.pid}: {self.placement_text()}, "
                f"at {list(self.offset)} of {list(self.global_shape)}>")


def global_shape(local_shape, places):
    shape = list(local_shape)
    for kind, dim, _, _, extent in places:
        if kind == _lib.PLACE_SHARD:
            if dim >= len(shape):
                raise ValueError(f"a split of dimension {dim} of a {len(shape)}-dimensional tensor")
            shape[dim] = extent
    return tuple(shape)


def chunk(extent, n, index):
    """(start, length) of piece `index` of torch.chunk's n pieces along an extent."""
    size = -(-extent // n) if n else extent
    start = min(index * size, extent)
    return start, min(start + size, extent) - start


def box(shape, places):
    """(offset, shape, padding) of the piece the places give, in a tensor of `shape`."""
    offset, sizes, padding = [0] * len(shape), list(shape), {}
    for kind, dim, mesh, coord, _ in places:
        if kind != _lib.PLACE_SHARD:
            continue
        full = -(-sizes[dim] // mesh)
        start, length = chunk(sizes[dim], mesh, coord)
        offset[dim] += start
        sizes[dim] = length
        padding[dim] = full - length
    return tuple(offset), tuple(sizes), padding


def tp_box(shape, dim, rank, world):
    """The box of tensor-parallel slice `rank` of `world` along dim (torch.chunk's, as above)."""
    if not 0 <= dim < len(shape) or not 0 <= rank < world:
        raise ValueError(f"a slice (dim {dim}, rank {rank}, world {world}) of a tensor of shape {list(shape)}")
    start, length = chunk(shape[dim], world, rank)
    offset = [0] * len(shape)
    sizes = list(shape)
    offset[dim], sizes[dim] = start, length
    return tuple(offset), tuple(sizes)


def cover(name, pieces):
    """The pieces to read for the whole of a name: one per distinct box (a replica's twins are
    alternatives, listed together), checked to tile the whole tensor without overlap.
    Returns [(offset, shape, [replicas])]."""
    if any(p.partial for p in pieces):
        raise ValueError(f"{name!r}: a Partial placement holds summands, not pieces: reduce it first")
    shapes = {p.global_shape for p in pieces}
    dtypes = {p.tensor.dlpack_dtype for p in pieces}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"{name!r}: the ranks disagree on its whole shape {sorted(shapes)} or dtype {sorted(dtypes)}")
    boxes = {}
    for p in pieces:
        boxes.setdefault((p.offset, p.shape), []).append(p)
    whole = next(iter(shapes))
    total = 1
    for n in whole:
        total *= n
    covered = 0
    listed = sorted(boxes.items())
    for i, ((off, shp), _) in enumerate(listed):
        vol = 1
        for n in shp:
            vol *= n
        covered += vol
        for off2, shp2 in (k for k, _ in listed[i + 1:]):
            if vol and _intersect(off, shp, off2, shp2):
                raise ValueError(f"{name!r}: pieces at {list(off)} and {list(off2)} overlap")
    if covered != total:
        raise ValueError(f"{name!r}: the ranks found hold {covered} of its {total} elements: a rank is missing")
    return [(off, shp, reps) for (off, shp), reps in listed]


def _intersect(off, shp, off2, shp2):
    """Per dimension (start in the first box, start in the second, length), or None."""
    out = []
    for a, n, b, m in zip(off, shp, off2, shp2):
        lo, hi = max(a, b), min(a + n, b + m)
        if hi <= lo:
            return None
        out.append((lo - a, lo - b, hi - lo))
    return out


def plan(covered, target_offset, target_shape):
    """The copies that fill the box (target_offset, target_shape) from the pieces: [(replicas,
    [(start in the piece, start in the target, length) per dimension])]."""
    steps = []
    for off, shp, reps in covered:
        got = _intersect(off, shp, target_offset, target_shape)
        if got is not None:
            steps.append((reps, got))
    return steps


def _narrow(t, spans, which):
    for d, span in enumerate(spans):
        start, length = span[which], span[2]
        if start != 0 or length != t.shape[d]:
            t = t.narrow(d, start, length)
    return t


def assemble(steps, source_of, dest):
    """Runs a plan: dest (the target box) gets each piece's part, source_of(replicas) giving the
    tensor to read (one of the replicas').  Copies are queued (non_blocking) on the current stream."""
    for reps, spans in steps:
        src = source_of(reps)
        _narrow(dest, spans, 1).copy_(_narrow(src, spans, 0), non_blocking=True)
