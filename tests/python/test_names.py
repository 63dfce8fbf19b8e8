"""Named tensors from Python: vmmshim.publish / publish_many / unpublish in an owner and
Registry.tensors / open_tensors in a companion.  The owner is tests/python/named_owner.py, a Python
program under the shim over the emulated runtime, publishing stand-ins for tensors: one with
__cuda_array_interface__ only, one with __dlpack__ only (its __cuda_array_interface__ raising, as a
torch bfloat16 tensor's does), one that needs detach() (a tensor that requires grad), a model's
state_dict().  Checks: every field as published; a DLPack capsule read and not consumed; bad input
refused with a clear error and nothing changed (a name of 128 bytes, with a NUL, not a str; memory
that is not the shim's; an object that is no tensor, one on the CPU, an unknown typestr, a masked
array, no elements; a bad entry in publish_many); publishing a name again replaces it;
open_tensors reads the owner's bytes through views of the published dtype, shape and strides,
importing each chunk once, and open_torch through tensors (a stand-in for torch's calls); names vanish when their memory is freed and when unpublished;
tensors() of a process not under the shim, of a dead owner; publish outside the shim and with the
shim disabled; `vmmctl list --names` shows a Python owner's names (the README's two examples run in
test_readme.py, with named_owner.py as their owner).  Ends with "N passed, N failed"."""
import ctypes
import gc
import os
import re
import subprocess
import sys
import time

import harness
from harness import BUILD, PACKAGE, ROOT

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()
MiB = 1 << 20
K = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def words(seed, first, count):
    return b"".join((((seed * K) + k) & MASK).to_bytes(8, "little") for k in range(first, first + count))


class PyOwner(harness.LineProcess):
    """tests/python/named_owner.py under the shim; run(src) is one line of Python there."""

    def __init__(self, extra_env=None):
        super().__init__([sys.executable, str(ROOT / "tests" / "python" / "named_owner.py"), str(PACKAGE)],
                         harness.preload_env(extra_env))
        line = self.readline(60)
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"the Python owner did not start: {line!r}")
        self.pid = int(line.split()[1])

    def run(self, src):
        """("ok", repr) or ("error", "Type message")."""
        status, _, rest = self.command(src).partition(" ")
        return status, rest

    def ok(self, src):
        status, rest = self.run(src)
        T.check(status == "ok", f"owner: {src}: {status} {rest}")
        return rest

    def fails(self, src, exc, reason):
        status, rest = self.run(src)
        T.check(status == "error" and rest.startswith(exc + " ") and reason in rest,
                f"owner: {src}: wanted {exc} with {reason!r}, got {status} {rest}")


def test_not_under_shim():
    T.raises(vmmshim.NotUnderShim, lambda: vmmshim.publish("w", object()), "publish in a process without the shim",
             "vmmshim.publish: not running under the shim")
    T.raises(vmmshim.NotUnderShim, lambda: vmmshim.unpublish("w"), "unpublish without the shim", "not running under the shim")
    own = PyOwner({"VMMSHIM_ENABLE": "0"})
    try:
        own.ok("a = alloc(1 << 20)")
        own.fails("vmmshim.publish('w', CAI(a, (4,), '<f4'))", "NotUnderShim", "the shim is not active")
    finally:
        own.end()


def main():
    try:
        test_not_under_shim()
        own = PyOwner()
        try:
            own.ok("A = alloc(1 << 20); fill(A, 1 << 20, 3)")  # the shim starts, and makes the registry
            own.ok("B = alloc(1 << 20); fill(B, 1 << 20, 4)")
            reg = vmmshim.Registry()
            with_owner(reg, own)
            own.kill()  # SIGKILL: its records and its table stay until gc
            T.raises(vmmshim.OwnerDead, lambda: reg.tensors(own.pid), "tensors() of a killed owner", "has exited")
            T.raises(vmmshim.OwnerDead, lambda: reg.open_tensors(own.pid), "open_tensors() of a killed owner",
                     "has exited")
            tables = [n for n in os.listdir("/dev/shm") if n.startswith(f"{os.environ['VMMSHIM_REGISTRY'][1:]}.names.{own.pid}.")]
            T.check(len(tables) == 1, f"the killed owner's table stays: {tables}")
            gc = subprocess.run([str(BUILD / "vmmctl"), "gc"], capture_output=True, text=True)
            T.check(gc.returncode == 0 and not os.path.exists(f"/dev/shm/{tables[0] if tables else ''}"),
                    f"vmmctl gc removed it: {gc.stdout} {gc.stderr}")
        finally:
            own.end()
        T.raises(vmmshim.NotFound, lambda: reg.tensors(os.getpid()), "tensors() of a process not under the shim",
                 "does not run under the shim")
        reg.close()
    finally:
        harness.cleanup()
    T.done()


def with_owner(reg, own):
    pid = own.pid
    A = int(own.ok("A"))
    B = int(own.ok("B"))
    T.check(reg.tensors(pid) == {}, "a living owner without names: {}")

    # every kind of tensor stand-in
    own.ok("vmmshim.publish('w', CAI(A, (64, 32), '<f4'))")
    own.ok("bf = DL(A + 8192, (16, 16))")
    own.ok("vmmshim.publish('bf', bf)")
    T.check(own.ok("(bf.exported, bf.freed)") == "(1, 1)", "the DLPack capsule was read and let go, not consumed")
    own.ok("vmmshim.publish('g', Grad(CAI(A + 16384, (8, 8), '<f8', (8, 64))))")  # column-major, byte strides
    own.ok("vmmshim.publish('s', CAI(A + 32768, (), '<i8'))")
    got = reg.tensors(pid)
    w, bf, g, s = got.get("w"), got.get("bf"), got.get("g"), got.get("s")
    T.check(set(got) == {"w", "bf", "g", "s"}, f"four names: {sorted(got)}")
    alloc_a = reg.find(pid, A)
    T.check(w is not None and (w.address, w.nbytes, w.dtype, w.dlpack_dtype, w.shape, w.strides, w.pid, w.alloc_id) ==
            (A, 8192, "float32", (2, 32, 1), (64, 32), (32, 1), pid, alloc_a.id) and w.published_ns > 0,
            f"w as published: {w and vars(w)}")
    T.check(bf is not None and (bf.address, bf.dtype, bf.shape, bf.nbytes) == (A + 8192, "bfloat16", (16, 16), 512),
            f"bf, through DLPack: {bf and vars(bf)}")
    T.check(g is not None and (g.dtype, g.shape, g.strides, g.nbytes) == ("float64", (8, 8), (1, 8), 512),
            f"g, through detach(), byte strides as elements: {g and vars(g)}")
    T.check(s is not None and (s.shape, s.strides, s.nbytes, s.dtype) == ((), (), 8, "int64"), f"a scalar: {s and vars(s)}")
    T.check(repr(w).startswith("<vmmshim.Tensor 'w' of pid"), repr(w))

    # bad input: a clear error, nothing changed
    before = set(reg.tensors(pid))
    own.fails("vmmshim.publish('x' * 128, CAI(A, (4,), '<f4'))", "InvalidArgument",
              "vmmshim.publish: name \"xxxx")
    own.fails("vmmshim.publish('x' * 128, CAI(A, (4,), '<f4'))", "InvalidArgument", "128 bytes long; at most 127")
    own.ok("vmmshim.publish('y' * 127, CAI(A, (4,), '<f4')); vmmshim.unpublish('y' * 127)")
    own.fails("vmmshim.publish('a\\0b', CAI(A, (4,), '<f4'))", "InvalidArgument", "NUL")
    own.fails("vmmshim.publish(5, CAI(A, (4,), '<f4'))", "TypeError", "a name is a str")
    own.ok("host = ctypes.create_string_buffer(4096)")
    own.fails("vmmshim.publish('host', CAI(ctypes.addressof(host), (16,), '<f4'))", "NotFound",
              "not in the shim's memory of this process")
    own.fails("vmmshim.publish('past', CAI(A, (1 << 20,), '<f4'))", "NotFound", "run past")
    own.fails("vmmshim.publish('none', object())", "TypeError", "neither __cuda_array_interface__ nor __dlpack__")
    own.fails("vmmshim.publish('cpu', DL(A, (4,), device=(1, 0)))", "ValueError", "not CUDA")
    own.fails("vmmshim.publish('void', CAI(A, (4,), '<V2'))", "ValueError", "no number type")
    own.fails("vmmshim.publish('masked', CAI(A, (4,), '<f4', mask=CAI(B, (4,), '|b1')))", "ValueError", "masked")
    own.fails("vmmshim.publish('empty', CAI(A, (0, 4), '<f4'))", "InvalidArgument", "no elements")
    own.fails("vmmshim.publish_many({'fine': CAI(A, (4,), '<f4'), 'host': CAI(ctypes.addressof(host), (4,), '<f4')})",
              "NotFound", "vmmshim.publish_many: \"host\"")
    own.fails("vmmshim.publish_many([('fine', CAI(A, (4,), '<f4')), ('cpu', DL(A, (4,), device=(1, 0)))])", "ValueError",
              "(tensor 'cpu')")
    own.fails("vmmshim.publish_many([1, 2])", "TypeError", "mapping or (name, tensor) pairs")
    own.fails("vmmshim.unpublish('never')", "NotFound", "vmmshim.unpublish: no tensor named \"never\"")
    T.check(set(reg.tensors(pid)) == before, f"the failures changed nothing: {sorted(reg.tensors(pid))}")

    # a state dict, and a name published again
    own.ok("model = Model({f'layer{i}.weight': CAI(B + i * 4096, (32, 32), '<f4') for i in range(20)})")
    own.ok("vmmshim.publish_many(model.state_dict())")
    own.ok("vmmshim.publish('w', CAI(A + 65536, (8,), '<i8'))")
    got = reg.tensors(pid)
    T.check(len(got) == 24 and got["layer19.weight"].address == B + 19 * 4096, f"24 names: {len(got)}")
    T.check((got["w"].address, got["w"].dtype, got["w"].shape) == (A + 65536, "int64", (8,)), "w replaced")

    # open them: the owner's bytes, each chunk imported once
    chunks = {(a.chunk_id, a.slot if a.multi_handle else 0): a.n_handles for a in (reg.find(pid, A), reg.find(pid, B))}
    imports = _imports()
    views = reg.open_tensors(pid)
    T.check(_imports() - imports == sum(chunks.values()),
            f"{_imports() - imports} imports for {len(chunks)} chunks of {sum(chunks.values())} handles")
    T.check(set(views) == set(got), "a view per name")
    v = views["w"]
    T.check((v.dtype, v.shape, v.strides, v.nbytes) == ("int64", (8,), (1,), 64), f"w's view: {v!r}")
    T.check(ctypes.string_at(v.ptr, 64) == words(3, 65536 // 8, 8), "w's view reads the owner's bytes")
    v = views["layer7.weight"]
    T.check(ctypes.string_at(v.ptr, 4096) == words(4, 7 * 512, 512) and v.shape == (32, 32), "layer7.weight's bytes")
    v = views["g"]
    T.check(v.strides == (1, 8) and v.__cuda_array_interface__["strides"] == (8, 64), "g keeps its strides")
    T.check(views["bf"].dtype == "bfloat16" and views["bf"].dlpack_dtype == (4, 16, 1), "bf's view is bfloat16")
    some = reg.open_tensors(pid, ["w", "bf"])
    T.check(set(some) == {"w", "bf"}, f"by names: {sorted(some)}")
    T.check(set(reg.open_tensors(pid, "s")) == {"s"}, "one name as a str")
    T.raises(vmmshim.NotFound, lambda: reg.open_tensors(pid, ["w", "missing"]), "open_tensors of a name not published",
             "publishes no tensor named 'missing'")
    del views, some, v

    # open_torch: the published names straight to tensors (torch's calls stood in for, as test_to_torch)
    import test_to_torch
    sys.modules["torch"] = test_to_torch.make_torch()[0]
    try:
        ts = reg.open_torch(pid)
        T.check(set(ts) == set(got) and (ts["w"].dtype, ts["w"].shape) == ("int64", (8,)) and ts["g"].strides == (1, 8) and
                ts["bf"].dtype == "bfloat16" and ctypes.string_at(ts["w"].data_ptr(), 64) == words(3, 65536 // 8, 8) and
                ctypes.string_at(ts["layer7.weight"].data_ptr(), 4096) == words(4, 7 * 512, 512),
                f"open_torch(pid): every published name as a tensor of its dtype, shape and strides: {sorted(ts)}")
        some = reg.open_torch(pid, {k: got[k] for k in ("w", "bf")})
        T.check(list(some) == ["w", "bf"], f"open_torch of some Tensors: {list(some)}")
        del ts, some
        gc.collect()
        vmmshim.drop_idle()
        # the import starts from the table's addresses and sizes; its rows are read while the grant
        # (0.3 s a cuMemSetAccess here) runs on the library's thread
        from vmmshim import _torch
        seen, parse = {}, _torch._table_rows

        def watched(raw, owner):
            seen["maps"], seen["at"] = harness.fakecuda_counters()["calls_cuMemMap"], time.monotonic()
            return parse(raw, owner)
        fake = ctypes.CDLL("libcuda.so.1")
        fake.fakecuda_set_access_delay_us(ctypes.c_ulonglong(300000))
        _torch._table_rows, maps0, t0 = watched, harness.fakecuda_counters()["calls_cuMemMap"], time.monotonic()
        try:
            ts, tm = reg.open_torch(pid, timing=True)
            t1 = time.monotonic()
        finally:
            _torch._table_rows = parse
            fake.fakecuda_set_access_delay_us(ctypes.c_ulonglong(0))
        T.check(seen.get("maps", maps0) > maps0 and seen["at"] - t0 < 0.25 <= t1 - t0 and set(ts) == set(got) and
                tm["names_ns"] > 0 and ctypes.string_at(ts["w"].data_ptr(), 64) == words(3, 65536 // 8, 8),
                f"open_torch(pid): the rows read after the mappings ({seen.get('maps', maps0) - maps0} before them), "
                f"{seen.get('at', t0) - t0:.3f} s into a {t1 - t0:.3f} s take with a 0.3 s grant")
        del ts
    finally:
        sys.modules.pop("torch", None)

    # vmmctl sees them
    out = subprocess.run([str(BUILD / "vmmctl"), "list", "--names", "--pid", str(pid)], capture_output=True, text=True)
    T.check(out.returncode == 0 and re.search(r"\bbf\s+bfloat16\s+16x16\b", out.stdout) and "24 names in 1 process" in out.stdout,
            f"vmmctl list --names: {out.returncode} {out.stdout} {out.stderr}")
    # python -m vmmshim prints the same, table and JSON, for one process and for every living one
    env = dict(os.environ, PYTHONPATH=str(PACKAGE))  # LD_PRELOAD as ours: a sanitizer's runtime, never the shim
    for args in (["--pid", str(pid)], ["--pid", str(pid), "--json"], [], ["--json"]):
        ours = subprocess.run([sys.executable, "-m", "vmmshim", "list", "--names", *args], capture_output=True, text=True,
                              env=env)
        ctl = subprocess.run([str(BUILD / "vmmctl"), "list", "--names", *args], capture_output=True, text=True)
        T.check(ours.returncode == ctl.returncode == 0 and ours.stdout == ctl.stdout and "bfloat16" in ours.stdout,
                f"python -m vmmshim list --names {' '.join(args)} differs from vmmctl's:\n{ours.stdout}{ours.stderr}---\n"
                f"{ctl.stdout}{ctl.stderr}")
    bad = subprocess.run([sys.executable, "-m", "vmmshim", "list", "--names", "--all"], capture_output=True, text=True,
                         env=env)
    T.check(bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--names shows living processes only" in bad.stderr,
            f"--names --all refused in one line: {bad.returncode} {bad.stderr!r}")

    # freeing B drops its 20 names; unpublish drops one
    old = got
    own.ok("free(B)")
    got = reg.tensors(pid)
    T.check(set(got) == {"w", "bf", "g", "s"}, f"freeing B dropped the state dict: {sorted(got)}")
    T.raises(vmmshim.NotFound, lambda: reg.open_tensors(pid, ["layer0.weight"]), "a name whose memory was freed",
             "layer0.weight")
    sys.modules["torch"] = test_to_torch.make_torch()[0]
    try:
        T.raises(vmmshim.NotFound, lambda: reg.open_torch(pid, {"l0": old["layer0.weight"]}),
                 "open_torch of a Tensor whose memory was freed")
        # the same bytes again, now another allocation's: the name read earlier is stale
        own.ok("B2 = alloc(1 << 20)")
        B2 = int(own.ok("B2"))
        if B2 == B:
            T.raises(vmmshim.Stale, lambda: reg.open_torch(pid, {"l0": old["layer0.weight"]}),
                     "open_torch of a Tensor whose address another allocation holds now", "was freed since")
        else:
            T.check(False, f"the owner's pool gave the freed 1 MiB back at 0x{B:x}, not 0x{B2:x}: no stale name to try")
        own.ok("free(B2)")
    finally:
        sys.modules.pop("torch", None)
    own.ok("vmmshim.unpublish('bf')")
    T.check(set(reg.tensors(pid)) == {"w", "g", "s"}, "unpublished")
    own.fails("vmmshim.unpublish('bf')", "NotFound", "no tensor named")


def _imports():
    lib = ctypes.CDLL("libcuda.so.1")
    text = (ROOT / "tests" / "fakecuda" / "fakecuda.h").read_text()
    block = re.search(r"#define FAKECUDA_COUNTER_FIELDS\(X\)(.*?)\n\n", text, re.S).group(1)
    names = re.findall(r"X\((\w+)\)", re.sub(r"/\*.*?\*/", "", block, flags=re.S))
    counters = type("C", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_ulonglong) for n in names]})()
    lib.fakecuda_counters(ctypes.byref(counters))
    return counters.imports


if __name__ == "__main__":
    main()
