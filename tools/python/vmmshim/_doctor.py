"""vmmshim doctor: whether the shim can work here, one line a check:

    ok    driver    libcuda.so.1 (/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06), version 13.0 (13000)
    FAIL  devices   ...

the shim and its files; the driver (libcuda.so.1 loads? cuDriverGetVersion, cuInit); each device
(name, VMM support, POSIX-fd export); FABRIC handles and IMEX channels (information: the shim
uses them only when they work); the registry and the broker directory and their permissions (as
the shim and its broker will judge them); then a test program under the shim (a Python child,
LD_PRELOAD as `vmmshim run` sets it, allocating with cuMemAlloc through the driver) whose
allocation must be published in the registry and backed exportably, and this process importing
it and reading its bytes back as a companion does.  Exit status 1 when any check FAILs (what would
stop the shim from backing or sharing memory), else 0; `warn` lines do not count."""
import ctypes
import os
import pwd
import stat
import subprocess
import sys
import time

from . import _paths, _run

# cuda.h
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"

# The test program: under the shim, allocate with the driver API (no runtime needed), write a
# pattern, say where it is, wait to be told to free.
CHILD = r"""
import ctypes, os, sys
maps = open("/proc/self/maps").read()
shim = [l.split()[-1] for l in maps.splitlines() if l.endswith("/libvmmshim.so")]
if not shim:
    print("noshim"); sys.exit(3)
cu = ctypes.CDLL("libcuda.so.1")
def ck(rc, what):
    if rc:
        s = ctypes.c_char_p(); cu.cuGetErrorName(rc, ctypes.byref(s))
        print(f"cuda {what} {rc} {(s.value or b'?').decode()}", flush=True); sys.exit(4)
ck(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
size = int(sys.argv[1])
ptr = ctypes.c_uint64()
ck(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
data = bytes((i * 7 + 3) & 0xff for i in range(4096))
ck(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr.value), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")
print(f"ready {os.getpid()} {ptr.value} {shim[0]}", flush=True)
sys.stdin.readline()
ck(cu.cuMemFree_v2(ctypes.c_uint64(ptr.value)), "cuMemFree")
print("freed", flush=True)
"""
PATTERN = bytes((i * 7 + 3) & 0xFF for i in range(4096))
TEST_SIZE = 2 << 20


class Report:
    def __init__(self, out):
        self.out, self.failed, self.warned, self.passed = out, [], 0, 0

    def line(self, level, check, text):
        self.out.write(f"{level:<5} {check:<9} {text}\n")
        self.out.flush()
        if level == "FAIL":
            self.failed.append(check)
        elif level == "warn":
            self.warned += 1
        elif level == "ok":
            self.passed += 1

    ok = lambda self, c, t: self.line("ok", c, t)
    warn = lambda self, c, t: self.line("warn", c, t)
    info = lambda self, c, t: self.line("info", c, t)
    fail = lambda self, c, t: self.line("FAIL", c, t)


def _loaded_path(fragment):
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if fragment in os.path.basename(p):
                    return p
    except OSError:
        pass
    return None


def options():
    """{VMMSHIM_*: value} as the shim will take them (environment, then VMMSHIM_CONFIG's file),
    from `vmmctl config`; the environment alone when vmmctl is missing."""
    got = {k: v for k, v in os.environ.items() if k.startswith("VMMSHIM_")}
    ctl = _paths.vmmctl()
    if not ctl:
        return got
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    try:
        r = subprocess.run([ctl, "config"], capture_output=True, text=True, env=env, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return got
    for line in r.stdout.splitlines()[1:]:
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0].startswith("VMMSHIM_"):
            got[parts[0]] = "" if parts[1] == "''" else parts[1]
    return got


def check_shim(rep):
    shim = _paths.shim_lib()
    if not shim or not os.path.isfile(shim):
        rep.fail("shim", f"libvmmshim.so not found ({shim or 'not bundled, no build/'}; set VMMSHIM_SHIM_LIB)")
        return None
    beside = os.path.join(os.path.dirname(shim), "libunwind.so.8")
    extra = "" if os.path.exists(beside) else "; no libunwind.so.8 beside it (VMMSHIM_FRAMES records nothing)"
    where = "bundled in the wheel" if _paths.bundled() and shim == str(_paths.NATIVE / "lib" / "libvmmshim.so") \
        else "named by VMMSHIM_SHIM_LIB" if os.environ.get("VMMSHIM_SHIM_LIB") else "a source tree's build"
    rep.ok("shim", f"{shim} ({where}){extra}")
    return shim


def check_driver(rep):
    """The libcuda handle and its device count, or (None, 0)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        rep.fail("driver", f"libcuda.so.1 not loadable: {e} (no NVIDIA driver here, or not on the loader's path)")
        return None, 0
    path = _loaded_path("libcuda.so") or "libcuda.so.1"
    v = ctypes.c_int()
    rc = cu.cuDriverGetVersion(ctypes.byref(v))
    if rc:
        rep.fail("driver", f"{path}: cuDriverGetVersion failed ({rc})")
        return None, 0
    rc = cu.cuInit(0)
    if rc:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        rep.fail("driver", f"{path}, version {v.value // 1000}.{v.value % 1000 // 10} ({v.value}): cuInit failed: "
                           f"{(name.value or b'?').decode()} ({rc})")
        return None, 0
    n = ctypes.c_int()
    if cu.cuDeviceGetCount(ctypes.byref(n)):
        n.value = 0
    rep.ok("driver", f"{path}, version {v.value // 1000}.{v.value % 1000 // 10} ({v.value})")
    return cu, n.value


def check_devices(rep, cu, count):
    if not cu:
        return
    if count == 0:
        rep.fail("devices", "no CUDA device")
        return
    usable, fabric = 0, 0
    for i in range(count):
        dev = ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), i)
        name = ctypes.create_string_buffer(256)
        cu.cuDeviceGetName(name, 256, dev)

        def attr(a):
            v = ctypes.c_int()
            return v.value if cu.cuDeviceGetAttribute(ctypes.byref(v), a, dev) == 0 else 0
        vmm = attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        fd = attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
        fabric += bool(attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED))
        text = (f"device {i} of {count}: {name.value.decode(errors='replace')}, VMM {'yes' if vmm else 'no'}, "
                f"POSIX-fd export {'yes' if fd else 'no'}")
        if vmm and fd:
            usable += 1
            rep.ok("devices", text)
        else:
            (rep.warn if count > 1 else rep.fail)("devices", text + " (the shim passes this device's calls through)")
    if count > 1 and not usable:
        rep.fail("devices", "no device supports VMM with POSIX-fd export: nothing can be backed")
    chans = IMEX_CHANNELS
    has = os.path.isdir(chans) and os.listdir(chans)
    rep.info("fabric", f"FABRIC handles supported on {fabric} of {count} device(s); {chans} "
                       f"{'holds ' + ', '.join(sorted(os.listdir(chans))) if has else 'absent' if not os.path.isdir(chans) else 'empty'}"
                       f" (VMMSHIM_FABRIC=auto uses them only if a start-up self-test proves they work)")


def _who(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_registry(rep, opts):
    name = opts.get("VMMSHIM_REGISTRY") or f"/vmmshim-{os.getuid()}"
    if not name.startswith("/"):
        name = "/" + name
    path = "/dev/shm" + name
    group = opts.get("VMMSHIM_REGISTRY_GROUP")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if os.access("/dev/shm", os.W_OK | os.X_OK):
            rep.ok("registry", f"{name} ({path}): not made yet; the first process under the shim makes it "
                               f"(mode {'0660' if group else '0600'}) in /dev/shm, which is writable")
        else:
            rep.fail("registry", f"{name}: /dev/shm is not writable by uid {os.geteuid()}: no process can publish")
        return name
    except OSError as e:
        rep.fail("registry", f"{name} ({path}): {e.strerror}")
        return name
    mode = stat.S_IMODE(st.st_mode)
    desc = f"{name} ({path}): owner {_who(st.st_uid)}, mode {mode:04o}"
    if not stat.S_ISREG(st.st_mode):
        rep.fail("registry", desc + ": not a regular shared-memory object")
    elif st.st_uid != os.geteuid():
        rep.fail("registry", desc + f": another user's; a process of {_who(os.geteuid())} refuses to publish in it "
                                    "(set VMMSHIM_REGISTRY to a name of your own)")
    elif mode & 0o007:
        rep.fail("registry", desc + ": world-accessible; the shim refuses it (remove it: `vmmctl gc` cannot)")
    elif not os.access(path, os.R_OK | os.W_OK):
        rep.fail("registry", desc + ": not readable and writable here")
    else:
        rep.ok("registry", desc)
    return name


def broker_dir(opts):
    d = opts.get("VMMSHIM_BROKER_DIR")
    if d:
        return d.rstrip("/") or "/"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and xdg.startswith("/") and os.access(xdg, os.W_OK | os.X_OK):
        return xdg + "/vmmshim"
    return f"/tmp/vmmshim-{os.geteuid()}"


def check_broker_dir(rep, opts):
    d = broker_dir(opts)
    group = bool(opts.get("VMMSHIM_BROKER_GROUP"))
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        parent = os.path.dirname(d) or "/"
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            rep.ok("broker", f"{d}: not made yet; the first broker makes it (mode {'0750' if group else '0700'})")
        else:
            rep.fail("broker", f"{d}: cannot be made ({parent} is not a writable directory): no companion can import")
        return
    except OSError as e:
        rep.fail("broker", f"{d}: {e.strerror}")
        return
    mode = stat.S_IMODE(st.st_mode)
    desc = f"{d}: owner {_who(st.st_uid)}, mode {mode:04o}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        rep.fail("broker", desc + ": not a directory (a symlink or a file); the broker refuses it")
    elif st.st_uid != os.geteuid():
        rep.fail("broker", desc + ": another user's; the broker refuses it (set VMMSHIM_BROKER_DIR)")
    elif mode & 0o022:
        rep.fail("broker", desc + ": others may write to it; the broker refuses it")
    else:
        rep.ok("broker", desc)


def check_run(rep, registry):
    """The shim in a test program, its allocation published and imported here."""
    shim = _paths.shim_lib()
    env = dict(os.environ)
    env["LD_PRELOAD"] = _run.compose_preload(os.path.abspath(shim), env.get("LD_PRELOAD", ""))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(TEST_SIZE)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    except OSError as e:
        rep.fail("shim", f"cannot start a test program: {e}")
        return
    try:
        line = child.stdout.readline().split()
        if not line or line[0] != "ready":
            child.stdin.close()
            err = child.stderr.read().strip().splitlines()
            child.wait(30)
            why = " ".join(line) if line else f"exit status {child.returncode}"
            if line and line[0] == "noshim":
                why = "libvmmshim.so is not in its memory map"
            shim_says = [e for e in err if e.startswith("vmmshim")][:1]
            rep.fail("shim", f"the test program under the shim failed: {why}"
                             f"{': ' + shim_says[0] if shim_says else ': ' + err[-1] if err else ''}")
            return
        pid, address = int(line[1]), int(line[2])
        _check_published(rep, registry, pid, address, line[3])
    finally:
        if child.poll() is None:
            try:
                child.stdin.write("\n")
                child.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _check_published(rep, registry, pid, address, shim_path):
    from . import Error, Registry, ALLOC_NOT_EXPORTABLE, KIND_BROKER
    try:
        reg = Registry(registry)
    except Error as e:
        rep.fail("shim", f"the test program (pid {pid}) runs with {shim_path}, but the registry cannot be read: {e}")
        return
    with reg:
        try:
            a = reg.find(pid, address)
        except Error as e:
            # the reason the shim gave, from its log line, is on the child's stderr: the caller reads it
            rep.fail("shim", f"the test program (pid {pid}) loaded {shim_path}, but its cuMemAlloc of "
                             f"{TEST_SIZE >> 20} MiB at 0x{address:x} is not in registry {registry}: {e} "
                             "(VMMSHIM_VERBOSE=1 vmmshim run -- ... says why)")
            return
        if a.flags & ALLOC_NOT_EXPORTABLE or not a.handle_kinds & KIND_BROKER:
            rep.fail("shim", f"pid {pid}'s allocation 0x{address:x} is published but not exportable")
            return
        rep.ok("shim", f"loads into a test program (pid {pid}) and backs its cuMemAlloc: 0x{address:x}, "
                       f"{a.size >> 20} MiB, api {a.api}, exportable (broker), in registry {registry}")
        t0 = time.monotonic()
        try:
            with reg.open(pid, address) as buf:
                data = buf.read(0, len(PATTERN))
        except Error as e:
            rep.fail("import", f"this process could not import pid {pid}'s allocation: {e}")
            return
        ms = (time.monotonic() - t0) * 1000
        if data != PATTERN:
            rep.fail("import", f"imported pid {pid}'s allocation, but its bytes differ from what it wrote")
        else:
            rep.ok("import", f"another process (this one) imported pid {pid}'s allocation through its broker and "
                             f"read back the bytes it wrote ({ms:.1f} ms)")


def main(argv, out=None):
    out = out or sys.stdout
    if argv and argv[0] in ("-h", "--help"):
        out.write("usage: vmmshim doctor\n\n" + __doc__)
        return 0
    if argv:
        sys.stderr.write(f"vmmshim: error: doctor takes no arguments ({' '.join(argv)})\n")
        return 2
    rep = Report(out)
    shim = check_shim(rep)
    cu, count = check_driver(rep)
    check_devices(rep, cu, count)
    opts = options()
    if opts.get("VMMSHIM_ENABLE", "1").lower() in ("0", "false", "no", "off"):
        rep.fail("options", "VMMSHIM_ENABLE=0: the shim passes every call through")
    registry = check_registry(rep, opts)
    check_broker_dir(rep, opts)
    if shim and cu and count and not rep.failed:
        check_run(rep, registry)
    elif shim:
        rep.info("shim", "test program not run: " + ", ".join(dict.fromkeys(rep.failed)) + " failed above")
    if rep.failed:
        out.write(f"vmmshim doctor: FAIL ({', '.join(dict.fromkeys(rep.failed))}): the shim cannot work here as "
                  f"things stand ({rep.passed} ok, {rep.warned} warnings)\n")
        return 1
    out.write(f"vmmshim doctor: ok ({rep.passed} checks passed, {rep.warned} warnings)\n")
    return 0
