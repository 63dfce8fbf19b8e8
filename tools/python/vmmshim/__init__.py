"""vmmshim companion API for Python: read the registry that processes running under libvmmshim.so
publish their CUDA allocations in, and import an allocation into this process (ctypes over
libvmmshim-client.so; standard library only).

    import vmmshim
    reg = vmmshim.Registry()
    for a in reg.allocations():
        print(a.pid, hex(a.address), a.size, a.api)
    with reg.open(pid, address) as buf:       # any interior address of the allocation
        data = buf.read(0, 4096)               # bytes, copied to the host
        t = torch.from_dlpack(buf)             # zero-copy 1-D uint8 tensor (also CuPy, JAX)
    buf = reg.open(pid, address, 6 << 20)      # exactly these bytes, across allocations or mappings
    w = torch.from_dlpack(buf.view((3072, 1024), "bfloat16"))   # typed, zero-copy

A view, and a tensor taken with DLPack, keep the import alive after the buffer is closed, until
they are freed.

Named tensors: a trainer running under the shim names its tensors with one line, and a companion
opens them by name (all at once, sharing each chunk's import):

    vmmshim.publish_many(model.state_dict())                  # owner (also publish, unpublish)
    views = vmmshim.Registry().open_tensors(pid)               # companion: {name: View}
    model.load_state_dict({k: torch.from_dlpack(v) for k, v in views.items()})
"""
import ctypes
import operator
import threading
import time

from . import _dlpack, _dtypes, _lib
from ._errors import (BY_STATUS, Access, Busy, Corrupt, CudaError, Error, InvalidArgument, IOFailure, LibraryNotFound,
                      NotFound, NotUnderShim, OutOfMemory, OwnerDead, Paused, Stale, VersionMismatch, WrongState)
from ._owner import publish, publish_many, unpublish, updating
from ._sleep import pause, prepare_pause, region, resume, set_thread_tag, thread_tag
from ._torch import to_torch
from ._lib import (ALLOC_KEPT, ALLOC_MULTI_HANDLE, ALLOC_NOT_EXPORTABLE, ALLOC_PAUSED, ALLOC_SHARED_CHUNK, KIND_BROKER,
                   KIND_FABRIC, KIND_PIDFD, OWNER_ALIVE, OWNER_DEAD, OWNER_KEPT, OWNER_UNKNOWN)

__version__ = "0.1.0"

__all__ = ["Registry", "Allocation", "Process", "Tensor", "Buffer", "View", "publish", "publish_many", "unpublish",
           "updating", "Group", "Sidecar", "Receiver", "region", "set_thread_tag", "thread_tag", "pause", "resume", "prepare_pause", "SleepReport",
           "drop_idle", "to_torch",
           "Error", "LibraryNotFound", "InvalidArgument", "NotFound",
           "Access", "Corrupt", "VersionMismatch", "Busy", "Stale", "OwnerDead", "CudaError", "OutOfMemory",
           "IOFailure", "NotUnderShim", "Paused", "WrongState", "OWNER_DEAD", "OWNER_ALIVE", "OWNER_UNKNOWN",
           "OWNER_KEPT", "KIND_BROKER", "KIND_PIDFD", "KIND_FABRIC", "ALLOC_NOT_EXPORTABLE", "ALLOC_SHARED_CHUNK",
           "ALLOC_MULTI_HANDLE", "ALLOC_KEPT", "ALLOC_PAUSED"]

# kept: the owner has exited, and a keeper (vmmctl keep) holds its memory and serves it as the owner did
_OWNER_NAMES = {OWNER_DEAD: "dead", OWNER_ALIVE: "alive", OWNER_KEPT: "kept"}


def _check(status):
    if status != _lib.OK:
        L = _lib.lib()
        # vmm_last_error is per thread, and ctypes calls run on the calling thread
        reason = (L.vmm_last_error() or L.vmm_strerror(status) or b"").decode("utf-8", "replace")
        raise BY_STATUS.get(status, Error)(reason, status)


def _text(raw):
    return raw.decode("utf-8", "replace")


def drop_idle():
    """Unmap every imported chunk that no Buffer, view or tensor holds now (vmm_import_drop_idle).
    A chunk otherwise stays mapped while its owner holds it, so that opening it again costs a
    registry read; after this the next open imports it afresh (what a benchmark of first
    imports wants)."""
    _check(_lib.lib().vmm_import_drop_idle())


class Allocation:
    """One allocation record (vmm_alloc_info), as read.  size is the owner's requested size."""

    def __init__(self, info):
        self._info = info
        self.id = bytes(info.alloc_id).hex()
        self.generation = info.generation
        self.slot = info.slot
        self.pid = info.pid
        self.owner_alive = info.owner_alive
        self.owner = _OWNER_NAMES.get(info.owner_alive, "unknown")
        self.owner_start_time = info.owner_start_time
        self.owner_pidns = info.owner_pidns
        self.device = info.device
        self.device_uuid = bytes(info.device_uuid).hex()
        self.address = info.address
        self.size = info.requested_size
        self.mapped_size = info.mapped_size
        self.stream = info.stream
        self.created_ns = info.created_ns
        self.api = _lib.API_NAMES.get(info.api, "unknown")
        self.handle_kinds = info.handle_kinds
        self.exported_fd = info.exported_fd
        self.frames = tuple(info.frames[:min(info.n_frames, 8)])
        self.tag = _text(info.tag)
        self.chunk_id = info.chunk_id
        self.chunk_offset = info.chunk_offset
        self.extent = info.extent
        self.flags = info.flags
        self.shared_chunk = bool(info.flags & ALLOC_SHARED_CHUNK)
        self.n_handles = info.n_handles  # > 1: its chunk is that many handles back to back
        self.multi_handle = bool(info.flags & ALLOC_MULTI_HANDLE)
        self.paused = bool(info.flags & ALLOC_PAUSED)  # its owner paused it (vmm_pause): import it once resumed
        self.exportable = bool(info.handle_kinds & (KIND_BROKER | KIND_PIDFD)) and not info.flags & ALLOC_NOT_EXPORTABLE

    def __repr__(self):
        return (f"<vmmshim.Allocation pid {self.pid} 0x{self.address:x} {self.size} bytes {self.api}"
                f"{' ' + repr(self.tag) if self.tag else ''} owner {self.owner}>")


class Process:
    """One process record (vmm_proc_info).  alive is an OWNER_* value, state its name."""

    def __init__(self, info):
        self.pid = info.pid
        self.alive = info.alive
        self.state = _OWNER_NAMES.get(info.alive, "unknown")
        self.start_time = info.start_time
        self.pidns = info.pidns
        self.uid = info.uid
        self.registered_ns = info.registered_ns
        self.broker_path = _text(info.broker_path)
        self.cmdline = _text(info.cmdline)
        self.n_allocs = info.n_allocs
        self.bytes_requested = info.bytes_requested
        self.bytes_mapped = info.bytes_mapped
        self.bytes_paused = info.bytes_paused  # of bytes_mapped, paused now (vmm_pause)
        # what became of its allocations since it started (vmmctl ps); None: its shim keeps none
        known = bool(info.stats_known)
        for name in ("allocs", "allocs_backed", "unpublished", "passed_capture", "passed_device_full",
                     "passed_unsupported", "maps_adopted", "peak_requested"):
            setattr(self, name, getattr(info, name) if known else None)

    def __repr__(self):
        return f"<vmmshim.Process pid {self.pid} {self.state} {self.n_allocs} allocations {self.cmdline!r}>"


class SleepReport:
    """What a pause or resume of another process did (Registry.pause, Registry.resume; the
    owner's vmm_sleep_report): bytes_released (pause: given back to the device; resume: mapped
    again), bytes_kept (copied out, or back), bytes_not_shim (its device memory the shim does not
    own, left there), segments, allocations, seconds (the owner's time), and for a pause
    bytes_held and holders: of bytes_released, what companions still held with live imports once
    the owner's wait (VMMSHIM_PAUSE_HOLD_WAIT_MS) was over, and their pids (at most 8 named;
    n_holders counts them all).  holders_known is False when nobody could say (a Registry.pause of
    an owner whose shim predates reporting them): bytes_held and n_holders are then 0 for want of
    an answer, not because nobody holds."""

    def __init__(self, r):
        self.bytes_released = r.bytes_released
        self.bytes_kept = r.bytes_kept
        self.bytes_not_shim = r.bytes_not_shim
        self.segments = r.segments
        self.allocations = r.allocations
        self.seconds = r.ns / 1e9
        self.bytes_held = r.bytes_held
        self.n_holders = r.n_holders
        self.holders = [r.holders[i] for i in range(min(r.n_holders, 8))]
        self.holders_known = not (r.flags & _lib.SLEEP_HOLDERS_UNKNOWN)

    def __repr__(self):
        return (f"<vmmshim.SleepReport released {self.bytes_released} kept {self.bytes_kept} bytes, "
                f"{self.allocations} allocations, {self.seconds * 1e3:.1f} ms"
                + (f", {self.bytes_held} bytes still held by pid {', '.join(map(str, self.holders))}"
                   if self.n_holders else "")
                + ("" if self.holders_known else ", holders unknown") + ">")


class Tensor:
    """A tensor another process publishes by name (Registry.tensors): name, pid, address (the
    owner's pointer to its first element), nbytes (the bytes it spans from there), dtype (its
    name, as Buffer.view takes it; "dlpack(code,bits,lanes)" for a type a view cannot take),
    dlpack_dtype (code, bits, lanes), shape and strides (in elements), alloc_id (hex, of the
    allocation holding address), published_ns."""

    def __init__(self, f):
        """f: a vmm_tensor_info's fields (_lib.TENSOR_UNPACK)."""
        name = f[0].split(b"\0", 1)[0]
        self.name = _text(name)
        self._name_raw = name  # as the table holds it (python -m vmmshim list --names)
        self.pid, self.address, self.nbytes, self.published_ns = f[1], f[6], f[7], f[-1]
        self.dlpack_dtype = f[2:5]
        dt = _dtypes.from_dlpack(*self.dlpack_dtype)
        self.dtype = dt.name if dt else "dlpack(%d,%d,%d)" % self.dlpack_dtype
        n = min(f[5], _lib.MAX_DIMS)
        m = _lib.MAX_DIMS
        self.shape = f[8:8 + n]
        self.strides = f[8 + m:8 + m + n]
        self.alloc_id = f[8 + 2 * m].hex()

    def __repr__(self):
        return (f"<vmmshim.Tensor {self.name!r} of pid {self.pid}: {self.dtype}{list(self.shape)} at "
                f"0x{self.address:x}, {self.nbytes} bytes>")


class Registry:
    """The registry named name ("/name"); None: $VMMSHIM_REGISTRY, else the per-user default."""

    def __init__(self, name=None):
        L = _lib.lib()
        handle = ctypes.c_void_p()
        _check(L.vmm_open(name.encode() if name is not None else None, ctypes.byref(handle)))
        self._handle = handle
        self._ranges = []  # live range imports (_Range), which later opens inside them share
        self._ranges_lock = threading.Lock()

    def _h(self):
        if self._handle is None:
            raise ValueError("vmmshim: the registry is closed")
        return self._handle

    def close(self):
        if self._handle is not None:
            _lib.lib().vmm_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()

    def allocations(self, pid=None):
        """Every allocation record, dead owners' included (see owner_alive); only pid's if given."""
        found = []

        def visit(_ctx, info):
            if pid is None or info.contents.pid == pid:
                found.append(Allocation(_lib.AllocInfo.from_buffer_copy(info.contents)))
            return 0

        _check(_lib.lib().vmm_foreach_alloc(self._h(), _lib.ALLOC_FN(visit), None))
        return found

    def processes(self):
        """Every registered process, dead ones included (see alive)."""
        found = []

        def visit(_ctx, info):
            found.append(Process(info.contents))
            return 0

        _check(_lib.lib().vmm_foreach_proc(self._h(), _lib.PROC_FN(visit), None))
        return found

    def find(self, pid, address):
        """The live allocation of process pid that contains address (any interior address)."""
        info = _lib.AllocInfo()
        _check(_lib.lib().vmm_find(self._h(), pid, address, ctypes.byref(info)))
        return Allocation(info)

    def process(self, pid):
        info = _lib.ProcInfo()
        _check(_lib.lib().vmm_find_proc(self._h(), pid, ctypes.byref(info)))
        return Process(info)

    def pause(self, pid, tag=None, keep=True, to_file=False):
        """Have process pid give its memory (tag: only that tag's) back to the device, as its own
        vmm_pause would, through its broker: contents kept in its host memory (to_file: an unlinked
        file in its VMMSHIM_PAUSE_DIR; keep=False: discarded).  The owner must run with
        VMMSHIM_REMOTE_PAUSE=1, else Access.  Returns a SleepReport once the memory is released;
        WrongState when some of it is paused already, NotFound for a tag it has no memory of,
        OwnerDead, NotFound for a pid not in this registry."""
        if not keep and to_file:
            raise InvalidArgument("vmmshim: pause: keep=False discards; to_file keeps in a file", _lib.INVALID)
        flags = (0 if keep else _lib.PAUSE_DISCARD) | (_lib.PAUSE_FILE if to_file else 0)
        r = _lib.SleepReport()
        _check(_lib.lib().vmm_pause_process(self._h(), pid, tag.encode() if tag else None, flags, ctypes.byref(r),
                                            ctypes.sizeof(r)))
        return SleepReport(r)

    def resume(self, pid, tag=None):
        """Map process pid's paused memory (tag: that tag's) again at the same addresses, the kept
        contents copied back (Registry.pause's rules).  Returns a SleepReport; WrongState when
        nothing is paused."""
        r = _lib.SleepReport()
        _check(_lib.lib().vmm_resume_process(self._h(), pid, tag.encode() if tag else None, ctypes.byref(r),
                                             ctypes.sizeof(r)))
        return SleepReport(r)

    def keeper_of(self, pid):
        """The pid of the keeper (vmmctl keep) that keeps process pid, or None when nobody does.
        A kept process that has died reads as OWNER_KEPT, and its memory opens as a living one's."""
        info = _lib.KeeperInfo()
        status = _lib.lib().vmm_keeper_of(self._h(), pid, ctypes.byref(info))
        if status == _lib.NOT_FOUND:
            return None
        _check(status)
        return info.keeper_pid

    def tensors(self, pid):
        """{name: Tensor} of the tensors process pid publishes by name now (vmmshim.publish, or
        vmm_publish in C), each checked against the live allocation it lies in.  {} for a living
        owner that publishes none; NotFound when pid has no record in this registry (it does not
        run under the shim); OwnerDead once it has exited."""
        found = {}
        for fields in self._tensor_table(pid):
            t = Tensor(fields)
            found[t.name] = t
        return found

    def _tensor_table(self, pid):
        """vmm_list_tensors' array, each entry its _lib.TENSOR_UNPACK fields."""
        return _lib.TENSOR_UNPACK.iter_unpack(self._tensor_raw(pid)[0])

    def _tensor_raw(self, pid):
        """(vmm_list_tensors' array as a memoryview of its bytes, the number of entries)."""
        listed, n, room = _lib.lib().vmm_list_tensors, ctypes.c_size_t(), 256
        while True:
            buf = ctypes.create_string_buffer(room * _lib.TENSOR_UNPACK.size)
            _check(listed(self._h(), pid, buf, room, ctypes.byref(n)))
            if n.value <= room:
                break
            room = n.value + 64  # more names than room: again, with room for them and some more
        return memoryview(buf).cast("B")[:n.value * _lib.TENSOR_UNPACK.size], n.value

    def open_tensors(self, pid, names=None, timing=False):
        """{name: View} of pid's named tensors (all of them, or those named in names), imported with
        one open_many, so tensors that share a chunk share its one import here.  Each View has the
        tensor's dtype, shape and strides, and keeps its import alive until it (and every tensor
        taken from it with DLPack) is gone.  NotFound names a tensor pid does not publish;
        ValueError one whose dtype a view cannot take; Stale when an allocation was freed between
        reading the names and importing them (open again).  timing=True returns (views, timing):
        open_many's timing (see there) with names_ns (reading the name table) and views_ns (making
        the views) added, total_ns and python_ns covering the whole call."""
        t0 = time.perf_counter_ns()
        published = self.tensors(pid)
        t_names = time.perf_counter_ns() - t0
        if names is None:
            wanted = list(published.values())
        else:
            if isinstance(names, str):
                names = [names]
            wanted = []
            for name in names:
                if name not in published:
                    raise NotFound(f"pid {pid} publishes no tensor named {name!r}", _lib.NOT_FOUND)
                wanted.append(published[name])
        dtypes = {t.name: _dtypes.of_published(t.name, pid, t.dlpack_dtype) for t in wanted}
        if not wanted:
            return ({}, _timing_of(None, time.perf_counter_ns() - t0, 0)) if timing else {}
        buffers, times = self.open_many(pid, [(t.address, t.nbytes) for t in wanted], timing=True)
        t1 = time.perf_counter_ns()
        views = {}
        try:
            for t, buf in zip(wanted, buffers):
                # the allocation imported is the one the name was read from (ids are never reused)
                if buf._allocation_id() != t.alloc_id:
                    raise Stale(f"pid {pid}'s allocation holding {t.name!r} was freed since its name was read",
                                _lib.STALE)
                views[t.name] = buf.view(t.shape, dtypes[t.name], 0, t.strides)
        finally:
            for buf in buffers:
                buf.close()  # the views hold what they need
        if not timing:
            return views
        t2 = time.perf_counter_ns()
        times["names_ns"], times["views_ns"] = t_names, t2 - t1
        times["python_ns"] += t2 - t0 - times["total_ns"]
        times["total_ns"] = t2 - t0
        return views, times

    def open_torch(self, pid, tensors=None, timing=False):
        """PyTorch tensors of pid's memory, zero-copy, in one call: tensors is a dict {name: spec}
        (a dict comes back) or a list of specs (a list, in order), each spec a Tensor of
        tensors(pid) or a tuple (address, dtype, shape[, strides in elements]); None: every tensor
        pid publishes, by name.  One open_many imports them all; then, as to_torch, one DLPack
        import per stretch of nearby tensors and one as_strided a tensor, with no Buffer or View
        made on the way.  The imports under a stretch stay until its last tensor is gone.  All or
        nothing, with open_many's errors; Stale for a Tensor whose allocation was freed since its
        name was read; ValueError for a tensor of no element or unaligned for its dtype.
        timing=True returns (tensors, timing): open_many's, with names_ns (reading the names),
        before_ns (up to the import's start), build_ns (the tensors made while the grant runs) and
        end_ns (the wait for the grant, and the hand-out)."""
        from . import _torch
        return _torch.open_torch(self, pid, tensors, timing)

    def open(self, pid, address, size=None):
        """Import pid's bytes at address: without size, the whole live allocation containing
        address (any interior address); with size, exactly [address, address + size), whatever
        lies under it: part of one allocation (its chunk is imported, and shared with every other
        import of it here), or several allocations back to back, such as the pages of a PyTorch
        expandable segment (vmm_import_range: one reservation with every handle mapped at its
        place; a later open inside it, of the same records, shares it; one reaching past it maps
        its own).  A Buffer either way; its allocations are the records it covers."""
        if size is None:
            alloc = self.find(pid, address)
            return Buffer(self._import(alloc), alloc, self)
        size, address = _index(size, "size"), _index(address, "address")
        if size <= 0 or address < 0:
            raise ValueError(f"vmmshim: open(pid, address, size) wants address >= 0 and size > 0, "
                             f"not 0x{address:x}, {size}")
        alloc = self.find(pid, address)
        try:
            covered = self._walk(pid, address, size)
        except Error:
            covered = None  # vmm_import_range says why, in its words
        shared = self._shared_range(pid, address, size, covered)
        if shared is not None:
            # inside a range imported here already, whose records are still these: its mappings
            return Buffer(shared.imp, alloc, self, address=address, size=size, offset=address - shared.address,
                          ranged=covered, shared=shared)
        offset = address - alloc.address
        if offset + size <= alloc.size:
            # inside one allocation: its chunk, mapped once here however often it is opened
            return Buffer(self._import(alloc), alloc, self, address=address, size=size, offset=offset)
        imp = ctypes.c_void_p()
        _check(_lib.lib().vmm_import_range(self._h(), pid, address, size, ctypes.byref(imp)))
        try:
            # the records walked before the import must be the ones it mapped: one freed and
            # replaced meanwhile would leave check() watching the wrong allocation
            after = self._walk(pid, address, size)
            if covered is None or _names(after) != _names(covered):
                raise Stale(f"pid {pid}'s allocations in 0x{address:x}..0x{address + size:x} changed while it was "
                            f"being imported", _lib.STALE)
            shared = _Range(self, imp, pid, address, size, covered)
        except BaseException:
            _lib.lib().vmm_import_release(imp)
            raise
        with self._ranges_lock:
            self._ranges.append(shared)
        return Buffer(imp, alloc, self, address=address, size=size, ranged=covered, shared=shared)

    def open_many(self, pid, ranges, timing=False):
        """Import several ranges of pid at once (vmm_import_many): ranges is a list of (address,
        size) pairs, size None for the whole allocation holding address (as open without a size).
        A list of Buffers, one per pair, in order.  Ranges inside one chunk share its one import
        and mapping here (however many there are); a range across several chunks is mapped on its
        own.  Every handle comes from the owner in one round trip, everything is mapped into one
        reservation and granted access with one cuMemSetAccess (vmm_import_many in vmmshim.h).
        All or nothing: when one range cannot be imported none is, and the error names it.

        timing=True returns (buffers, timing): a dict of where the time went, in nanoseconds:
        total_ns (this call), python_ns (of it, outside the C library: arguments, Buffers),
        library_ns (vmm_import_many), and the library's own steps (vmm_import_many_timing):
        find_ns (registry reads), context_ns, connect_ns, broker_ns (waiting on the owner's
        broker), export_ns (of it, the owner exporting), import_ns, reserve_ns, map_ns,
        access_ns, release_ns (the driver calls), with counts: ranges, chunks_cached,
        chunks_new, ranges_mapped, handles, requests, connects, messages, reserves, maps,
        access_calls, threads, fallback.  A failed call raises as without it."""
        t0 = time.perf_counter_ns()
        items = []
        for entry in ranges:
            try:
                address, size = entry
            except (TypeError, ValueError):
                raise TypeError(f"vmmshim: open_many wants (address, size) pairs, not {entry!r}") from None
            address = _index(address, "address")
            size = None if size is None else _index(size, "size")
            if address < 0 or (size is not None and size <= 0):
                raise ValueError(f"vmmshim: open_many wants address >= 0 and size > 0 or None, not "
                                 f"0x{address:x}, {size}")
            items.append((address, size))
        if not items:
            return ([], _timing_of(None, time.perf_counter_ns() - t0, 0)) if timing else []
        n = len(items)
        L = _lib.lib()
        addresses = (_lib.c_u64 * n)(*(a for a, _ in items))
        sizes = (_lib.c_u64 * n)(*(0 if z is None else z for _, z in items))
        out = (ctypes.c_void_p * n)()
        t1 = time.perf_counter_ns()
        status = L.vmm_import_many(self._h(), pid, addresses, sizes, n, out)
        t_lib = time.perf_counter_ns() - t1
        _check(status)
        c_timing = _lib.ManyTiming()
        if timing:
            L.vmm_import_many_last_timing(ctypes.byref(c_timing))
        imps = [ctypes.c_void_p(out[i]) for i in range(n)]
        buffers = []
        recs = (_lib.AllocInfo * 4)()
        records, copy = L.vmm_import_records, _lib.AllocInfo.from_buffer_copy  # hundreds of ranges per call
        try:
            for (address, size), imp in zip(items, imps):
                # the records it covers, as the library read them: for allocation(s) and check();
                # an import in one record's chunk is checked by the library itself
                k = records(imp, recs, 4)
                if k > 4:
                    recs = (_lib.AllocInfo * k)()
                    k = records(imp, recs, k)
                covered = [copy(recs[j]) for j in range(k)] if k > 1 else [copy(recs[0])]
                start = address if size is not None else covered[0].address
                buf = Buffer(imp, covered[0], self, address=start, ranged=covered if k > 1 else None)
                buffers.append(buf)
        except BaseException:
            for buf in buffers:
                buf.close()
            for imp in imps[len(buffers):]:
                L.vmm_import_release(imp)
            raise
        if not timing:
            return buffers
        return buffers, _timing_of(c_timing, time.perf_counter_ns() - t0, t_lib)

    def _shared_range(self, pid, address, size, covered):
        """A live range import holding [address, address + size) of the same records, with a
        reference taken for the caller; None when there is none."""
        if covered is None or any(a.owner_alive == OWNER_DEAD for a in covered):
            return None  # a dead owner's range: vmm_import_range says so, as for a first open
        want = _names(covered)
        with self._ranges_lock:
            for r in self._ranges:
                if r.pid == pid and r.address <= address and address + size <= r.address + r.size and \
                        r.refs > 0 and set(want) <= set(_names(r.records)):
                    r.refs += 1
                    return r
        return None

    def _import(self, alloc):
        imp = ctypes.c_void_p()
        _check(_lib.lib().vmm_import(self._h(), ctypes.byref(alloc._info), ctypes.byref(imp)))
        return imp

    def _walk(self, pid, address, size):
        """The live records covering [address, address + size), in order (registry reads only)."""
        covered, at, end = [], address, address + size
        while at < end:
            try:
                a = self.find(pid, at)
            except NotFound as e:
                raise NotFound(f"pid {pid} has no live allocation at 0x{at:x}, inside the range 0x{address:x}.."
                               f"0x{end:x} ({e})", _lib.NOT_FOUND) from None
            if a.address + a.extent <= at:  # a record that does not hold at: the walk would not move on
                raise Corrupt(f"pid {pid}'s record at 0x{a.address:x} ({a.extent} bytes) was found for 0x{at:x}",
                              _lib.CORRUPT)
            covered.append(a)
            at = a.address + a.extent
        return covered


def _timing_of(c_timing, total_ns, library_ns):
    """open_many's timing dict: the whole call, the library's share, and its own steps."""
    t = {"total_ns": total_ns, "library_ns": library_ns, "python_ns": total_ns - library_ns}
    for name, _ in _lib.ManyTiming._fields_:
        t[name if name != "total_ns" else "library_total_ns"] = getattr(c_timing, name) if c_timing else 0
    return t


def _names(allocations):
    """What tells allocation records apart, also across a free and a reuse of their place."""
    return [(a.slot, a.generation, a.id) for a in allocations]


class _Range:
    """A vmm_import_range shared by the Buffers opened inside it (refs of them); released with the
    last one."""

    def __init__(self, registry, imp, pid, address, size, records):
        self.registry, self.imp, self.pid, self.address, self.size = registry, imp, pid, address, size
        self.records = list(records)
        self.refs = 1

    def put(self):
        with self.registry._ranges_lock:
            self.refs -= 1
            last = self.refs == 0
            if last:
                self.registry._ranges.remove(self)
        if last:
            _check(_lib.lib().vmm_import_release(self.imp))


def _index(value, what):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"vmmshim: {what} must be an integer, not {type(value).__name__}") from None


def _layout(shape, strides, dt):
    """(shape, strides, nbytes) of a typed window: shape a tuple (or an int for 1-D), strides in
    elements (None: row-major, contiguous), nbytes the bytes from its first element to the end of
    its last; ValueError for negative extents or strides, or strides that do not fit the shape."""
    # plain ints (the common case, hundreds per take) skip _index's conversion
    if type(shape) is tuple and all(type(n) is int for n in shape):
        pass
    elif isinstance(shape, (list, tuple)):
        shape = tuple(_index(n, "a shape entry") for n in shape)
    else:
        shape = (_index(shape, "shape"),)
    if any(n < 0 for n in shape):
        raise ValueError(f"vmmshim: negative extent in shape {shape}")
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        strides = tuple(reversed(strides))
    else:
        if not isinstance(strides, (list, tuple)):
            raise ValueError(f"vmmshim: strides must be a tuple of {len(shape)} integers, not {strides!r}")
        if type(strides) is not tuple or not all(type(s) is int for s in strides):
            strides = tuple(_index(s, "a stride") for s in strides)
        if len(strides) != len(shape):
            raise ValueError(f"vmmshim: {len(strides)} strides for {len(shape)} dimensions (shape {shape})")
        if any(s < 0 for s in strides):
            raise ValueError(f"vmmshim: negative strides {strides} (PyTorch and JAX take none)")
    if 0 in shape:
        return shape, strides, 0
    return shape, strides, (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dt.itemsize


class Buffer:
    """Imported bytes of another process.  ptr is their device pointer here, size their length,
    device the CUDA device they are for here (the DLPack device: the calling thread's current
    device when it had one and may access the memory, else the device the memory lies on; the
    mapping is granted to both, vmm_import in vmmshim.h); address is the owner's pointer to the first
    byte.  Opened without a size, a Buffer is one whole allocation (size its requested size);
    with one, exactly the bytes asked for.  allocation is the record holding the first byte,
    allocations every record the Buffer covers.  close() releases the import once no view and no
    tensor taken with DLPack uses it; any later use of the Buffer raises ValueError."""

    def __init__(self, imp, allocation, registry, address=None, size=None, offset=0, ranged=None, shared=None):
        L = _lib.lib()
        self._imp = imp
        self._registry = registry
        self._offset = offset  # of the first byte in the import (part of an allocation or a range)
        self._shared = shared  # the range import (_Range) it holds a reference to, if any
        self._ranged = ranged is not None  # records walked: check() checks them itself
        self._ptr = L.vmm_import_ptr(imp) + offset
        self._import_size = L.vmm_import_size(imp)
        self.size = self._import_size if size is None else size
        self.device = L.vmm_import_device(imp)
        # Allocation objects, or the raw records (open_many: made into objects when first asked for,
        # since a take of hundreds of tensors rarely looks at them)
        self._allocation = allocation
        self._allocations = list(ranged) if ranged is not None else None
        self.address = allocation.address if address is None else address
        self._closed = False
        self._exports = 0
        self._lock = threading.Lock()

    def _open(self):
        if self._closed:
            raise ValueError("vmmshim: the buffer is closed")

    @property
    def allocation(self):
        """The record holding the first byte (an Allocation)."""
        if isinstance(self._allocation, _lib.AllocInfo):
            self._allocation = Allocation(self._allocation)
        return self._allocation

    @property
    def allocations(self):
        """Every record the buffer covers, in address order (Allocations)."""
        if self._allocations is None:
            return [self.allocation]
        if self._allocations and isinstance(self._allocations[0], _lib.AllocInfo):
            self._allocations = [Allocation(a) for a in self._allocations]
            self._allocation = self._allocations[0]
        return self._allocations

    def _allocation_id(self):
        """The first record's id (hex), without making an Allocation of it."""
        a = self._allocation
        return bytes(a.alloc_id).hex() if isinstance(a, _lib.AllocInfo) else a.id

    @property
    def ptr(self):
        self._open()
        return self._ptr

    def read(self, offset=0, length=None):
        """length bytes (default: to the end) from offset, copied to the host."""
        self._open()
        if length is None:
            length = max(self.size - offset, 0)
        if offset < 0 or length < 0:
            raise ValueError(f"vmmshim: negative offset or length ({offset}, {length})")
        if (self._offset or self.size != self._import_size) and offset + length > self.size:
            # the import is more than the buffer: its own bounds would let this one pass
            raise InvalidArgument(f"vmmshim: read of [{offset}, {offset + length}) past the end of the buffer's "
                                  f"{self.size} bytes", _lib.INVALID)
        out = ctypes.create_string_buffer(length)
        _check(_lib.lib().vmm_import_read(self._imp, self._offset + offset, out, length))
        return out.raw

    def check(self):
        """Raises Stale once the owner freed an allocation the buffer covers (or reused its place),
        OwnerDead once it exited; the imported memory stays valid either way, until close()."""
        self._open()
        if not self._ranged:
            _check(_lib.lib().vmm_import_check(self._registry._h(), self._imp))
            return
        for a in self.allocations:
            try:
                now = self._registry.find(a.pid, a.address)
            except NotFound:
                now = None
            if now is not None and now.owner_alive == OWNER_DEAD:
                raise OwnerDead(f"pid {a.pid} (the owner of 0x{a.address:x}) has exited", _lib.OWNER_DEAD)
            if now is None or (now.slot, now.generation, now.id) != (a.slot, a.generation, a.id):
                raise Stale(f"pid {a.pid}'s allocation at 0x{a.address:x} was freed since it was imported",
                            _lib.STALE)

    def close(self):
        with self._lock:
            if self._closed:
                return
            self._closed = True
            release = self._exports == 0
        if release:
            self._release()

    def _release(self):
        imp, self._imp = self._imp, None
        if imp and self._shared is not None:
            self._shared.put()
        elif imp:
            _check(_lib.lib().vmm_import_release(imp))

    def _export_taken(self):
        with self._lock:
            self._exports += 1

    def _export_freed(self):
        with self._lock:
            self._exports -= 1
            release = self._closed and self._exports == 0
        if release:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Views and exported tensors hold a reference, so this runs only once none is left.
        if getattr(self, "_imp", None):
            self._closed = True
            self._release()

    def __dlpack_device__(self):
        self._open()
        return (_dlpack.KDL_CUDA, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A "dltensor" capsule: a 1-D uint8 tensor over the imported bytes, zero-copy.  The bytes
        were written by another process and the import is complete, so no stream has work to wait
        for.  An unversioned capsule is returned whatever max_version asks (DLPack allows it)."""
        self._open()
        return self._capsule(self._ptr, (self.size,), (1,), _dtypes.DTYPES["uint8"], dl_device, copy)

    def _capsule(self, ptr, shape, strides, dtype, dl_device, copy):
        if copy:
            raise BufferError("vmmshim: an imported buffer is exported without copying (copy=True)")
        here = (_dlpack.KDL_CUDA, self.device)
        if dl_device is not None and tuple(dl_device) != here:
            raise BufferError(f"vmmshim: the buffer lives on {here}, not {tuple(dl_device)}")
        self._export_taken()
        try:
            return _dlpack.capsule(self, ptr, self.size, self.device, shape, strides, dtype.dlpack)
        except BaseException:
            self._export_freed()
            raise

    def view(self, shape, dtype, offset=0, strides=None):
        """A zero-copy typed view of the bytes from offset: shape (a tuple, or an int for 1-D),
        dtype (a name such as "bfloat16", a torch or NumPy dtype), strides in elements as DLPack
        counts them (None: row-major, contiguous).  torch.from_dlpack, cupy.from_dlpack and
        jax.dlpack.from_dlpack take it, CuPy and Numba through __cuda_array_interface__ too.
        ValueError when the view would reach past the buffer's end, for a negative offset, an
        offset not aligned for the dtype, or strides that are negative or do not fit the shape.
        The view (and every tensor taken from it) keeps the import alive, after close() and after
        the Buffer object is dropped too."""
        self._open()
        return View(self, shape, dtype, offset, strides)

    def __repr__(self):
        state = "closed" if self._closed else f"at 0x{self._ptr:x} on device {self.device}"
        return f"<vmmshim.Buffer {self.size} bytes of pid {self.allocation.pid} 0x{self.address:x}, {state}>"


class View:
    """A typed window on a Buffer (Buffer.view): shape and strides (in elements), dtype (its
    name; dlpack_dtype the (code, bits, lanes) exported), offset (bytes from the buffer's start),
    ptr (the first element's device pointer), nbytes (the bytes it spans), device."""

    def __init__(self, buffer, shape, dtype, offset, strides):
        dt = _dtypes.resolve(dtype)
        if type(offset) is not int:
            offset = _index(offset, "offset")
        shape, strides, nbytes = _layout(shape, strides, dt)
        if offset < 0:
            raise ValueError(f"vmmshim: negative offset {offset}")
        if offset % dt.itemsize or (buffer._ptr + offset) % dt.itemsize:
            raise ValueError(f"vmmshim: offset {offset} (device address 0x{buffer._ptr + offset:x}) is not aligned "
                             f"for {dt.name} ({dt.itemsize} bytes)")
        if offset + nbytes > buffer.size:
            raise ValueError(f"vmmshim: a {dt.name} view of shape {shape}, strides {strides} at offset {offset} spans "
                             f"bytes [{offset}, {offset + nbytes}), past the end of the buffer's {buffer.size}")
        self.shape, self.strides, self.offset, self.nbytes = shape, strides, offset, nbytes
        self._dtype = dt
        self.dtype = dt.name
        self.dlpack_dtype = dt.dlpack
        self.device = buffer.device
        self.ptr = buffer._ptr + offset
        self.buffer = buffer
        # the import stays until this view is gone (__del__; the buffer object with it)
        buffer._export_taken()
        self._holds = True

    def __del__(self):
        if self.__dict__.pop("_holds", False):
            self.buffer._export_freed()

    def __dlpack_device__(self):
        return (_dlpack.KDL_CUDA, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A "dltensor" capsule of the view, zero-copy: data is ptr, byte_offset 0, strides always
        given.  No stream has work to wait for (as Buffer.__dlpack__)."""
        return self.buffer._capsule(self.ptr, self.shape, self.strides, self._dtype, dl_device, copy)

    @property
    def __cuda_array_interface__(self):
        """Version 3: strides in bytes, None when row-major contiguous; stream None (nothing to wait
        for); data (0, False) for an empty view.  Only for dtypes NumPy names (not bfloat16 and the
        float8 types: consumers take those through DLPack), else AttributeError."""
        if self._dtype.typestr is None:
            raise AttributeError(f"vmmshim: __cuda_array_interface__ has no typestr for {self.dtype}; "
                                 f"use DLPack (torch.from_dlpack, cupy.from_dlpack) for it")
        contiguous, step = True, 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and s != step:
                contiguous = False
            step *= n
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self._dtype.typestr,
            "data": (self.ptr if self.nbytes else 0, False),
            "strides": None if contiguous else tuple(s * self._dtype.itemsize for s in self.strides),
            "descr": [("", self._dtype.typestr)],
            "stream": None,
        }

    def __repr__(self):
        return (f"<vmmshim.View {self.dtype}{list(self.shape)} strides {list(self.strides)} at offset {self.offset} "
                f"of {self.buffer!r}>")


from ._group import Group  # noqa: E402  (it reads Tensor and _check from here)
from ._sidecar import Receiver, Sidecar  # noqa: E402
