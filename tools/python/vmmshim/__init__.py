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

A tensor taken with DLPack keeps the import alive after the buffer is closed, until the tensor
is freed.
"""
import ctypes
import threading

from . import _dlpack, _lib
from ._errors import (BY_STATUS, Access, Busy, Corrupt, CudaError, Error, InvalidArgument, IOFailure, LibraryNotFound,
                      NotFound, OutOfMemory, OwnerDead, Stale, VersionMismatch)
from ._lib import (ALLOC_MULTI_HANDLE, ALLOC_NOT_EXPORTABLE, ALLOC_SHARED_CHUNK, KIND_BROKER, KIND_FABRIC, KIND_PIDFD,
                   OWNER_ALIVE, OWNER_DEAD, OWNER_UNKNOWN)

__version__ = "0.1.0"

__all__ = ["Registry", "Allocation", "Process", "Buffer", "Error", "LibraryNotFound", "InvalidArgument", "NotFound",
           "Access", "Corrupt", "VersionMismatch", "Busy", "Stale", "OwnerDead", "CudaError", "OutOfMemory",
           "IOFailure", "OWNER_DEAD", "OWNER_ALIVE", "OWNER_UNKNOWN", "KIND_BROKER", "KIND_PIDFD", "KIND_FABRIC",
           "ALLOC_NOT_EXPORTABLE", "ALLOC_SHARED_CHUNK", "ALLOC_MULTI_HANDLE"]

_OWNER_NAMES = {OWNER_DEAD: "dead", OWNER_ALIVE: "alive"}


def _check(status):
    if status != _lib.OK:
        L = _lib.lib()
        # vmm_last_error is per thread, and ctypes calls run on the calling thread
        reason = (L.vmm_last_error() or L.vmm_strerror(status) or b"").decode("utf-8", "replace")
        raise BY_STATUS.get(status, Error)(reason, status)


def _text(raw):
    return raw.decode("utf-8", "replace")


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
        # what became of its allocations since it started (vmmctl ps); None: its shim keeps none
        known = bool(info.stats_known)
        for name in ("allocs", "allocs_backed", "passed_capture", "passed_device_full", "passed_unsupported",
                     "maps_adopted", "peak_requested"):
            setattr(self, name, getattr(info, name) if known else None)

    def __repr__(self):
        return f"<vmmshim.Process pid {self.pid} {self.state} {self.n_allocs} allocations {self.cmdline!r}>"


class Registry:
    """The registry named name ("/name"); None: $VMMSHIM_REGISTRY, else the per-user default."""

    def __init__(self, name=None):
        L = _lib.lib()
        handle = ctypes.c_void_p()
        _check(L.vmm_open(name.encode() if name is not None else None, ctypes.byref(handle)))
        self._handle = handle

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

    def open(self, pid, address):
        """Import the live allocation of pid containing address; a Buffer of the whole allocation."""
        alloc = self.find(pid, address)
        imp = ctypes.c_void_p()
        _check(_lib.lib().vmm_import(self._h(), ctypes.byref(alloc._info), ctypes.byref(imp)))
        return Buffer(imp, alloc, self)


class Buffer:
    """An imported allocation.  ptr is its device pointer here, size its requested size, device the
    CUDA device it is mapped for here; address is the owner's pointer to it.  close() releases the
    import once no tensor taken with DLPack uses it; any later use raises ValueError."""

    def __init__(self, imp, allocation, registry):
        L = _lib.lib()
        self._imp = imp
        self._registry = registry
        self._ptr = L.vmm_import_ptr(imp)
        self.size = L.vmm_import_size(imp)
        self.device = L.vmm_import_device(imp)
        self.allocation = allocation
        self.address = allocation.address
        self._closed = False
        self._exports = 0
        self._lock = threading.Lock()

    def _open(self):
        if self._closed:
            raise ValueError("vmmshim: the buffer is closed")

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
        out = ctypes.create_string_buffer(length)
        _check(_lib.lib().vmm_import_read(self._imp, offset, out, length))
        return out.raw

    def check(self):
        """Raises Stale once the owner freed the allocation (or reused its place), OwnerDead once it
        exited; the imported memory stays valid either way, until close()."""
        self._open()
        _check(_lib.lib().vmm_import_check(self._registry._h(), self._imp))

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
        if imp:
            _check(_lib.lib().vmm_import_release(imp))

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
        # Exported tensors hold a reference, so this runs only once none is left.
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
        if copy:
            raise BufferError("vmmshim: an imported buffer is exported without copying (copy=True)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"vmmshim: the buffer lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        with self._lock:
            self._exports += 1
        try:
            return _dlpack.capsule(self, self._ptr, self.size, self.device)
        except BaseException:
            self._export_freed()
            raise

    def __repr__(self):
        state = "closed" if self._closed else f"at 0x{self._ptr:x} on device {self.device}"
        return f"<vmmshim.Buffer {self.size} bytes of pid {self.allocation.pid} 0x{self.address:x}, {state}>"
