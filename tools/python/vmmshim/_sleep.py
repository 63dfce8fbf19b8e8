"""Sleep and wake in a process running under libvmmshim.so: vmmshim.pause(tag), resume(tag), and
the thread tags that say what a tag holds: region(tag), set_thread_tag(tag) and thread_tag().  They call the shim's own vmm_set_thread_tag and vmm_thread_tag (found among the
preloaded library's symbols by ctypes.CDLL(None)), on the calling thread: a Python thread is an OS
thread, so a region tags what this thread allocates, not what other threads do meanwhile.

What a thread allocates while tagged comes from pools of that tag's own, so the tag's memory never
shares a segment with anything else.  A caching allocator hands out blocks it cached earlier
whatever region is active; to get exactly the tensors meant under a tag with PyTorch, allocate them
inside the region from a memory pool of their own, which makes fresh segments there:

    pool = torch.cuda.MemPool()
    with vmmshim.region("optim"), torch.cuda.use_mem_pool(pool):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)      # gradients live here, accumulated in place
        optimizer.step()                      # the first step makes the optimizer's state here

(then `optimizer.zero_grad(set_to_none=False)`, so backward, which runs on autograd's threads,
writes into those gradients instead of allocating new ones)."""
import contextlib
import ctypes
import threading

from . import _lib, _sleep_torch
from ._errors import InvalidArgument, NotUnderShim

_lock = threading.Lock()
_fns = None


def _functions():
    global _fns
    with _lock:
        if _fns is None:
            try:
                here = ctypes.CDLL(None)
                fns = (here.vmm_set_thread_tag, here.vmm_thread_tag, here.vmm_publish_error)
            except (OSError, AttributeError):
                raise NotUnderShim("vmmshim: not running under the shim: start the program with `vmmshim run --` "
                                   "or LD_PRELOAD=/path/to/libvmmshim.so", _lib.NO_SHIM) from None
            for f in fns:
                f.restype = ctypes.c_char_p
            fns[0].argtypes = [ctypes.c_char_p]
            fns[1].argtypes = fns[2].argtypes = []
            _fns = fns
        return _fns


def thread_tag():
    """The calling thread's tag, or None."""
    t = _functions()[1]()
    return t.decode() if t is not None else None


def set_thread_tag(tag):
    """Tag what the calling thread allocates from now on (None clears it); returns the previous tag.
    InvalidArgument when the shim refused it (32 bytes or more, or a 33rd distinct tag): the thread
    keeps its tag."""
    set_, get, error = _functions()
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"a tag is a str or None, not {type(tag).__name__}")
    raw = tag.encode() if tag else None
    was = set_(raw)
    now = get()
    if now != raw:
        raise InvalidArgument((error() or b"").decode("utf-8", "replace").replace("vmm_set_thread_tag", "vmmshim.set_thread_tag"),
                              _lib.INVALID)
    return was.decode() if was is not None else None


@contextlib.contextmanager
def region(tag):
    """`with vmmshim.region("kv_cache"):` tags what this thread allocates inside, then restores the
    thread's previous tag (regions nest)."""
    was = set_thread_tag(tag)
    try:
        yield
    finally:
        set_thread_tag(was)


_sleep_fns = None

PAUSE_DISCARD, PAUSE_FILE = 1, 2


def _sleep_functions():
    global _sleep_fns
    with _lock:
        if _sleep_fns is None:
            try:
                here = ctypes.CDLL(None)
                fns = (here.vmm_pause_ex, here.vmm_resume_ex, here.vmm_sleep_error, getattr(here, "vmm_pause_prepare", None),
                       getattr(here, "vmm_sleep_host", None), getattr(here, "vmm_sleep_drop_host", None))
            except (OSError, AttributeError):
                raise NotUnderShim("vmmshim: not running under the shim: start the program with `vmmshim run --` "
                                   "or LD_PRELOAD=/path/to/libvmmshim.so", _lib.NO_SHIM) from None
            report = ctypes.POINTER(_lib.SleepReport)
            fns[0].restype, fns[0].argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint, report, ctypes.c_size_t]
            fns[1].restype, fns[1].argtypes = ctypes.c_int, [ctypes.c_char_p, report, ctypes.c_size_t]
            fns[2].restype, fns[2].argtypes = ctypes.c_char_p, []
            if fns[3] is not None:
                fns[3].restype, fns[3].argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]
            if fns[4] is not None:
                fns[4].restype = ctypes.c_int
                fns[4].argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64)]
            if fns[5] is not None:
                fns[5].restype, fns[5].argtypes = ctypes.c_uint64, [ctypes.c_char_p]
            _sleep_fns = fns
        return _sleep_fns


def _sleep_check(status, error, who):
    if status != _lib.OK:
        from ._errors import BY_STATUS, Error
        reason = (error() or b"").decode("utf-8", "replace")
        head, sep, rest = reason.partition(": ")
        if sep and head.startswith("vmm_"):
            reason = f"{who}: {rest}"
        raise BY_STATUS.get(status, Error)(reason, status)


def pause(tag=None, keep=True, to_file=False):
    """Give this process's GPU memory under `tag` (None: all of it) back to the device, keeping the
    address reservations.  It waits for the device first.  keep: the contents are copied to pinned
    host memory (to_file: to an unlinked file in VMMSHIM_PAUSE_DIR) and come back at resume; keep=False
    discards them (a KV cache).  Returns a SleepReport; raises (vmmshim.Error subclasses) with the
    shim's one-line reason, e.g. when it is paused already.

    The process keeps working meanwhile: work that touches no paused tensor runs, on any thread.
    Under PyTorch, new tensors never land in paused memory and cuBLAS's workspaces are made anew
    (_sleep_torch.py says how)."""
    p, error = _sleep_functions()[0], _sleep_functions()[2]
    flags = (0 if keep else PAUSE_DISCARD) | (PAUSE_FILE if keep and to_file else 0)
    r = _lib.SleepReport()
    status = p(tag.encode() if tag else None, flags, ctypes.byref(r), ctypes.sizeof(r))
    if status == _lib.OK or r.bytes_released:  # a failed pause keeps what it paused before the failure
        _sleep_torch.after_pause(tag or None)
    _sleep_check(status, error, "vmmshim.pause")
    from . import SleepReport
    return SleepReport(r)


def resume(tag=None):
    """Fresh device memory at exactly the old addresses, with the same access, and the kept contents
    copied back; raises with the shim's reason (the device full: nothing is lost, resume again later)."""
    r_, error = _sleep_functions()[1], _sleep_functions()[2]
    r = _lib.SleepReport()
    _sleep_check(r_(tag.encode() if tag else None, ctypes.byref(r), ctypes.sizeof(r)), error, "vmmshim.resume")
    _sleep_torch.after_resume(tag or None)
    from . import SleepReport
    return SleepReport(r)


def prepare_pause(tag=None, background=True):
    """Pin now, on several threads, the host memory a first kept pause of `tag` (None: everything)
    would pin itself, so that it copies at once: a process's first pause otherwise pins every
    buffer (~0.1 s a GiB), later ones reuse them.  Call it once the memory to pause is made (after
    the first training step).  background: on a thread of its own, returned (join() to wait);
    else returns the bytes made ready.  The program allocates and frees meanwhile as usual; the
    pinned bytes count in VMMSHIM_PAUSE_HOST_CACHE and go with their allocations."""
    fn, error = _sleep_functions()[3], _sleep_functions()[2]
    if fn is None:
        raise NotUnderShim("vmmshim.prepare_pause: the preloaded shim predates it", _lib.NO_SHIM)
    raw = tag.encode() if tag else None

    def run():
        ready = ctypes.c_uint64()
        _sleep_check(fn(raw, ctypes.byref(ready)), error, "vmmshim.prepare_pause")
        return ready.value

    if not background:
        return run()
    t = threading.Thread(target=run, name="vmmshim-prepare-pause", daemon=True)
    t.start()
    return t


def host_copy(address):
    """Where host memory holds the copy of this process's device byte at `address`: (host address,
    bytes that follow it contiguously there), or None.  A kept pause's contents while paused; once
    resumed, the pinned buffer the allocation keeps for its next pause, which holds what that pause
    copied, until drop_host_copies().  Under the shim only."""
    fn = _sleep_functions()[4]
    if fn is None:
        raise NotUnderShim("vmmshim.host_copy: the preloaded shim predates it", _lib.NO_SHIM)
    host, n = ctypes.c_void_p(), ctypes.c_uint64()
    if fn(address, ctypes.byref(host), ctypes.byref(n)) != _lib.OK:
        return None
    return host.value, n.value


def drop_host_copies(tag=None):
    """Free the pinned buffers the awake allocations under `tag` (None: all) keep between kept pauses
    (VMMSHIM_PAUSE_HOST_CACHE): host memory then holds nothing between cycles, and the next pause pins
    anew.  Returns the bytes freed."""
    fn = _sleep_functions()[5]
    if fn is None:
        raise NotUnderShim("vmmshim.drop_host_copies: the preloaded shim predates it", _lib.NO_SHIM)
    return int(fn(tag.encode() if tag is not None else None))


def give_back():
    """What cudaMalloc freed and the shim still holds for quick reuse (VMMSHIM_GIVE_BACK_HOLD) goes
    back to the device now; returns the bytes.  0 outside the shim."""
    fn = getattr(ctypes.CDLL(None), "vmm_give_back", None)
    if fn is None:
        return 0
    fn.restype, fn.argtypes = ctypes.c_uint64, []
    return int(fn())
