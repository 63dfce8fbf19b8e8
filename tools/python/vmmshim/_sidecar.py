"""A job's named tensors served to ranks on other nodes, through torch.distributed, by sidecar
processes on the owners' node: the owners (an FSDP trainer's ranks) run nothing for it.

One process group holds the sidecars, ranks 0..S-1 (one per GPU of the node, each reading the
pieces that lie on its GPU, zero-copy through vmmshim.Group), and the receivers, ranks S..W-1 (the
remote engines).  Each piece goes once from the sidecar on its GPU to every receiver (a broadcast
in the group of that sidecar and the receivers: NCCL's tree over the network), so the S sidecars
send at once, each over its own GPU's link.  A round:
  1. receiver S asks:           {"op": "take", "names": [...] | None, "tp": None | (dim, rank, world)}
                                or {"op": "stop"}                     (object broadcast from S)
  2. sidecar 0 answers with the manifest: {"version", "names": [(name, dtype, whole shape,
                                [(offset, shape, sidecar)])]}           (object broadcast from 0)
  3. per name, per piece, in manifest order: that sidecar broadcasts the piece in its group;
     each receiver copies the part of it that its target (whole, or its tp slice) holds
  4. sidecar 0 says whether the owners' tensors stayed one version through the round:
                                {"ok": bool, "version"}                (object broadcast from 0)
     not ok: the round runs again from 2, as many times as it takes.
A receiver's refresh() is one round; a sidecar's serve() answers rounds until a stop."""

from . import _shards

OP_TAKE, OP_STOP = "take", "stop"


class _Link:
    """The collectives a round uses, over dist (torch.distributed, or a stand-in) and the group
    of all ranks; one subgroup per sidecar with the receivers."""

    def __init__(self, dist, n_sidecars, group=None):
        self.dist, self.group = dist, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_sidecars = n_sidecars
        if not 0 < n_sidecars < self.world:
            raise ValueError(f"vmmshim sidecar: {n_sidecars} sidecars in a group of {self.world} ranks")
        receivers = list(range(n_sidecars, self.world))
        # every rank makes every subgroup, in the same order, as torch.distributed requires
        self.subgroups = [dist.new_group([s] + receivers) for s in range(n_sidecars)]

    def obj(self, value, src):
        box = [value]
        self.dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def tensor(self, t, sidecar):
        self.dist.broadcast(t, src=sidecar, group=self.subgroups[sidecar])


class Sidecar:
    """Serves source's tensors (a vmmshim.Group of the owners on this node) as sidecar `rank` of
    n_sidecars: it sends the pieces on GPU i where i modulo n_sidecars is its rank (sidecar i on
    GPU i)."""

    def __init__(self, source, dist, n_sidecars=1, group=None, torch=None):
        self.source, self.link = source, _Link(dist, n_sidecars, group)
        if self.link.rank >= n_sidecars:
            raise ValueError(f"vmmshim.Sidecar: rank {self.link.rank} is a receiver's")
        if torch is None:
            import torch
        self.torch = torch
        self.rounds = self.retries = 0

    def serve(self):
        """Answers rounds until a receiver asks to stop; returns how many rounds it served."""
        L = self.link
        while True:
            ask = L.obj(None, src=L.n_sidecars)
            if ask.get("op") == OP_STOP:
                return self.rounds
            while True:
                ok = self._round(ask)
                if ok:
                    break
                self.retries += 1
            self.rounds += 1

    def _round(self, ask):
        L = self.link
        manifest = None
        if L.rank == 0:
            before = self.source.states()
            pieces = self.source.pieces(ask.get("names"))
            manifest = {"version": _one_version(before), "names": []}
            for name in sorted(pieces):
                covered = _shards.cover(name, pieces[name])
                boxes = [(off, shp, self._sidecar_of(reps[0])) for off, shp, reps in covered]
                manifest["names"].append((name, pieces[name][0].tensor.dtype, pieces[name][0].global_shape, boxes))
        manifest = L.obj(manifest, src=0)
        # each sidecar imports only the pieces it sends, those on its own GPU
        found = self.source.pieces([n for n, *_ in manifest["names"]])
        mine = {n: [p for p in ps if self._sidecar_of(p) == L.rank] for n, ps in found.items()}
        sources = self.source.open({n: ps for n, ps in mine.items() if ps})
        for name, _, _, boxes in manifest["names"]:
            for off, shp, sc in boxes:
                if sc != L.rank:
                    continue
                piece = next(p for p in mine[name] if p.offset == tuple(off) and p.shape == tuple(shp))
                L.tensor(sources[id(piece)].contiguous(), sc)
        # every receiver holds its bytes (so every piece was read) before the owners' state is read again
        _sync(self.torch)
        L.dist.barrier(group=L.group)
        verdict = None
        if L.rank == 0:
            after = self.source.states()
            verdict = {"ok": after == before and _one_version(after) is not None, "version": _one_version(after)}
        return L.obj(verdict, src=0)["ok"]

    def _sidecar_of(self, piece):
        return getattr(piece, "device_index", 0) % self.link.n_sidecars


class Receiver:
    """A remote rank that takes the tensors the sidecars serve.  refresh(into) copies every name
    (or those of names) into into[name], the whole tensor, or with tp=(dim, rank, world) that
    slice; it returns the version taken and how many attempts it took."""

    def __init__(self, dist, n_sidecars=1, group=None, torch=None):
        self.link = _Link(dist, n_sidecars, group)
        if self.link.rank < n_sidecars:
            raise ValueError(f"vmmshim.Receiver: rank {self.link.rank} is a sidecar's")
        if torch is None:
            import torch
        self.torch = torch
        self.leader = self.link.rank == n_sidecars

    def refresh(self, into, names=None, tp=None):
        L = self.link
        L.obj({"op": OP_TAKE, "names": names, "tp": tp} if self.leader else None, src=L.n_sidecars)
        attempts = 0
        while True:
            attempts += 1
            manifest = L.obj(None, src=0)
            for name, dtype, whole, boxes in manifest["names"]:
                offset, shape = ((0,) * len(whole), tuple(whole)) if tp is None else _shards.tp_box(whole, *tp)
                dest = into[name]
                if tuple(dest.shape) != tuple(shape):
                    raise ValueError(f"vmmshim.Receiver: into[{name!r}] has shape {list(dest.shape)}, the box is "
                                     f"{list(shape)}")
                for off, shp, sc in boxes:
                    buf = self.torch.empty(tuple(shp), dtype=dest.dtype, device=dest.device)
                    L.tensor(buf, sc)
                    _shards.assemble(_shards.plan([(tuple(off), tuple(shp), [None])], offset, shape),
                                     lambda reps, b=buf: b, dest)
            _sync(self.torch)
            L.dist.barrier(group=L.group)
            verdict = L.obj(None, src=0)
            if verdict["ok"]:
                return verdict["version"], attempts

    def stop(self):
        """Ends the sidecars' serve() (the leading receiver's call; the others call it too)."""
        self.link.obj({"op": OP_STOP} if self.leader else None, src=self.link.n_sidecars)


def _sync(torch):
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        cuda.synchronize()


def _one_version(states):
    """The version every owner is at, None when one is updating or they differ."""
    if any(seq & 1 for seq, _ in states.values()):
        return None
    versions = {v for _, v in states.values()}
    return versions.pop() if len(versions) == 1 else None
