"""The Python companion (tools/python/vmmshim) over the emulated driver: owners run tests/progs/owner
under the shim; the package lists them, opens, reads and checks their buffers (interior addresses,
a bad address, a freed buffer, a SIGKILLed owner), exports DLPack capsules (read back through ctypes,
consumed and unconsumed), mirrors vmmshim.h's structures (offsets from a C program compiled here),
prints what `vmmctl list --json` prints, and installs with pip.  Ends with "N passed, N failed"."""
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import weakref

import harness
from harness import BUILD, PACKAGE, ROOT, Owner, fnv1a, pattern

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)
from vmmshim import _dlpack, _lib  # noqa: E402

T = harness.Tally()
MiB = 1 << 20


def c_layout(tmp):
    """{struct: (sizeof, {field: (offset, size)})} of vmmshim.h, from a C program compiled here."""
    structs = {"vmm_alloc_info": _lib.AllocInfo, "vmm_proc_info": _lib.ProcInfo}
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <vmmshim.h>", "int main(void) {"]
    for name, cls in structs.items():
        lines.append(f'    printf("{name} - %zu 0\\n", sizeof({name}));')
        for field, _ in cls._fields_:
            lines.append(f'    printf("{name} {field} %zu %zu\\n", offsetof({name}, {field}), '
                         f'sizeof((({name} *)0)->{field}));')
    lines += ["    return 0;", "}"]
    src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
    with open(src, "w") as f:
        f.write("\n".join(lines) + "\n")
    cc = os.environ.get("CC", "cc")
    build = subprocess.run([cc, "-std=c11", f"-I{ROOT / 'tools' / 'include'}", src, "-o", exe],
                           capture_output=True, text=True)
    if build.returncode != 0:
        return None, build.stderr.strip().splitlines()[:3]
    out = {}
    for line in subprocess.run([exe], capture_output=True, text=True, check=True).stdout.splitlines():
        struct, field, a, b = line.split()
        entry = out.setdefault(struct, [0, {}])
        if field == "-":
            entry[0] = int(a)
        else:
            entry[1][field] = (int(a), int(b))
    return out, None


def header_fields(struct):
    """The member names of `typedef struct <struct> {...}` in vmmshim.h (its types are in
    shim/api/vmm_api.h, which it includes), in order: a field the header gains inside the padding
    at the end changes no size, but shows here."""
    text = (ROOT / "shim" / "api" / "vmm_api.h").read_text()
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        declarators = re.match(r"(?:const\s+)?\w+\s+(.*)", decl, re.S).group(1)
        names += [re.match(r"\**\s*(\w+)", d.strip()).group(1) for d in declarators.split(",")]
    return names


def test_layout(tmp):
    layout, err = c_layout(tmp)
    if not T.check(layout is not None, f"the layout program does not build: {err}"):
        return
    for struct, cls in (("vmm_alloc_info", _lib.AllocInfo), ("vmm_proc_info", _lib.ProcInfo)):
        size, fields = layout[struct]
        T.check(ctypes.sizeof(cls) == size, f"sizeof({struct}): C {size}, ctypes {ctypes.sizeof(cls)}")
        T.check([f for f, _ in cls._fields_] == header_fields(struct),
                f"{struct}'s members in vmmshim.h differ from ctypes: {header_fields(struct)}")
        drift = [(f, fields[f], (getattr(cls, f).offset, getattr(cls, f).size)) for f, _ in cls._fields_
                 if fields[f] != (getattr(cls, f).offset, getattr(cls, f).size)]
        T.check(not drift, f"{struct} (offset, size) C vs ctypes: {drift}")
    # dlpack.h's layout on LP64: DLTensor is 48 bytes, DLManagedTensor 64
    t = _dlpack.DLTensor
    T.check(ctypes.sizeof(t) == 48 and ctypes.sizeof(_dlpack.DLManagedTensor) == 64 and
            [t.data.offset, t.device.offset, t.ndim.offset, t.dtype.offset, t.shape.offset, t.strides.offset,
             t.byte_offset.offset] == [0, 8, 16, 20, 24, 32, 40] and _dlpack.DLManagedTensor.deleter.offset == 56,
            "DLTensor / DLManagedTensor layout differs from dlpack.h")


def test_list(reg, own):
    allocs = reg.allocations(own.pid)
    T.check([(a.address, a.size) for a in allocs] == [(b[0], b[1]) for b in own.buffers],
            f"allocations({own.pid}): {allocs} vs the owner's {own.buffers}")
    T.check([a.api for a in allocs] == ["cudaMalloc", "cudaMalloc", "cudaMallocAsync"],
            f"apis: {[a.api for a in allocs]}")
    a = allocs[0]
    T.check(a.pid == own.pid and a.device == 0 and a.tag == "" and re.fullmatch(r"[0-9a-f]{32}", a.id) and
            a.owner_alive == vmmshim.OWNER_ALIVE and a.owner == "alive" and a.exportable and
            a.handle_kinds & vmmshim.KIND_BROKER and a.generation > 0 and a.created_ns > 0 and a.stream == 0,
            f"the first record: {vars(a)}")
    # 3 MiB cudaMalloc: 2 MiB-rounded in a segment of its own size; the small one shares a 2 MiB one
    T.check(a.mapped_size == 4 * MiB and a.extent == 4 * MiB and a.chunk_id > 0 and a.chunk_offset == 0,
            f"the 3 MiB record's chunk: {a.mapped_size} {a.extent} {a.chunk_id} {a.chunk_offset}")
    T.check(allocs[1].shared_chunk and allocs[1].flags & vmmshim.ALLOC_SHARED_CHUNK and allocs[1].mapped_size == 2 * MiB,
            f"the small record shares a chunk: {vars(allocs[1])}")
    T.check(len(reg.allocations()) >= 3 and all(x.pid == own.pid for x in allocs), "allocations() and its pid filter")
    found = reg.find(own.pid, own.buffers[2][0] + 100)
    T.check(found.id == allocs[2].id and found.address == own.buffers[2][0], "find by an interior address")
    procs = [p for p in reg.processes() if p.pid == own.pid]
    T.check(len(procs) == 1 and procs[0].state == "alive" and procs[0].n_allocs == 3 and
            "progs/owner 3 0.01 1a" in procs[0].cmdline and procs[0].broker_path and procs[0].uid == os.getuid(),
            f"processes(): {procs}")
    p = reg.process(own.pid)
    T.check(p.bytes_requested == sum(b[1] for b in own.buffers), f"process(): {vars(p)}")
    T.check(p.allocs == 3 and p.allocs_backed == 3 and p.unpublished == 0 and p.passed_capture == 0 and
            p.passed_device_full == 0 and p.peak_requested == sum(b[1] for b in own.buffers),
            f"process() coverage counters: {vars(p)}")


def test_read(reg, own):
    for i, (address, size, fnv) in enumerate(own.buffers):
        with reg.open(own.pid, address) as buf:
            T.check(buf.address == address and buf.size == size and buf.device == 0 and buf.ptr != 0,
                    f"buffer {i}: {buf}")
            T.check(fnv1a(buf.read()) == fnv, f"buffer {i}: the bytes read differ from the owner's (fnv {fnv})")
    address, size, _ = own.buffers[0]
    with reg.open(own.pid, address + 12345) as buf:
        T.check(buf.address == address and buf.size == size and buf.allocation.address == address,
                f"an interior address opens the whole allocation: {buf}")
        T.check(buf.read(0, 16) == pattern(0, 0, 16) and buf.read(100, 50) == pattern(0, 100, 50) and
                buf.read(size - 3) == pattern(0, size - 3, 3) and buf.read(size, 0) == b"",
                "read(offset, length) pieces")
        T.raises(vmmshim.InvalidArgument, lambda: buf.read(size - 1, 2), "a read past the end", str(size))
        T.raises(ValueError, lambda: buf.read(-1, 2), "a negative offset")
    # the same allocation twice at once: one mapping, two handles
    with reg.open(own.pid, address) as b1, reg.open(own.pid, address + 1) as b2:
        T.check(b1.ptr == b2.ptr, f"two opens of one allocation: {b1.ptr:#x} {b2.ptr:#x}")
    buf = reg.open(own.pid, address)
    buf.close()
    buf.close()
    T.raises(ValueError, buf.read, "read of a closed buffer", "closed")
    T.raises(ValueError, lambda: buf.ptr, "ptr of a closed buffer", "closed")
    T.raises(ValueError, buf.__dlpack__, "__dlpack__ of a closed buffer", "closed")


def test_errors(reg, own):
    e = T.raises(vmmshim.NotFound, lambda: reg.open(own.pid, 0x10), "a bad address", "no live allocation")
    T.check(isinstance(e, vmmshim.Error) and e.status == 2, f"NotFound is an Error with status 2: {e!r}")
    T.raises(vmmshim.NotFound, lambda: reg.find(own.pid, own.buffers[0][0] + 20 * MiB), "past the allocations")
    T.raises(vmmshim.NotFound, lambda: vmmshim.Registry("/vmmshim-pytest-missing"), "a missing registry",
             "does not exist")
    r = vmmshim.Registry()
    r.close()
    r.close()
    T.raises(ValueError, r.allocations, "a closed registry", "closed")
    bad = subprocess.run([sys.executable, "-c", "import vmmshim; vmmshim.Registry()"], capture_output=True,
                         text=True, env=dict(os.environ, VMMSHIM_CLIENT_LIB="/nonexistent/libvmmshim-client.so",
                                             PYTHONPATH=str(PACKAGE)))
    T.check(bad.returncode != 0 and "LibraryNotFound" in bad.stderr and "VMMSHIM_CLIENT_LIB" in bad.stderr,
            f"a missing library: {bad.stderr[-300:]}")
    if _lib.SOURCE_TREE_LIB.exists():
        env = {k: v for k, v in os.environ.items() if k != "VMMSHIM_CLIENT_LIB"}
        found = subprocess.run([sys.executable, "-c", "from vmmshim import _lib; print(_lib.lib()._name)"],
                               capture_output=True, text=True, env=dict(env, PYTHONPATH=str(PACKAGE)))
        T.check(found.stdout.strip() == str(_lib.SOURCE_TREE_LIB), f"from the source tree: {found.stdout}{found.stderr}")


class ManagedView:
    """A consumer's view of a "dltensor" capsule, through the C API as torch.from_dlpack does it."""
    api = ctypes.PyDLL(None)
    get_pointer = api.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    get_name = api.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    set_name = api.PyCapsule_SetName
    set_name.restype, set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]

    def __init__(self, capsule):
        self.address = self.get_pointer(capsule, b"dltensor")
        self.managed = _dlpack.DLManagedTensor.from_address(self.address)

    @classmethod
    def consume(cls, capsule):
        view = cls(capsule)
        cls.set_name(capsule, b"used_dltensor")  # static, as a consumer's would be
        return view

    def delete(self):
        self.managed.deleter(self.address)


def test_dlpack(reg, own):
    address, size, fnv = own.buffers[0]
    buf = reg.open(own.pid, address)
    T.check(buf.__dlpack_device__() == (2, 0), f"__dlpack_device__: {buf.__dlpack_device__()}")
    before = _dlpack.live_exports()
    cap = buf.__dlpack__(stream=None)
    T.check(ManagedView.get_name(cap) == b"dltensor", f"capsule name {ManagedView.get_name(cap)}")
    view = ManagedView.consume(cap)
    t = view.managed.dl_tensor
    T.check(t.data == buf.ptr and t.byte_offset == 0 and t.ndim == 1 and (t.device.device_type, t.device.device_id) ==
            (2, 0) and (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, 8, 1) and t.shape[0] == size and
            (not t.strides or t.strides[0] == 1),
            "the DLManagedTensor: data, device, 1-D uint8, shape, strides")
    # the emulated device memory is host memory: the tensor's data pointer is the import itself
    T.check(fnv1a(ctypes.string_at(t.data, t.shape[0])) == fnv, "the tensor's bytes are the owner's (zero-copy)")
    T.check(_dlpack.live_exports() == before + 1, "the export is held")
    buf.close()
    T.check(buf._imp is not None, "close() with a live tensor keeps the import")
    T.check(fnv1a(ctypes.string_at(t.data, 4096)) == fnv1a(pattern(0, 0, 4096)), "the tensor outlives close()")
    del cap  # renamed: its destructor must leave the tensor alone
    gc.collect()
    T.check(_dlpack.live_exports() == before + 1 and buf._imp is not None, "a consumed capsule's death frees nothing")
    view.delete()
    T.check(_dlpack.live_exports() == before and buf._imp is None, "the consumer's deleter releases the import")

    # unconsumed: the capsule's destructor deletes the tensor, the buffer stays open
    buf = reg.open(own.pid, address)
    cap = buf.__dlpack__(max_version=(1, 0))
    T.check(ManagedView.get_name(cap) == b"dltensor" and _dlpack.live_exports() == before + 1,
            "max_version (1, 0) still gets an unversioned capsule")
    del cap
    gc.collect()
    T.check(_dlpack.live_exports() == before and buf._imp is not None and buf.read(0, 8) == pattern(0, 0, 8),
            "an unconsumed capsule's destructor deletes the tensor, the buffer stays open")

    # the tensor keeps the Buffer object itself alive; its deleter lets it go
    cap = buf.__dlpack__(dl_device=(2, 0))
    ref = weakref.ref(buf)
    del buf
    gc.collect()
    T.check(ref() is not None, "an exported buffer is kept alive by its tensor")
    view = ManagedView.consume(cap)
    del cap
    view.delete()
    gc.collect()
    T.check(ref() is None and _dlpack.live_exports() == before, "the deleter lets the buffer go")

    with reg.open(own.pid, address) as buf:
        T.raises(BufferError, lambda: buf.__dlpack__(copy=True), "copy=True", "without copying")
        T.raises(BufferError, lambda: buf.__dlpack__(dl_device=(1, 0)), "another device")


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(PACKAGE))
    return subprocess.run([sys.executable, "-m", "vmmshim", *args], capture_output=True, text=True, env=env)


def run_vmmctl(*args):
    return subprocess.run([str(BUILD / "vmmctl"), *args], capture_output=True, text=True)


def same_listing(args, what):
    """python -m vmmshim and vmmctl print the same, but for ages (they tick between the runs)."""
    ours, theirs = run_cli(*args), run_vmmctl(*args)
    ages = re.compile(r'"age_s": \d+|\d+s(?= )')
    # the hint for dead owners names the tool that printed it
    a = ages.sub("AGE", ours.stdout).replace("python -m vmmshim list", "vmmctl list")
    b = ages.sub("AGE", theirs.stdout)
    T.check(ours.returncode == theirs.returncode == 0 and a == b and a,
            f"{what}: `python -m vmmshim {' '.join(args)}` differs from vmmctl's:\n{a}\n---\n{b}\n{ours.stderr}")


def test_cli(own):
    same_listing(["list", "--json"], "list --json")
    same_listing(["list", "--json", "--pid", str(own.pid)], "list --json --pid")
    same_listing(["list"], "list")
    same_listing(["list", "--all", "--json"], "list --all --json")
    missing = run_cli("--registry", "/vmmshim-pytest-missing", "list")
    T.check(missing.returncode == 1 and missing.stdout == "" and missing.stderr.count("\n") == 1 and
            missing.stderr.startswith("vmmshim: error: ") and "does not exist" in missing.stderr,
            f"a missing registry: {missing.returncode} {missing.stderr!r}")
    usage = run_cli("list", "--pid", "12x")
    T.check(usage.returncode == 2 and usage.stderr.count("\n") == 1 and "12x" in usage.stderr,
            f"a usage error: {usage.returncode} {usage.stderr!r}")


def test_dead_owner(reg):
    own = Owner("1", "0.5")
    held = reg.open(own.pid, own.buffers[0][0])
    own.kill()
    T.check([a.owner for a in reg.allocations(own.pid)] == ["dead", "dead"], "a killed owner's records read dead")
    T.check(reg.process(own.pid).state == "dead", "a killed owner's process reads dead")
    T.raises(vmmshim.OwnerDead, lambda: reg.open(own.pid, own.buffers[1][0]), "open of a killed owner's buffer",
             f"pid {own.pid}")
    T.check(fnv1a(held.read()) == own.buffers[0][2], "a buffer held across the owner's death still reads its bytes")
    T.raises(vmmshim.OwnerDead, held.check, "check() of a buffer whose owner died", f"{own.pid}")
    held.close()
    same_listing(["list", "--all", "--json"], "list --all --json with a dead owner")
    same_listing(["list"], "list with a dead owner (hidden, counted)")


def test_freed(reg, own):
    address = own.buffers[0][0]
    held = reg.open(own.pid, address)
    try:
        held.check()
        live = True
    except vmmshim.Error as e:
        live = e
    T.check(live is True, f"check() of a live buffer: {live}")
    T.check(own.command("free") == "freed", "the owner frees its buffers")
    T.raises(vmmshim.NotFound, lambda: reg.open(own.pid, address), "open of a freed buffer", "no live allocation")
    T.raises(vmmshim.Stale, held.check, "check() of a buffer its owner freed")
    T.check(held.read(0, 16) == pattern(0, 0, 16), "a buffer its owner freed still reads (nothing reused its bytes)")
    held.close()


def test_pip(tmp):
    """pip install tools/python works offline (--no-index, --no-build-isolation: this machine's
    setuptools).  setuptools older than 70.1 needs the wheel package to build a wheel; without it
    the package is checked as setuptools sees it instead: its sdist holds every module."""
    src = os.path.join(tmp, "src")
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    can_wheel = subprocess.run([sys.executable, "-c", "import setuptools.command.bdist_wheel"],
                               capture_output=True).returncode == 0 or \
        subprocess.run([sys.executable, "-c", "import wheel, setuptools"], capture_output=True).returncode == 0
    modules = sorted(p.name for p in (PACKAGE / "vmmshim").glob("*.py"))
    if can_wheel:
        target = os.path.join(tmp, "site")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation",
                              "--no-deps", "--target", target, src], capture_output=True, text=True)
        T.check(pip.returncode == 0, f"pip install tools/python: {pip.stderr[-500:]}")
        got = subprocess.run([sys.executable, "-c", "import vmmshim; print(vmmshim.__file__); "
                              "print(len(vmmshim.Registry().allocations()))"],
                             capture_output=True, text=True, cwd=tmp, env=dict(os.environ, PYTHONPATH=target))
        T.check(got.returncode == 0 and got.stdout.startswith(os.path.join(target, "vmmshim")),
                f"the installed package imports and lists: {got.stdout}{got.stderr[-300:]}")
        installed = sorted(p for p in os.listdir(os.path.join(target, "vmmshim")) if p.endswith(".py"))
        T.check(installed == modules, f"installed modules {installed}, source {modules}")
        return
    print("note: no wheel-capable setuptools here (no `wheel` package, setuptools < 70.1): pip install not run; "
          "checking setuptools' sdist of tools/python instead", flush=True)
    out = os.path.join(tmp, "dist")
    sdist = subprocess.run([sys.executable, "-c", "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))",
                            out], capture_output=True, text=True, cwd=src)
    if not T.check(sdist.returncode == 0, f"setuptools cannot build tools/python: {sdist.stderr[-500:]}"):
        return
    name = sdist.stdout.strip().splitlines()[-1]
    with tarfile.open(os.path.join(out, name)) as tar:
        packed = sorted(os.path.basename(n) for n in tar.getnames() if re.search(r"/vmmshim/[^/]+\.py$", n))
    T.check(name.startswith("vmmshim-" + vmmshim.__version__) and packed == modules,
            f"the sdist {name} holds {packed}, the source {modules}")


def main():
    tmp = tempfile.mkdtemp(prefix="vmmshim-pytest-")
    own = None
    try:
        test_layout(tmp)
        own = Owner("3", "0.01", "1a")
        reg = vmmshim.Registry()
        test_list(reg, own)
        test_read(reg, own)
        test_errors(reg, own)
        test_dlpack(reg, own)
        test_cli(own)
        test_dead_owner(reg)
        test_freed(reg, own)
        test_pip(tmp)
        reg.close()
    finally:
        if own:
            own.end()
        shutil.rmtree(tmp, ignore_errors=True)
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
