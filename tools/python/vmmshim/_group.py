"""vmmshim.Group: the tensors several owners (the ranks of an FSDP job) publish by the same names,
taken together: each rank's piece zero-copy, or the whole tensor (or a tensor-parallel slice of
it) assembled by copies that read each piece where it lives, over NVLink from another GPU.  The
owners run nothing for it.  A take that races an owner's in-place update (vmmshim.updating)
copies again; after `retries` it raises Busy."""
import ctypes
import time

from . import _lib, _shards
from ._errors import Busy, NotFound


class Taken(dict):
    """{name: tensor} of a take, with version (the owners' weights version it holds) and attempts."""
    version = 0
    attempts = 1


class Group:
    """The owners of one job: pids, or every living process whose job tag is `job` (the tag
    publish_many writes: torchrun's run id by default)."""

    def __init__(self, registry, pids=None, job=None):
        if (pids is None) == (job is None):
            raise ValueError("vmmshim.Group: give pids or job, not both")
        self.registry = registry
        self._job = job
        self._pids = list(pids) if pids is not None else None
        self._views = {}  # (pid, name, alloc_id, address) -> the torch view, kept across takes
        self._devices = {}  # (pid, address) -> the GPU a piece lies on

    @property
    def pids(self):
        if self._pids is not None:
            return list(self._pids)
        found = []
        for proc in self.registry.processes():
            if proc.alive == _lib.OWNER_DEAD:
                continue
            try:
                if self.state(proc.pid)[2] == self._job:
                    found.append(proc.pid)
            except Exception:  # an owner gone between the listing and its table: not of the job
                continue
        if not found:
            raise NotFound(f"vmmshim.Group: no living process publishes under job {self._job!r}", _lib.NOT_FOUND)
        return found

    def state(self, pid):
        """(seq, version, job) of pid's tensors (vmm_weights_state)."""
        info = _lib.WeightsInfo()
        status = _lib.lib().vmm_weights_state(self.registry._h(), pid, ctypes.byref(info))
        if status != _lib.OK:
            from . import _check
            _check(status)
        return info.seq, info.version, info.job.decode("utf-8", "replace")

    def pieces(self, names=None):
        """{name: [Piece]} of every rank's piece of each name (all names the ranks publish, or those
        in names; NotFound for one no rank publishes)."""
        from . import Tensor
        out = {}
        for pid in self.pids:
            for info, shard in _list_shards(self.registry, pid):
                t = Tensor(info)
                if names is None or t.name in names:
                    piece = _shards.Piece(t, shard.version, shard.shard)
                    piece.device_index = self._device_of(pid, t.address)
                    out.setdefault(t.name, []).append(piece)
        for name in names or ():
            if name not in out:
                raise NotFound(f"vmmshim.Group: no rank publishes {name!r}", _lib.NOT_FOUND)
        return out

    def take(self, names=None, into=None, tp=None, views=False, device=None, retries=8):
        """views=True: {name: [(Piece, tensor)]}, each rank's piece zero-copy on its own GPU.
        Else {name: tensor}: the whole tensor, or with tp=(dim, rank, world) that tensor-parallel
        slice, copied into into[name] where given (its shape must be the box's) or into a new
        tensor on device (default: the current one).  The copies read each piece where it lies;
        the result is one version of every owner's tensors (Taken.version), else Busy after
        retries attempts raced an update."""
        import torch
        pieces = self.pieces(names)

        def copy():
            sources = self.open(pieces)
            if views:
                return Taken({n: [(p, sources[id(p)]) for p in ps] for n, ps in pieces.items()})
            out = Taken()
            dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            with torch.no_grad():  # into may hold a model's parameters
                _fill(pieces, sources, out, into, tp, dev, torch)
            # the copies ran on the current stream (of the current device, and of dev's for PyTorch's
            # cross-device copies): every byte is read before the owners' state is looked at again
            torch.cuda.current_stream().synchronize()
            torch.cuda.current_stream(dev).synchronize()
            return out

        out, out.version, out.attempts = self.consistent(copy, retries)
        return out

    def consistent(self, fn, retries=8):
        """(fn(), version, attempts): fn run until every owner kept one version through it (none
        updating before, the same state after; fn must have finished its copies when it returns).
        Busy after retries + 1 attempts that raced an update."""
        for attempt in range(1, retries + 2):
            before = self.states()
            if any(seq & 1 for seq, _ in before.values()):
                time.sleep(min(0.001 * attempt, 0.05))
                continue
            got = fn()
            versions = {v for _, v in before.values()}
            if self.states() == before and len(versions) == 1:
                return got, versions.pop(), attempt
        raise Busy(f"vmmshim.Group: the owners updated their tensors during each of {retries + 1} attempts; "
                   f"take again", _lib.BUSY)

    def _device_of(self, pid, address):
        key = (pid, address)
        if key not in self._devices:
            self._devices[key] = self.registry.find(pid, address).device
        return self._devices[key]

    def states(self):
        """{pid: (seq, version)} of every owner."""
        return {pid: self.state(pid)[:2] for pid in self.pids}

    def open(self, pieces):
        """{id(piece): torch tensor} of pieces' tensors, zero-copy, each opened once and kept."""
        want = {}
        for ps in pieces.values():
            for p in ps:
                key = (p.pid, p.tensor.name, p.tensor.alloc_id, p.tensor.address)
                if key not in self._views:
                    want.setdefault(p.pid, {})[key] = p.tensor
        for pid, specs in want.items():
            got = self.registry.open_torch(pid, {k: t for k, t in specs.items()})
            self._views.update(got)
        return {id(p): self._views[(p.pid, p.tensor.name, p.tensor.alloc_id, p.tensor.address)]
                for ps in pieces.values() for p in ps}


def _fill(pieces, sources, out, into, tp, dev, torch):
    """The whole of each name (or its tp box) into into[name] or a new tensor on dev: out[name]."""
    for name, ps in pieces.items():
        covered = _shards.cover(name, ps)
        whole = ps[0].global_shape
        offset, shape = ((0,) * len(whole), whole) if tp is None else _shards.tp_box(whole, *tp)
        dest = into.get(name) if into else None
        if dest is None:
            dest = torch.empty(shape, dtype=sources[id(ps[0])].dtype, device=dev)
        elif tuple(dest.shape) != tuple(shape):
            raise ValueError(f"vmmshim.Group.take: into[{name!r}] has shape {list(dest.shape)}, the box is {list(shape)}")
        _shards.assemble(_shards.plan(covered, offset, shape), lambda reps, d=dest: _nearest(reps, sources, d), dest)
        out[name] = dest


def _nearest(reps, sources, dest):
    """Of a piece's replicas, the one on dest's device, else the first."""
    for p in reps:
        if sources[id(p)].device == dest.device:
            return sources[id(p)]
    return sources[id(reps[0])]


def _list_shards(registry, pid):
    """[(vmm_tensor_info fields, TensorShard)] of pid."""
    listed, n, room = _lib.lib().vmm_list_shards, ctypes.c_size_t(), 256
    while True:
        infos = ctypes.create_string_buffer(room * _lib.TENSOR_UNPACK.size)
        shards = (_lib.TensorShard * room)()
        status = listed(registry._h(), pid, infos, shards, room, ctypes.byref(n))
        if status != _lib.OK:
            from . import _check
            _check(status)
        if n.value <= room:
            break
        room = n.value + 64
    fields = _lib.TENSOR_UNPACK.iter_unpack(memoryview(infos)[:n.value * _lib.TENSOR_UNPACK.size])
    return list(zip(fields, shards[:n.value]))
