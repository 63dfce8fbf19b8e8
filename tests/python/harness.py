"""Shared by tests/python/test_*.py: the build under test, owners running tests/progs/owner under
the shim over the emulated driver, FNV-1a, and the closing "N passed, N failed" tally."""
import ctypes
import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("VMMSHIM_TEST_BUILD") or ROOT / "build").resolve()
FAKECUDA = BUILD / "fakecuda"
PACKAGE = ROOT / "tools" / "python"


def setup():
    """Private registry and broker directory, the build's client library, the package on sys.path,
    and the emulated driver on LD_LIBRARY_PATH: the loader reads that only at start, so a run
    without it re-executes itself with it."""
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    if str(FAKECUDA) not in paths:
        env = dict(os.environ, LD_LIBRARY_PATH=":".join([str(FAKECUDA)] + [p for p in paths if p]))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    os.environ["VMMSHIM_REGISTRY"] = f"/vmmshim-pytest-{os.getpid()}"
    os.environ["VMMSHIM_BROKER_DIR"] = f"/tmp/vmmshim-pytest-{os.getpid()}"
    os.environ["VMMSHIM_CLIENT_LIB"] = str(BUILD / "libvmmshim-client.so")
    # nothing written into the source tree (the package's __pycache__)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(PACKAGE))


def cleanup():
    name = os.environ.get("VMMSHIM_REGISTRY", "")
    if name.startswith("/vmmshim-pytest-"):
        try:
            os.unlink("/dev/shm" + name)
        except FileNotFoundError:
            pass
    shutil.rmtree(os.environ.get("VMMSHIM_BROKER_DIR", ""), ignore_errors=True)


def fnv1a(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def pattern(index, offset, length):
    """The bytes tests/progs/owner writes into its buffer `index`: (index*31 + k) & 0xff."""
    start = (index * 31 + offset) & 0xFF
    cycle = bytes(range(256))
    cycle = cycle[start:] + cycle[:start]
    return (cycle * (length // 256 + 1))[:length]


def preload_env(extra=None):
    """os.environ with the shim preloaded behind whatever is preloaded already (the ASan runtime
    must stay first)."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (os.environ.get("LD_PRELOAD", ""), str(BUILD / "libvmmshim.so")) if p)
    env.update(extra or {})
    return env


class LineProcess:
    """A child that answers one line per command on stdout; "quit" ends it."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        self._pending = b""

    def readline(self, timeout=30):
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return ""
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return ""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def command(self, cmd):
        self.proc.stdin.write(cmd.encode() + b"\n")
        return self.readline()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def end(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Owner(LineProcess):
    """tests/progs/owner under the shim: one buffer per size (MiB; suffix 'a' = cudaMallocAsync)."""

    def __init__(self, *sizes, timeout=60):
        super().__init__([str(BUILD / "progs" / "owner"), *sizes], preload_env())
        self.pid = self.proc.pid
        self.buffers = []  # (address, size, fnv)
        for _ in sizes:
            line = self.readline(timeout)
            parts = line.split()
            if len(parts) != 6 or parts[0] != "ready":
                self.kill()
                raise RuntimeError(f"owner {' '.join(sizes)} did not start: {line!r}")
            self.buffers.append((int(parts[2], 16), int(parts[3]), parts[5]))


class Tally:
    def __init__(self):
        self.passed = self.failed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL: {what}", flush=True)
        return ok

    def raises(self, exc_type, fn, what, reason=None):
        """fn() raises exc_type (with `reason` in its message when given); the exception, or None."""
        try:
            fn()
        except exc_type as e:
            self.check(reason is None or reason in str(e), f"{what}: message {str(e)!r} lacks {reason!r}")
            return e
        except Exception as e:  # the wrong exception is a failure, not a crash of the test
            self.check(False, f"{what}: raised {type(e).__name__}: {e}")
            return None
        self.check(False, f"{what}: no {exc_type.__name__} raised")
        return None

    def done(self):
        print(f"{self.passed} passed, {self.failed} failed", flush=True)
        sys.exit(1 if self.failed else 0)


# ---- the emulated driver's counters, this process's (the client library maps through it) ----

def _counter_names():
    text = (ROOT / "tests" / "fakecuda" / "fakecuda.h").read_text()
    block = re.search(r"#define FAKECUDA_COUNTER_FIELDS\(X\)(.*?)\n\n", text, re.S).group(1)
    block = re.sub(r"/\*.*?\*/", "", block, flags=re.S)
    return re.findall(r"X\((\w+)\)", block)


_counters_type = None


def fakecuda_counters():
    """{name: value} of tests/fakecuda/fakecuda.h's counters, as the libcuda.so.1 loaded here has them."""
    global _counters_type
    if _counters_type is None:
        _counters_type = type("Counters", (ctypes.Structure,),
                              {"_fields_": [(n, ctypes.c_ulonglong) for n in _counter_names()]})
    c = _counters_type()
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fakecuda_counters.argtypes = [ctypes.POINTER(_counters_type)]
    fake.fakecuda_counters(ctypes.byref(c))
    return {name: getattr(c, name) for name, _ in _counters_type._fields_}
