"""Weights across ranks (issue 40) over the emulated driver, with stand-ins for torch's DTensor and
torch.distributed (no torch here).
Checks:
- shard metadata: two owner processes under the shim (ranks of a 2-rank mesh) publish stand-in
  DTensors with vmmshim.publish_many: each name's local piece, its placement (Shard(0) of 5 rows:
  3 and 2, FSDP's padding 1; Replicate; a 2-D mesh nesting two splits of one dimension; Partial),
  the global shape, the version and the job tag (explicit, and torchrun's run id by default) are
  read back by vmmshim.Group, by `vmmctl list --names` (PLACE) and its --json; a DTensor whose
  local shape contradicts its place, or a strided shard, is refused in one line;
- the placement arithmetic: torch.chunk's pieces (empty ones too), nested splits, padding,
  tensor-parallel boxes, cover() refusing overlaps, a missing rank and Partial; the take's copy
  plan, run by assemble() over host tensors (a stand-in for torch's narrow and copy_), gives the
  whole tensor and each TP slice from the owners' real bytes, read through the broker;
- the version check racing a writer: one owner rewrites its piece 60 times inside
  vmmshim.updating(v) while the device lags 3 ms (FAKECUDA_EVENT_DELAY_US: the update ends when
  the stream gets there); every read Group.consistent accepts holds one version whole, some reads
  were retried, and the update's end lands only once the stream reaches it;
- the sidecar's protocol (vmmshim._sidecar) between one sidecar and two receivers on threads, over
  a stand-in for torch.distributed: whole tensors and a TP slice arrive bit-exact, a round whose
  owners changed version mid-way runs again, and a stop ends serve(); with two sidecars, one a GPU,
  each imports only the pieces on its GPU.
Ends with "N passed, N failed"."""
import json
import os
import struct
import subprocess
import sys
import threading
import time

import harness
from harness import BUILD, PACKAGE

harness.setup()
T = harness.Tally()

import vmmshim  # noqa: E402
from vmmshim import _lib, _shards, _sidecar  # noqa: E402

OWNER = r"""
import ctypes, json, os, sys, time
import vmmshim
rank, world = int(sys.argv[1]), int(sys.argv[2])
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

class Local:  # a CUDA tensor as __cuda_array_interface__ describes it
    def __init__(self, shape, fill):
        n = 1
        for d in shape:
            n *= d
        self.shape, self.n = tuple(shape), n
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), max(4 * n, 4)) == 0
        self.ptr = p.value
        self.write(fill)
    def write(self, fill):
        vals = (ctypes.c_float * max(self.n, 1))(*[fill(i) for i in range(self.n)])
        assert rt.cudaMemcpy(self.ptr, vals, 4 * self.n, 1) == 0
    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<f4", "data": (self.ptr, False), "version": 3, "strides": None}

class Place:
    def __init__(self, kind, dim=0, split_factor=1):
        self.kind, self.dim, self.split_factor = kind, dim, split_factor
    def is_shard(self): return self.kind == "S"
    def is_replicate(self): return self.kind == "R"
    def is_partial(self): return self.kind == "P"

class Mesh:
    def __init__(self, shape, coord): self.shape, self.coord = tuple(shape), list(coord)
    def get_coordinate(self): return self.coord

class DTensor:
    def __init__(self, local, shape, mesh, places):
        self.local, self.shape, self.device_mesh, self.placements = local, tuple(shape), mesh, places
    def to_local(self): return self.local

def chunk(extent, n, i):
    size = -(-extent // n)
    start = min(i * size, extent)
    return start, min(start + size, extent) - start

r0, rows = chunk(5, world, rank)
w = Local((rows, 4), lambda i: float((r0 + i // 4) * 4 + i % 4))
b = Local((4,), lambda i: 100.0 + i)
c0, cols = chunk(6, world, rank)
m = Local((3, cols), lambda i: float((i // cols) * 6 + c0 + i % cols))
part = Local((2,), lambda i: 1.0)
mesh = Mesh((world,), (rank,))
state = {
    "w": DTensor(w, (5, 4), mesh, [Place("S", 0)]),
    "b": DTensor(b, (4,), mesh, [Place("R")]),
    "m": DTensor(m, (3, 6), Mesh((world, 1), (rank, 0)), [Place("S", -1), Place("S", 1)]),
}
reg = vmmshim.Registry()

def own_state():
    info = vmmshim._lib.WeightsInfo()
    assert vmmshim._lib.lib().vmm_weights_state(reg._h(), os.getpid(), ctypes.byref(info)) == 0
    return info.seq, info.version

for line in sys.stdin:
    cmd = line.split()
    out = {}
    try:
        if cmd[0] == "publish":
            kw = {"version": int(cmd[1])}
            if len(cmd) > 2:
                kw["job"] = cmd[2]
            vmmshim.publish_many(state, **kw)
        elif cmd[0] == "partial":
            vmmshim.publish_many({"p": DTensor(part, (2,), mesh, [Place("P")])})
        elif cmd[0] == "bad":
            for what, dt in (("shape", DTensor(w, (9, 4), mesh, [Place("S", 0)])),
                             ("strided", DTensor(w, (5, 4), mesh, [Place("S", 0, split_factor=2)]))):
                try:
                    vmmshim.publish_many({"bad." + what: dt})
                    out[what] = "published"
                except Exception as e:
                    out[what] = f"{type(e).__name__}: {e}"
        elif cmd[0] == "race":
            for v in range(int(cmd[1]), int(cmd[2]) + 1):
                with vmmshim.updating(v):
                    w.write(lambda i, v=v: float(v))
                time.sleep(0.008)  # the forward and backward of the next step: the weights stay
            out["done"] = True
        elif cmd[0] == "update":
            v = int(cmd[1])
            with vmmshim.updating(v):
                w.write(lambda i: float(v))
            out["at_exit"] = own_state()
            time.sleep(0.05)
            out["later"] = own_state()
        elif cmd[0] == "quit":
            break
        out["ok"] = True
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
"""


class Owner:
    def __init__(self, rank, world, extra=None):
        env = harness.preload_env(dict(extra or {}, PYTHONPATH=str(PACKAGE)))
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, str(rank), str(world)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.pid = self.proc.pid

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self):
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"ok": False, "error": "the owner ended"}

    def ask(self, line):
        self.send(line)
        return self.reply()

    def quit(self):
        try:
            self.send("quit")
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)


class Host:
    """A stand-in for a torch tensor: floats in a flat list, with narrow() and copy_()."""

    def __init__(self, shape, data=None, offset=0, strides=None, device="cpu", dtype="float32"):
        self.shape = tuple(shape)
        n = 1
        for d in self.shape:
            n *= d
        self.data = data if data is not None else [0.0] * n
        self.offset = offset
        if strides is None:
            strides, step = [], 1
            for d in reversed(self.shape):
                strides.insert(0, step)
                step *= d
        self.strides, self.device, self.dtype = tuple(strides), device, dtype

    def narrow(self, dim, start, length):
        shape = list(self.shape)
        shape[dim] = length
        return Host(shape, self.data, self.offset + start * self.strides[dim], self.strides, self.device, self.dtype)

    def _indices(self):
        idx = [self.offset]
        for d, n in enumerate(self.shape):
            idx = [i + k * self.strides[d] for i in idx for k in range(n)]
        return idx

    def values(self):
        return [self.data[i] for i in self._indices()]

    def copy_(self, src, non_blocking=False):
        for i, v in zip(self._indices(), src.values()):
            self.data[i] = v
        return self

    def contiguous(self):
        return Host(self.shape, self.values(), 0, None, self.device, self.dtype)


class HostTorch:
    """The torch calls _sidecar makes: empty(), and no CUDA."""
    cuda = None

    @staticmethod
    def empty(shape, dtype=None, device=None):
        return Host(shape, device=device, dtype=dtype)


def floats(raw):
    return list(struct.unpack("<%df" % (len(raw) // 4), raw))


def piece_source(reg, piece):
    """A piece's bytes, read from its owner through the broker, as a host tensor."""
    with reg.open(piece.pid, piece.tensor.address, piece.tensor.nbytes) as buf:
        return Host(piece.shape, floats(buf.read()))


def whole(name_values, shape):
    return Host(shape, list(name_values))


def test_arithmetic():
    T.check([_shards.chunk(5, 2, i) for i in range(2)] == [(0, 3), (3, 2)], "torch.chunk's pieces of 5 in 2")
    T.check([_shards.chunk(3, 4, i) for i in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 0)],
            f"of 3 in 4: the last one empty: {[_shards.chunk(3, 4, i) for i in range(4)]}")
    S = _lib.PLACE_SHARD
    off, shp, pad = _shards.box((10, 7), [(S, 0, 2, 1, 10), (S, 0, 2, 1, 10)])
    T.check(off == (8, 0) and shp == (2, 7) and pad == {0: 1},
            f"two mesh dimensions splitting one dimension nest: rank (1,1) of 10 rows: {off} {shp} {pad}")
    off, shp, pad = _shards.box((5, 4), [(S, 0, 2, 1, 5)])
    T.check(off == (3, 0) and shp == (2, 4) and pad == {0: 1}, f"FSDP's second rank of 5 rows: padding 1: {pad}")
    T.check(_shards.tp_box((5, 4), 1, 1, 2) == ((0, 2), (5, 2)), "a TP slice's box")
    T.raises(ValueError, lambda: _shards.tp_box((5, 4), 2, 0, 2), "a TP slice of a dimension the tensor lacks")


class FakeTensor:
    def __init__(self, name, pid, shape):
        self.name, self.pid, self.shape, self.dlpack_dtype, self.dtype = name, pid, tuple(shape), (2, 32, 1), "float32"


def fake_piece(name, pid, local_shape, places, version=1):
    sh = _lib.Shard()
    sh.mesh_ndim = len(places)
    for i, (kind, dim, mesh, coord, extent) in enumerate(places):
        p = sh.place[i]
        p.kind, p.dim, p.mesh, p.coord, p.global_extent = kind, dim, mesh, coord, extent
    return _shards.Piece(FakeTensor(name, pid, local_shape), version, sh)


def test_cover_refusals():
    S, R, P = _lib.PLACE_SHARD, _lib.PLACE_REPLICATE, _lib.PLACE_PARTIAL
    a = fake_piece("w", 1, (3, 4), [(S, 0, 2, 0, 5)])
    b = fake_piece("w", 2, (2, 4), [(S, 0, 2, 1, 5)])
    T.check(len(_shards.cover("w", [a, b])) == 2, "two shards cover the whole")
    T.raises(ValueError, lambda: _shards.cover("w", [a]), "a missing rank", "missing")
    r1, r2 = fake_piece("b", 1, (4,), [(R, 0, 2, 0, 0)]), fake_piece("b", 2, (4,), [(R, 0, 2, 1, 0)])
    got = _shards.cover("b", [r1, r2])
    T.check(len(got) == 1 and len(got[0][2]) == 2, f"replicas are one box with two sources: {got}")
    T.raises(ValueError, lambda: _shards.cover("p", [fake_piece("p", 1, (2,), [(P, 0, 2, 0, 0)])]),
             "a Partial placement", "Partial")
    T.raises(ValueError, lambda: fake_piece("w", 1, (4, 4), [(S, 0, 2, 0, 5)]), "a piece whose shape contradicts its place",
             "not the piece")


def test_owners():
    owners = [Owner(0, 2, {"TORCHELASTIC_RUN_ID": "run-xyz"}), Owner(1, 2, {"TORCHELASTIC_RUN_ID": "run-xyz"})]
    try:
        for o in owners:
            r = o.ask("publish 7")
            T.check(r.get("ok"), f"rank publishes its DTensors: {r}")
        reg = vmmshim.Registry()
        g = vmmshim.Group(reg, job="run-xyz")
        T.check(sorted(g.pids) == sorted(o.pid for o in owners), f"the job found by torchrun's run id: {g.pids}")
        pieces = g.pieces()
        T.check(sorted(pieces) == ["b", "m", "w"], f"every name of both ranks: {sorted(pieces)}")
        w = sorted(pieces["w"], key=lambda p: p.offset)
        T.check([(p.offset, p.shape, p.global_shape, p.padding, p.version) for p in w] ==
                [((0, 0), (3, 4), (5, 4), {0: 0}, 7), ((3, 0), (2, 4), (5, 4), {0: 1}, 7)],
                f"Shard(0) of 5 rows read back: offsets, shapes, padding, version: "
                f"{[(p.offset, p.shape, p.padding, p.version) for p in w]}")
        m = sorted(pieces["m"], key=lambda p: p.offset)
        T.check([(p.offset, p.shape) for p in m] == [((0, 0), (3, 3)), ((0, 3), (3, 3))] and
                m[0].places[0][1] == 1,
                f"a 2-D mesh splitting dimension 1 (given as -1): {[(p.offset, p.shape, p.places) for p in m]}")
        T.check(all(p.placement_text() == f"Replicate {i}/2" for i, p in enumerate(sorted(pieces["b"], key=lambda p: p.pid)))
                or {p.placement_text() for p in pieces["b"]} == {"Replicate 0/2", "Replicate 1/2"},
                f"Replicate: {[p.placement_text() for p in pieces['b']]}")
        for o in owners:
            o.ask("publish 8 jobB")
        T.check(sorted(vmmshim.Group(reg, job="jobB").pids) == sorted(o.pid for o in owners), "an explicit job tag")
        T.raises(vmmshim.NotFound, lambda: vmmshim.Group(reg, job="no-such-job").pids, "a job nobody publishes under")

        # vmmctl's PLACE column and JSON
        ctl = subprocess.run([str(BUILD / "vmmctl"), "list", "--names", "--pid", str(owners[1].pid)], capture_output=True,
                             text=True)
        T.check(ctl.returncode == 0 and "Shard(0) 1/2 of 5" in ctl.stdout and "Replicate 1/2" in ctl.stdout and
                "Shard(1) 1/2 of 6, Shard(1) 0/1 of 6" in ctl.stdout and ctl.stdout.split("\n")[0].endswith("PLACE"),
                f"vmmctl list --names shows each name's place:\n{ctl.stdout}{ctl.stderr}")
        js = subprocess.run([str(BUILD / "vmmctl"), "list", "--names", "--json", "--pid", str(owners[0].pid)],
                            capture_output=True, text=True)
        rows = {r["name"]: r for r in json.loads(js.stdout)} if js.returncode == 0 else {}
        T.check(rows.get("w", {}).get("version") == 8 and rows["w"]["shard"] ==
                [{"placement": "Shard(0)", "mesh": 2, "coord": 0, "global_extent": 5}],
                f"vmmctl list --names --json: version and shard: {rows.get('w')}")
        py = subprocess.run([sys.executable, "-m", "vmmshim", "list", "--names", "--pid", str(owners[1].pid)],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(PACKAGE)))
        T.check(py.stdout == ctl.stdout,
                f"python -m vmmshim list --names as vmmctl's:\n{py.stdout}---\n{ctl.stdout}")

        r = owners[0].ask("bad")
        T.check("shape" in r.get("shape", "") and "strided" in r.get("strided", "") and "\n" not in json.dumps(r),
                f"a DTensor contradicting its place, and a strided shard, refused in one line: {r}")
        r = owners[0].ask("partial")
        T.check(r.get("ok"), f"a Partial placement is published: {r}")
        T.raises(ValueError, lambda: _shards.cover("p", vmmshim.Group(reg, pids=[owners[0].pid]).pieces(["p"])["p"]),
                 "a take refuses a Partial name", "Partial")

        # the take's plan over the owners' real bytes: the whole, and each TP slice
        pieces = vmmshim.Group(reg, job="jobB").pieces(["w", "m", "b"])
        sources = {id(p): piece_source(reg, p) for ps in pieces.values() for p in ps}
        expect = {"w": [float(i) for i in range(20)], "m": [float(i) for i in range(18)], "b": [100.0 + i for i in range(4)]}
        for name, ps in pieces.items():
            covered = _shards.cover(name, ps)
            shape = ps[0].global_shape
            dest = Host(shape)
            _shards.assemble(_shards.plan(covered, (0,) * len(shape), shape), lambda reps: sources[id(reps[0])], dest)
            T.check(dest.values() == expect[name], f"{name}: the whole tensor from the ranks' pieces: {dest.values()}")
        ps = pieces["w"]
        for rank in range(2):
            off, shp = _shards.tp_box((5, 4), 1, rank, 2)
            dest = Host(shp)
            _shards.assemble(_shards.plan(_shards.cover("w", ps), off, shp), lambda reps: sources[id(reps[0])], dest)
            want = [float(r * 4 + c) for r in range(5) for c in range(2 * rank, 2 * rank + 2)]
            T.check(dest.values() == want, f"w: TP slice {rank} of 2 along dim 1: {dest.values()}")
        off, shp = _shards.tp_box((5, 4), 0, 1, 3)
        dest = Host(shp)
        steps = _shards.plan(_shards.cover("w", ps), off, shp)
        _shards.assemble(steps, lambda reps: sources[id(reps[0])], dest)
        T.check(len(steps) == 2 and dest.values() == [float(i) for i in range(8, 16)],
                f"w: TP slice 1 of 3 along dim 0 spans both ranks' pieces: {len(steps)} copies, {dest.values()}")
    finally:
        for o in owners:
            o.quit()


def test_race():
    owners = [Owner(0, 2, {"FAKECUDA_EVENT_DELAY_US": "3000"}), Owner(1, 2)]
    try:
        for o in owners:
            o.ask("publish 0 race")
        r = owners[0].ask("update 1")
        T.check(r.get("ok") and r["at_exit"][0] % 2 == 1 and r["later"][0] % 2 == 0 and r["later"][1] == 1,
                f"the update ends when the lagging stream reaches it, not when the block exits: {r}")
        reg = vmmshim.Registry()
        g = vmmshim.Group(reg, job="race")
        # rank 1 never updates: its version stays 0, so a take of both never agrees on one version
        T.raises(vmmshim.Busy, lambda: g.consistent(lambda: None, retries=2), "owners at different versions", "take again")
        g = vmmshim.Group(reg, pids=[owners[0].pid])
        piece = g.pieces(["w"])["w"][0]
        owners[0].send("race 2 61")
        accepted, retried, torn = [], 0, 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                vals, version, attempts = g.consistent(lambda: piece_source(reg, piece).values(), retries=50)
            except vmmshim.Busy:
                retried += 51
                continue
            retried += attempts - 1
            torn += len(set(vals)) != 1 or vals[0] != float(version)
            accepted.append(version)
            if version == 61:
                break
        r = owners[0].reply()
        T.check(r.get("done"), f"the writer finished: {r}")
        T.check(torn == 0 and len(accepted) >= 3 and accepted[-1] == 61,
                f"every accepted read is one version whole ({torn} torn of {len(accepted)}; last {accepted[-1:]})")
        T.check(retried > 0, f"reads that raced an update were taken again ({retried} retries)")
    finally:
        for o in owners:
            o.quit()


class FakeDist:
    """torch.distributed's calls the sidecar makes, between threads: each rank's n-th call on a group
    meets the other members' n-th call there."""

    def __init__(self, world):
        self.world, self.local, self.cond = world, threading.local(), threading.Condition()
        self.slots, self.counts = {}, {}

    def get_world_size(self, group=None):
        return self.world if group is None else len(group)

    def get_rank(self, group=None):
        return self.local.rank

    def new_group(self, ranks):
        return tuple(ranks)

    def _meet(self, group, src, value):
        members = tuple(range(self.world)) if group is None else group
        key = (members, self.counts.get((members, self.local.rank), 0))
        self.counts[(members, self.local.rank)] = key[1] + 1
        with self.cond:
            slot = self.slots.setdefault(key, {"value": None, "set": False, "seen": 0})
            if self.local.rank == src:
                slot["value"], slot["set"] = value, True
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: slot["set"], timeout=30):
                raise TimeoutError(f"rank {self.local.rank}: nobody sent on {key}")
            return slot["value"]

    def broadcast_object_list(self, box, src, group=None):
        box[0] = self._meet(group, src, box[0])

    def broadcast(self, tensor, src, group=None):
        got = self._meet(group, src, tensor.values())
        if self.local.rank != src:
            tensor.copy_(Host(tensor.shape, got))

    def barrier(self, group=None):
        members = tuple(range(self.world)) if group is None else group
        key = ("barrier", members, self.counts.get(("b", members, self.local.rank), 0))
        self.counts[("b", members, self.local.rank)] = key[2] + 1
        with self.cond:
            slot = self.slots.setdefault(key, {"n": 0})
            slot["n"] += 1
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: slot["n"] == len(members), timeout=30):
                raise TimeoutError("barrier")


def run_ranks(dist, roles):
    """Each rank's role(rank) on a thread of its own as that rank of dist; what failed or hung."""
    errors = []

    def one(rank, role):
        dist.local.rank = rank
        try:
            role(rank)
        except Exception as e:
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=item) for item in roles.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors + [f"{t.name} still running" for t in threads if t.is_alive()]


class FakeSource:
    """Two ranks' pieces of w (5x4) and b (replicated 4), rank pid-1 on GPU pid-1; the owners'
    versions scripted through `shared` (every sidecar's source sees the same owners): with move,
    the first round's second look sees version 2 where the first saw 1."""

    def __init__(self, shared, move=True):
        S, R = _lib.PLACE_SHARD, _lib.PLACE_REPLICATE
        self.p = {"w": [fake_piece("w", 1, (3, 4), [(S, 0, 2, 0, 5)]), fake_piece("w", 2, (2, 4), [(S, 0, 2, 1, 5)])],
                  "b": [fake_piece("b", 1, (4,), [(R, 0, 2, 0, 0)]), fake_piece("b", 2, (4,), [(R, 0, 2, 1, 0)])]}
        for ps in self.p.values():
            for piece in ps:
                piece.device_index = piece.pid - 1
        self.shared, self.move, self.opened = shared, move, set()

    def pieces(self, names=None):
        return {n: ps for n, ps in self.p.items() if names is None or n in names}

    def states(self):
        self.shared["looks"] = self.shared.get("looks", 0) + 1
        if self.move and self.shared["looks"] == 2:
            self.shared["version"] = 2
        v = self.shared.setdefault("version", 1)
        return {1: (2 * v, v), 2: (2 * v, v)}

    def open(self, pieces):
        v = float(self.shared.setdefault("version", 1))
        values = {"w": [v * 100 + i for i in range(20)], "b": [v * 1000 + i for i in range(4)]}
        out = {}
        for name, ps in pieces.items():
            for p in ps:
                self.opened.add((name, p.pid))
                start = p.offset[0] * (4 if name == "w" else 1)
                n = 1
                for d in p.shape:
                    n *= d
                out[id(p)] = Host(p.shape, values[name][start:start + n])
        return out


def test_two_sidecars():
    """Two sidecars, one a GPU, and two receivers: each sidecar imports only its GPU's pieces."""
    dist, shared, results = FakeDist(4), {}, {}
    sources = [FakeSource(shared, move=False), FakeSource(shared, move=False)]

    def sidecar(rank):
        _sidecar.Sidecar(sources[rank], dist, n_sidecars=2, torch=HostTorch).serve()

    def receiver(rank):
        rx = _sidecar.Receiver(dist, n_sidecars=2, torch=HostTorch)
        whole = {"w": Host((5, 4)), "b": Host((4,))}
        results[rank] = rx.refresh(whole)
        results[f"{rank}.w"] = whole["w"].values()
        rx.stop()

    errors = run_ranks(dist, {0: sidecar, 1: sidecar, 2: receiver, 3: receiver})
    T.check(not errors, f"two sidecars: the round ran on every rank: {errors}")
    if errors:
        return
    T.check(results["2.w"] == results["3.w"] == [100.0 + i for i in range(20)],
            "two sidecars: w assembled from both GPUs' sidecars, bit-exact at both receivers")
    T.check(sources[0].opened == {("w", 1), ("b", 1)} and sources[1].opened == {("w", 2), ("b", 2)},
            f"each sidecar imports only the pieces on its GPU: {sorted(sources[0].opened)} {sorted(sources[1].opened)}")


def test_sidecar():
    dist, results = FakeDist(3), {}

    def sidecar(rank):
        sc = _sidecar.Sidecar(FakeSource({}), dist, n_sidecars=1, torch=HostTorch)
        results["rounds"] = sc.serve()
        results["retries"] = sc.retries

    def receiver(rank):
        rx = _sidecar.Receiver(dist, n_sidecars=1, torch=HostTorch)
        whole = {"w": Host((5, 4)), "b": Host((4,))}
        results[rank] = rx.refresh(whole)
        results[f"{rank}.w"], results[f"{rank}.b"] = whole["w"].values(), whole["b"].values()
        sliced = {"w": Host((5, 2))}
        results[f"{rank}.slice"] = rx.refresh(sliced, names=["w"], tp=(1, rank - 1, 2))
        results[f"{rank}.sw"] = sliced["w"].values()
        rx.stop()

    errors = run_ranks(dist, {0: sidecar, 1: receiver, 2: receiver})
    T.check(not errors, f"the round ran on every rank: {errors}")
    if errors:
        return
    T.check(results[1] == (2, 2) and results[2] == (2, 2),
            f"the first round, whose owners moved to version 2 mid-way, ran again: (version, attempts) {results[1]}")
    T.check(results["1.w"] == [200.0 + i for i in range(20)] and results["2.b"] == [2000.0 + i for i in range(4)],
            "whole tensors arrive bit-exact, of the version the round ended at")
    want = {r: [200.0 + row * 4 + c for row in range(5) for c in range(2 * (r - 1), 2 * r)] for r in (1, 2)}
    T.check(results["1.sw"] == want[1] and results["2.sw"] == want[2], "each receiver's TP slice of w along dim 1")
    T.check(results.get("rounds") == 2 and results.get("retries") == 1, f"serve() ends at the stop: {results.get('rounds')} "
            f"rounds, {results.get('retries')} retried")


def main():
    try:
        test_arithmetic()
        test_cover_refusals()
        test_owners()
        test_race()
        test_sidecar()
        test_two_sidecars()
    finally:
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
