"""vmmshim run [--tag T] [--config F] [--keep] [--torch-memory-saver] [--] CMD [ARGS...]: CMD under the shim.

The shim goes into CMD's environment (LD_PRELOAD: first, after any sanitizer runtime that must
stay first; the other entries kept, no second libvmmshim.so), so every process CMD starts inherits
it: torchrun's workers, multiprocessing's spawned and forked children, subprocesses.  --tag sets
VMMSHIM_TAG, --config VMMSHIM_CONFIG (made absolute).  --torch-memory-saver puts vmmshim's stand-in
for the torch_memory_saver module first on PYTHONPATH (so SGLang, slime and verl sleep through the
shim, their code unchanged) and sets VMMSHIM_SLEEP_ADOPTED=1 unless set (so that a pause also takes
memory PyTorch maps itself under expandable_segments); it refuses to start when the real
torch_memory_saver's hook library is in LD_PRELOAD.  Without --keep this process becomes CMD
(exec): its exit status is CMD's, a death by signal included.

--keep: CMD runs as a child, and every process of the job that appears in the registry (CMD and
its descendants, found every 50 ms) is given to a keeper (`vmmctl keep PID`), so that a crash
keeps its memory (tools/vmmctl/README.md: The keeper).  A keeper lets go by itself of what exits with
status 0; one holding a process that crashed stays after this launcher exits, until
`vmmctl release PID`.  The keepers' event lines go to a log file (said at the end).  A process
of the job that ends within ~100 ms of its first allocation may end before it is kept.  Exit
status: CMD's, 128+N when a signal N ended it (as a shell says it).  SIGTERM, SIGHUP, SIGUSR1 and
SIGUSR2 are passed on to CMD; SIGINT and SIGQUIT are left to the terminal, which sends them to
CMD too."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import _paths

USAGE = "usage: vmmshim run [--tag T] [--config FILE] [--keep] [--torch-memory-saver] [--] CMD [ARGS...]"
SANITIZER = ("libasan", "libhwasan", "libtsan", "libmsan", "libubsan", "libclang_rt.")
POLL_S = 0.05


def _error(msg, code=2):
    sys.stderr.write(f"vmmshim: error: {msg}\n")
    return code


def compose_preload(shim, current):
    """LD_PRELOAD with shim first (after sanitizer runtimes, which must come first), every other
    entry kept in order, and no libvmmshim.so but this one."""
    entries = [e for e in current.replace(" ", ":").split(":") if e]
    real = os.path.realpath(shim)
    first, rest = [], []
    for e in entries:
        base = os.path.basename(e)
        if base == "libvmmshim.so" or os.path.realpath(e) == real:
            continue  # this shim, or another copy of it: one shim per process
        (first if base.startswith(SANITIZER) else rest).append(e)
    seen, out = set(), []
    for e in first + [shim] + rest:
        if e not in seen:
            seen.add(e)
            out.append(e)
    return ":".join(out)


def parse(argv):
    """(options dict, cmd list) or raises SystemExit with a usage error."""
    opts = {"tag": None, "config": None, "keep": False, "tms": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            sys.stdout.write(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1])
            raise SystemExit(0)
        if a == "--keep":
            opts["keep"] = True
        elif a == "--torch-memory-saver":
            opts["tms"] = True
        elif a in ("--tag", "--config"):
            if i + 1 >= len(argv):
                raise SystemExit(_error(f"run: {a} takes a value ({USAGE})"))
            opts[a[2:]] = argv[i + 1]
            i += 1
        elif a.startswith("--tag=") or a.startswith("--config="):
            k, v = a[2:].split("=", 1)
            opts[k] = v
        elif a.startswith("-"):
            raise SystemExit(_error(f"run: unknown option {a} ({USAGE})"))
        else:
            break
        i += 1
    cmd = argv[i:]
    if not cmd:
        raise SystemExit(_error(f"run: no command given ({USAGE})"))
    if opts["tag"] is not None and len(opts["tag"].encode()) > 31:
        raise SystemExit(_error("run: --tag: a tag is at most 31 bytes"))
    if opts["config"] is not None:
        if not os.path.isfile(opts["config"]) or not os.access(opts["config"], os.R_OK):
            raise SystemExit(_error(f"run: --config {opts['config']}: no such readable file"))
        opts["config"] = os.path.abspath(opts["config"])
    return opts, cmd


def environment(opts, base=None):
    env = dict(os.environ if base is None else base)
    shim = _paths.shim_lib()
    if not shim or not os.path.isfile(shim):
        raise SystemExit(_error(f"libvmmshim.so not found ({shim or 'not bundled, no build/'}; "
                                "reinstall the wheel, or set VMMSHIM_SHIM_LIB)", 1))
    env["LD_PRELOAD"] = compose_preload(os.path.abspath(shim), env.get("LD_PRELOAD", ""))
    if opts["tag"] is not None:
        env["VMMSHIM_TAG"] = opts["tag"]
    if opts["config"] is not None:
        env["VMMSHIM_CONFIG"] = opts["config"]
    if opts.get("tms"):
        hook = next((e for e in env.get("LD_PRELOAD", "").split(":") if os.path.basename(e).startswith("torch_memory_saver")),
                    None)
        if hook:
            raise SystemExit(_error(f"run: --torch-memory-saver: the real torch_memory_saver's hook ({hook}) is in "
                                    "LD_PRELOAD, and only one library may own the allocations: drop it"))
        here = _paths.tms_dir()
        if not here:
            raise SystemExit(_error("run: --torch-memory-saver: the stand-in is not installed with this package", 1))
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != here])
        env.setdefault("VMMSHIM_SLEEP_ADOPTED", "1")
    return env


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _descends(pid, root):
    seen = 0
    while pid and pid > 1 and seen < 64:
        if pid == root:
            return True
        pid = _ppid(pid)
        seen += 1
    return False


class _Keepers:
    """Gives every process of the job that appears in the registry to a keeper of its own."""

    def __init__(self, env, log_path):
        self.env, self.log_path = env, log_path
        self.root = os.getpid()
        self.kept = {}  # pid -> keeper Popen
        self.stop = threading.Event()
        self.ctl = _paths.vmmctl()
        self.log = open(log_path, "ab", buffering=0)
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        if not self.ctl:
            self.log.write(b"vmmshim run: vmmctl not found: nothing is kept\n")
            return False
        self.thread.start()
        return True

    def _loop(self):
        from . import Registry, Error, OWNER_ALIVE
        reg = None
        while not self.stop.is_set():
            try:
                if reg is None:
                    reg = Registry(self.env.get("VMMSHIM_REGISTRY") or None)
                self._discover(reg, OWNER_ALIVE)
            except Error:
                reg = None  # not made yet (no process allocated), or being made
            self.stop.wait(POLL_S)

    def _discover(self, reg, alive):
        new = [p.pid for p in reg.processes() if p.alive == alive and p.pid not in self.kept
               and p.pid != self.root and _descends(p.pid, self.root)]
        for pid in new:
            if reg.keeper_of(pid) is not None:
                self.kept[pid] = None  # kept already (another keeper): not ours to take
                continue
            self.log.write(f"vmmshim run: keeping pid {pid}\n".encode())
            # its own session: a ^C meant for the job does not stop the keeper holding it
            self.kept[pid] = subprocess.Popen([self.ctl, "keep", str(pid)], stdin=subprocess.DEVNULL,
                                              stdout=self.log, stderr=self.log, env=self.env_for_keeper(),
                                              start_new_session=True)

    def wait_told(self, pid, timeout):
        """Until the keeper of pid (if one of ours) has found how it ended, or nobody keeps it."""
        if self.kept.get(pid) is None:
            return
        import ctypes
        from . import Registry, Error, _lib
        deadline = time.monotonic() + timeout
        try:
            with Registry(self.env.get("VMMSHIM_REGISTRY") or None) as reg:
                info = _lib.KeeperInfo()
                while time.monotonic() < deadline:
                    st = _lib.lib().vmm_keeper_of(reg._h(), pid, ctypes.byref(info))
                    if st != _lib.OK or info.end_kind != 0:
                        return
                    time.sleep(0.01)
        except Error:
            return

    def env_for_keeper(self):
        env = dict(self.env)
        env.pop("LD_PRELOAD", None)  # the keeper is no CUDA program
        return env

    def finish(self):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        # a keeper that found nothing to keep (its process exited 0) is done already; the rest
        # hold processes that crashed or still run, and stay
        time.sleep(POLL_S)
        return {pid: k for pid, k in self.kept.items() if k is not None and k.poll() is None}


def _exit_code(rc):
    return 128 - rc if rc < 0 else rc


def main(argv):
    opts, cmd = parse(argv)
    env = environment(opts)
    if not opts["keep"]:
        try:
            os.execvpe(cmd[0], cmd, env)
        except FileNotFoundError:
            return _error(f"{cmd[0]}: command not found", 127)
        except PermissionError as e:
            return _error(f"{cmd[0]}: {e.strerror}", 126)
        except OSError as e:
            return _error(f"{cmd[0]}: {e.strerror}", 126)
    fd, log_path = tempfile.mkstemp(prefix=f"vmmshim-run-{os.getpid()}-", suffix=".keep.log")
    os.close(fd)
    keepers = _Keepers(env, log_path)
    if not keepers.start():
        _error("run --keep: vmmctl not found (reinstall the wheel, or set VMMSHIM_VMMCTL); running without a keeper",
               0)
    try:
        child = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        keepers.finish()
        return _error(f"{cmd[0]}: command not found", 127)
    except OSError as e:
        keepers.finish()
        return _error(f"{cmd[0]}: {e.strerror}", 126)

    def forward(sig, _frame):
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    # Ended, but not reaped yet: the keeper reads how its process ended from the zombie
    # (/proc/PID/stat), so it is left there until the keeper has said (2 s at most).
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        keepers.wait_told(child.pid, 2.0)
    except ChildProcessError:
        pass
    rc = child.wait()
    holding = keepers.finish()
    try:
        name = f" ({signal.Signals(-rc).name})" if rc < 0 else ""
    except ValueError:
        name = ""
    how = f"killed by signal {-rc}{name}" if rc < 0 else f"exited with code {rc}"
    if holding:
        crashed = rc != 0
        pids = " ".join(str(p) for p in sorted(holding))
        sys.stderr.write(f"vmmshim: {cmd[0]} {how}; keepers still hold pid {pids} "
                         f"({'its memory is kept' if crashed else 'still running or crashed'}): "
                         f"`vmmctl list --all`, `vmmctl dump PID -o DIR`, then `vmmctl release PID`; "
                         f"keeper log {log_path}\n")
    else:
        try:
            os.unlink(log_path)
        except OSError:
            pass
    return _exit_code(rc)
