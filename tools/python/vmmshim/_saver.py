"""torch_memory_saver's API over vmmshim: what the stand-in package (vmmshim/_tms/torch_memory_saver,
put on the path by `vmmshim run --torch-memory-saver`) is made of.  Imports torch only when a call
needs it.

How TMS's terms map onto the shim's:
- TMS keeps, per thread, a region config (tag, whether allocations are "interesting", CPU or disk
  backup); the shim keeps a thread tag.  Each (TMS tag, backup mode) pair is one shim tag: the TMS
  tag itself when discarded (TMS's default), `<tag>+cpu` with a CPU backup, `<tag>+disk` with a
  disk one (a tag too long for the shim's 31 bytes is shortened with a hash).  So a pause of a TMS
  tag is one shim pause per mode, kept, discarded or to a file.
- TMS_INIT_ENABLE=1 makes every thread interesting from its start, under "default": that is the
  shim's untagged memory (the process tag), paused kept when TMS_INIT_ENABLE_CPU_BACKUP=1.  A
  thread inside disable() then allocates under `tms-off`, which no stand-in pause takes.
- Only the stand-in's tags are paused: memory allocated outside every region stays, as with TMS.
- Pausing what is paused, or resuming what is awake, does nothing (TMS exits the process).
- A resume lets the host copies go unless retain_cpu_backup; with it they stay, the same buffers
  each cycle (the shim's VMMSHIM_PAUSE_HOST_CACHE).
- Once every tag the stand-in knows is paused, PyTorch's cached free blocks go back to the device
  (empty_cache) if any lie outside paused memory, and what the shim holds for quick reuse
  (vmm_give_back): what stays is the CUDA context, NCCL's memory, cuBLAS's workspaces and the
  program's live tensors outside any region.  A cache wholly in paused memory stays, to come back
  at the resume as with TMS."""
import contextlib
import ctypes
import hashlib
import os
import threading

from . import _lib, _sleep, _sleep_torch
from ._errors import BY_STATUS, Error

TAG_DEFAULT = "default"
OFF_TAG = "tms-off"
MODES = ("discard", "cpu", "disk")
_SUFFIX = {"discard": "", "cpu": "+cpu", "disk": "+disk"}
_FLAGS = {"discard": _sleep.PAUSE_DISCARD, "cpu": 0, "disk": _sleep.PAUSE_FILE}
BACKENDS = ("pinned", "mmap")

_lock = threading.RLock()
_known = {}       # shim tag -> (TMS tag, mode): every tag a region has named in this process
_paused = set()   # shim tags paused by the stand-in now
_tls = threading.local()
settings = {"retain": os.environ.get("TMS_RETAIN_CPU_BACKUP", "") == "1", "margin": 0, "disk_dir": None}


def _env_on(name):
    return os.environ.get(name, "") == "1"


def init_enabled():
    return _env_on("TMS_INIT_ENABLE")


def _init_mode():
    return "cpu" if _env_on("TMS_INIT_ENABLE_CPU_BACKUP") else "discard"


def _process_tag():
    return os.environ.get("VMMSHIM_TAG", "")


def shim_tag(tag, mode):
    """The shim tag of TMS's (tag, mode): at most 31 bytes, the same for the same pair."""
    name = tag + _SUFFIX[mode]
    if len(name.encode()) <= 31:
        return name
    digest = hashlib.sha1(tag.encode()).hexdigest()[:8]
    head = tag.encode()[:31 - len(_SUFFIX[mode]) - 9].decode("utf-8", "ignore")
    return f"{head}#{digest}{_SUFFIX[mode]}"


class Config:
    """One thread's region config, as TMS keeps it (thread-local, read from TMS_INIT_* when the
    thread first looks)."""

    def __init__(self):
        self.tag = TAG_DEFAULT
        self.interesting = init_enabled()
        self.cpu_backup = _env_on("TMS_INIT_ENABLE_CPU_BACKUP") if self.interesting else False
        backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "pinned") or "pinned"
        self.backend = backend if backend in BACKENDS else "pinned"
        self.disk = False

    def mode(self):
        return "disk" if self.disk else "cpu" if self.cpu_backup else "discard"

    def shim_tag(self):
        """The shim tag this config allocates under (None: untagged)."""
        if not self.interesting:
            return OFF_TAG if init_enabled() else None
        if init_enabled() and self.tag == TAG_DEFAULT and self.mode() == _init_mode():
            return None
        return shim_tag(self.tag, self.mode())


def config():
    c = getattr(_tls, "config", None)
    if c is None:
        c = _tls.config = Config()
    return c


def set_config(tag=None, interesting=None, cpu_backup=None, backend=None, disk=None):
    """Change the calling thread's config and tag its allocations accordingly; raises (the config
    unchanged) when the shim refuses the tag (a 33rd distinct one)."""
    c = config()
    new = Config.__new__(Config)
    new.__dict__.update(c.__dict__)
    for k, v in (("tag", tag), ("interesting", interesting), ("cpu_backup", cpu_backup), ("backend", backend),
                 ("disk", disk)):
        if v is not None:
            setattr(new, k, v)
    name = new.shim_tag()
    _sleep.set_thread_tag(name)
    if name is not None and name != OFF_TAG:
        with _lock:
            _known.setdefault(name, (new.tag, new.mode()))
    _tls.config = new


def _targets(tag):
    """(shim tag, mode) pairs a TMS pause or resume of tag (None: all) acts on."""
    with _lock:
        out = [(name, mode) for name, (t, mode) in _known.items() if tag is None or t == tag]
    if init_enabled() and (tag is None or tag == TAG_DEFAULT):
        out.append((_process_tag(), _init_mode()))
    return out


def _raise(status, who):
    reason = (_sleep._sleep_functions()[2]() or b"").decode("utf-8", "replace")
    head, sep, rest = reason.partition(": ")
    raise BY_STATUS.get(status, Error)(f"{who}: {rest if sep else reason}", status)


def pause(tag=None):
    """TMS's pause: every stand-in tag under `tag` (None: all), each as its mode says; what is paused
    already (also by a vmmshim.pause of the program's own), or holds no memory, is passed over."""
    fn = _sleep._sleep_functions()[0]
    report = _lib.SleepReport()
    with _lock:
        for name, mode in _targets(tag):
            status = fn(name.encode(), _FLAGS[mode], ctypes.byref(report), ctypes.sizeof(report))
            if status == _lib.OK or report.bytes_released:
                _paused.add(name)
                _sleep_torch.after_pause(name)
            elif status == _lib.STATE:
                _paused.add(name)
            if status not in (_lib.OK, _lib.NOT_FOUND, _lib.STATE):
                _raise(status, "torch_memory_saver.pause")
        if _all_paused():
            _release_left_behind()


def resume(tag=None):
    """TMS's resume: every stand-in tag under `tag` that is paused, contents copied back where kept;
    the host copies go unless retain_cpu_backup.  What is awake is passed over."""
    fn = _sleep._sleep_functions()[1]
    report = _lib.SleepReport()
    with _lock:
        for name, mode in _targets(tag):
            status = fn(name.encode(), ctypes.byref(report), ctypes.sizeof(report))
            if status not in (_lib.OK, _lib.STATE, _lib.NOT_FOUND):
                _raise(status, "torch_memory_saver.resume")
            _paused.discard(name)
            if status == _lib.OK:
                _sleep_torch.after_resume(name)
                if mode == "cpu" and not settings["retain"]:
                    _sleep.drop_host_copies(name)


def set_margin(nbytes):
    """torch_memory_saver's memory_margin_bytes: the shim refuses new device memory that would leave
    less than nbytes free (vmm_set_alloc_margin); 0 turns it off."""
    if nbytes < 0:
        raise ValueError(f"memory_margin_bytes must be >= 0, not {nbytes}")
    fn = getattr(ctypes.CDLL(None), "vmm_set_alloc_margin", None)
    if fn is None:
        raise Error("torch_memory_saver.memory_margin_bytes: the preloaded shim predates vmm_set_alloc_margin",
                    _lib.NO_SHIM)
    fn.argtypes, fn.restype = [ctypes.c_uint64], None
    fn(nbytes)
    settings["margin"] = nbytes


_c_entries = None


def hand_in_c_entries():
    """TMS's C entry points, which the shim exports (tms_pause, tms_resume), call this module's pause
    and resume from now on, so a C caller pauses what a Python one would."""
    global _c_entries
    fn = getattr(ctypes.CDLL(None), "vmm_tms_entries", None)
    if fn is None or _c_entries is not None:
        return
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)

    def entry(call, who):
        def run(tag):
            try:
                call(tag.decode() if tag else None)
                return 0
            except Exception as e:  # a C caller gets -1, and the reason on stderr
                os.write(2, f"vmmshim: error: {who}: {e}\n".encode())
                return -1
        return proto(run)

    _c_entries = (entry(pause, "tms_pause"), entry(resume, "tms_resume"))
    fn.argtypes, fn.restype = [proto, proto], None
    fn(*_c_entries)


def _all_paused():
    names = {n for n, _ in _targets(None)}
    return bool(names) and names <= _paused


def _release_left_behind():
    """Every stand-in tag sleeps: PyTorch's cached free blocks go back to the device where some lie
    outside paused memory (those inside go too then, freed while paused, and do not come back at the
    resume), and so does what the shim holds for quick reuse, so the framework needs no
    empty_cache() and NVML shows it at once."""
    torch = _sleep_torch._torch()
    if torch is not None and _sleep_torch.cache_outside_paused(torch):
        torch.cuda.empty_cache()
    _sleep.give_back()


def host_copy(address, nbytes):
    """The host address of the backup of [address, address + nbytes) when one buffer holds it all,
    else None."""
    got = _sleep.host_copy(address)
    if got is None or got[1] < nbytes:
        return None
    return got[0]


def read_host_copy(address, nbytes):
    """The backup of [address, address + nbytes) as bytes, gathered across allocations (expandable
    segments map a tensor over several), or None when some byte has none."""
    out, at = bytearray(nbytes), 0
    while at < nbytes:
        got = _sleep.host_copy(address + at)
        if got is None:
            return None
        n = min(got[1], nbytes - at)
        ctypes.memmove((ctypes.c_char * n).from_buffer(out, at), got[0], n)
        at += n
    return bytes(out)


def foreign_hook():
    """The real torch_memory_saver's hook library when this process has it, loaded or about to be
    (LD_PRELOAD), else None."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":"):
        if os.path.basename(entry).startswith("torch_memory_saver"):
            return entry
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if os.path.basename(path).startswith("torch_memory_saver_hook"):
                    return path
    except OSError:
        pass
    return None


@contextlib.contextmanager
def subprocess_env():
    """configure_subprocess(): children started inside run under the shim, find this stand-in
    first, and may pause the program's own VMM memory (expandable segments)."""
    from . import _paths, _run
    shim = _paths.shim_lib()
    if not shim or not os.path.isfile(shim):
        raise Error("vmmshim: error: configure_subprocess: libvmmshim.so not found (reinstall the wheel, "
                    "or set VMMSHIM_SHIM_LIB)", _lib.NO_SHIM)
    here = _paths.tms_dir()
    changes = {"LD_PRELOAD": _run.compose_preload(os.path.abspath(shim), os.environ.get("LD_PRELOAD", "")),
               "PYTHONPATH": os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p and p != here])}
    if "VMMSHIM_SLEEP_ADOPTED" not in os.environ:
        changes["VMMSHIM_SLEEP_ADOPTED"] = "1"
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
