"""A kept process from Python: a Python owner under the shim (named_owner.py) publishes a state
dict's stand-ins by name, `vmmctl keep` holds its memory, the owner is SIGKILLed, and then
Registry.tensors / open_tensors / open / open_many on its dead pid read every byte as written
(the keeper serves them); Allocation.owner and Process.state say "kept"; after `vmmctl release`
the pid reads as dead again (OwnerDead).  Ends with "N passed, N failed"."""
import ctypes
import os
import signal
import subprocess
import sys
import time

import harness
from harness import BUILD, PACKAGE, ROOT

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()
K = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
MiB = 1 << 20


def words(seed, first, count):
    return b"".join((((seed * K) + k) & MASK).to_bytes(8, "little") for k in range(first, first + count))


class PyOwner(harness.LineProcess):
    """tests/python/named_owner.py under the shim; ok(src) runs one line of Python there."""

    def __init__(self):
        super().__init__([sys.executable, str(ROOT / "tests" / "python" / "named_owner.py"), str(PACKAGE)],
                         harness.preload_env())
        line = self.readline(60)
        if not line.startswith("ready "):
            raise RuntimeError(f"the Python owner did not start: {line!r}")
        self.pid = int(line.split()[1])

    def ok(self, src):
        line = self.command(src)
        T.check(line.startswith("ok"), f"owner: {src}: {line}")
        return line[3:]


def wait_for(path, needle, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if needle in f.read():
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    return False


def main():
    log = f"/tmp/vmmshim-pykeep-{os.getpid()}.out"
    own = PyOwner()
    keeper = None
    try:
        own.ok("a = alloc(4 << 20)")
        a = int(own.ok("a"))
        own.ok("fill(a, 4 << 20, 7)")
        own.ok("b = alloc(64 << 10)")
        b = int(own.ok("b"))
        own.ok("fill(b, 64 << 10, 9)")
        own.ok("vmmshim.publish_many({'layer.weight': CAI(a, (1024, 1024), '<f4'), "
               "'layer.bias': CAI(b, (4096,), '<f4')})")
        with open(log, "w") as out:
            keeper = subprocess.Popen([str(BUILD / "vmmctl"), "keep", str(own.pid), "--settle", "0"], stdout=out,
                                      stderr=subprocess.STDOUT)
        T.check(wait_for(log, "holding 2 allocations"), "the keeper holds the owner's two allocations")
        own.proc.send_signal(signal.SIGKILL)
        T.check(wait_for(log, "killed by signal 9 (SIGKILL): keeping 2 allocations"), "kept after SIGKILL")
        own.proc.wait()

        with vmmshim.Registry() as reg:
            T.check(reg.keeper_of(own.pid) == keeper.pid, f"keeper_of: {reg.keeper_of(own.pid)}")
            listed = subprocess.run([sys.executable, "-m", "vmmshim", "list", "--json", "--pid", str(own.pid)],
                                    capture_output=True, text=True, cwd=str(PACKAGE))
            ctl = subprocess.run([str(BUILD / "vmmctl"), "list", "--json", "--pid", str(own.pid)], capture_output=True,
                                 text=True)
            T.check(listed.stdout == ctl.stdout and f'"kept_by": {keeper.pid}' in ctl.stdout,
                    f"python -m vmmshim list --json as vmmctl's: {listed.stdout} {listed.stderr} / {ctl.stdout}")
            proc = reg.process(own.pid)
            T.check(proc.state == "kept" and proc.alive == vmmshim.OWNER_KEPT, f"process state {proc.state}")
            al = reg.find(own.pid, a)
            T.check(al.owner == "kept" and al.flags & vmmshim.ALLOC_KEPT, f"allocation owner {al.owner}")
            names = reg.tensors(own.pid)
            T.check(sorted(names) == ["layer.bias", "layer.weight"], f"tensors of the dead pid: {sorted(names)}")
            views = reg.open_tensors(own.pid)
            w, bias = views["layer.weight"], views["layer.bias"]
            T.check(w.shape == (1024, 1024) and w.dtype == "float32", f"weight view {w.shape} {w.dtype}")
            # the emulated driver's device pointers are host addresses
            T.check(ctypes.string_at(w.ptr, w.nbytes) == words(7, 0, (4 << 20) // 8), "the weight's bytes")
            T.check(ctypes.string_at(bias.ptr, bias.nbytes) == words(9, 0, 4096 // 2), "the bias's bytes")
            del views, w, bias
            with reg.open(own.pid, a + 8, 16) as buf:
                T.check(buf.read() == words(7, 1, 2), "open(pid, address, size) of a kept allocation")
            bufs = reg.open_many(own.pid, [(a, None), (b, 4096)])
            T.check(bufs[0].read(0, 8) == words(7, 0, 1) and bufs[1].read() == words(9, 0, 512), "open_many")
            for x in bufs:
                x.close()
        rc = subprocess.run([str(BUILD / "vmmctl"), "release", str(own.pid)], capture_output=True, text=True)
        T.check(rc.returncode == 0 and "released pid" in rc.stdout, f"release: {rc.stdout} {rc.stderr}")
        T.check(keeper.wait(timeout=10) == 0, "the keeper stops with nothing left")
        keeper = None
        with vmmshim.Registry() as reg:
            T.raises(vmmshim.OwnerDead, lambda: reg.tensors(own.pid), "tensors after release", "has exited")
        gc = subprocess.run([str(BUILD / "vmmctl"), "gc"], capture_output=True, text=True)
        T.check(gc.returncode == 0 and "from 1 dead process" in gc.stdout, f"gc after release: {gc.stdout} {gc.stderr}")
        prefix = os.environ["VMMSHIM_REGISTRY"][1:] + "."
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and f".{own.pid}." in n]
        T.check(not left, f"nothing of the owner is left beside the registry: {left}")
    finally:
        if own.proc.poll() is None:
            own.proc.kill()
            own.proc.wait()
        if keeper is not None and keeper.poll() is None:
            keeper.kill()
            keeper.wait()
        try:
            os.unlink(log)
        except FileNotFoundError:
            pass
        # a keeper killed by a failure here leaves its keep file, and the owner its name table
        prefix = os.environ["VMMSHIM_REGISTRY"][1:] + "."
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink("/dev/shm/" + n)
        harness.cleanup()


if __name__ == "__main__":
    main()
    T.done()
