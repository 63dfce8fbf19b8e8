"""ctypes over libvmmshim-client.so: the structures of tools/include/vmmshim.h, field for field,
and the functions' prototypes.  The library is loaded on first use, so that importing the package
(for its exceptions, or `--help`) works where the library is not installed."""
import ctypes
import ctypes.util
import os
import struct
import threading

from . import _paths
from ._errors import LibraryNotFound

c_u8, c_u32, c_u64, c_i32, c_int = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int

# vmm_status
OK, INVALID, NOT_FOUND, ACCESS, CORRUPT, VERSION, BUSY, STALE, OWNER_DEAD, CUDA, NOMEM, IO, NO_SHIM, PAUSED, STATE = range(15)

# KEPT: the owner has exited and a keeper (vmmctl keep) holds the memory and serves its imports
OWNER_DEAD, OWNER_ALIVE, OWNER_UNKNOWN, OWNER_KEPT = 0, 1, 2, 3
KIND_BROKER, KIND_PIDFD, KIND_FABRIC = 1, 2, 4
ALLOC_NOT_EXPORTABLE, ALLOC_SHARED_CHUNK, ALLOC_MULTI_HANDLE, ALLOC_KEPT, ALLOC_PAUSED = 1, 2, 4, 8, 16

# vmm_alloc_info.api, named as vmmctl names them
API_NAMES = {1: "cudaMalloc", 2: "cudaMallocAsync", 3: "cuMemAlloc", 4: "cuMemAllocAsync",
             5: "cuMemAllocPitch", 6: "cuMemMap", 15: "test"}


class AllocInfo(ctypes.Structure):
    """vmm_alloc_info."""
    _fields_ = [
        ("alloc_id", c_u8 * 16),
        ("generation", c_u64),
        ("slot", c_u64),
        ("pid", c_u32),
        ("owner_alive", c_int),
        ("owner_start_time", c_u64),
        ("owner_pidns", c_u64),
        ("device", c_u32),
        ("device_uuid", c_u8 * 16),
        ("address", c_u64),
        ("requested_size", c_u64),
        ("mapped_size", c_u64),
        ("stream", c_u64),
        ("created_ns", c_u64),
        ("api", c_u32),
        ("handle_kinds", c_u32),
        ("exported_fd", c_i32),
        ("n_frames", c_u32),
        ("frames", c_u64 * 8),
        ("tag", ctypes.c_char * 32),
        ("chunk_id", c_u64),
        ("chunk_offset", c_u64),
        ("extent", c_u64),
        ("flags", c_u32),
        ("n_handles", c_u32),
    ]


class ProcInfo(ctypes.Structure):
    """vmm_proc_info."""
    _fields_ = [
        ("pid", c_u32),
        ("alive", c_int),
        ("start_time", c_u64),
        ("pidns", c_u64),
        ("uid", c_u32),
        ("registered_ns", c_u64),
        ("broker_path", ctypes.c_char * 112),
        ("cmdline", ctypes.c_char * 256),
        ("n_allocs", c_u64),
        ("bytes_requested", c_u64),
        ("bytes_mapped", c_u64),
        ("stats_known", c_int),
        ("allocs", c_u64),
        ("allocs_backed", c_u64),
        ("passed_capture", c_u64),
        ("passed_device_full", c_u64),
        ("passed_unsupported", c_u64),
        ("maps_adopted", c_u64),
        ("peak_requested", c_u64),
        ("unpublished", c_u64),
        ("bytes_paused", c_u64),
    ]


class KeeperInfo(ctypes.Structure):
    """vmm_keeper_info."""
    _fields_ = [
        ("owner_pid", c_u32),
        ("keeper_pid", c_u32),
        ("state", c_int),
        ("end_kind", c_int),
        ("end_value", c_int),
        ("since_ns", c_u64),
        ("ended_ns", c_u64),
        ("held_allocs", c_u64),
        ("held_bytes", c_u64),
        ("socket", ctypes.c_char * 112),
    ]


class DType(ctypes.Structure):
    """vmm_dtype (DLPack's DLDataType)."""
    _fields_ = [("code", c_u8), ("bits", c_u8), ("lanes", ctypes.c_uint16)]


MAX_DIMS = 8
NAME_MAX = 127


class TensorInfo(ctypes.Structure):
    """vmm_tensor_info."""
    _fields_ = [
        ("name", ctypes.c_char * (NAME_MAX + 1)),
        ("pid", c_u32),
        ("dtype", DType),
        ("ndim", c_u32),
        ("address", c_u64),
        ("nbytes", c_u64),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("alloc_id", c_u8 * 16),
        ("published_ns", c_u64),
    ]


class TensorDesc(ctypes.Structure):
    """vmm_tensor_desc (the owner side's, in the shim)."""
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("address", c_u64),
        ("dtype", DType),
        ("ndim", c_u32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


MESH_MAX_DIMS = 3
PLACE_NONE, PLACE_REPLICATE, PLACE_PARTIAL, PLACE_SHARD = range(4)  # VMM_PLACE_*


class Placement(ctypes.Structure):
    """vmm_placement."""
    _fields_ = [("kind", c_u8), ("dim", c_u8), ("mesh", ctypes.c_uint16), ("coord", ctypes.c_uint16),
                ("reserved", ctypes.c_uint16), ("global_extent", ctypes.c_int64)]


class Shard(ctypes.Structure):
    """vmm_shard."""
    _fields_ = [("mesh_ndim", c_u32), ("reserved", c_u32), ("place", Placement * MESH_MAX_DIMS)]


class TensorShard(ctypes.Structure):
    """vmm_tensor_shard."""
    _fields_ = [("version", c_u64), ("shard", Shard)]


class WeightsInfo(ctypes.Structure):
    """vmm_weights_info."""
    _fields_ = [("seq", c_u64), ("version", c_u64), ("job", ctypes.c_char * 24)]


assert ctypes.sizeof(Placement) == 16 and ctypes.sizeof(Shard) == 56 and ctypes.sizeof(TensorShard) == 64, \
    "vmm_shard's layout"


class SleepReport(ctypes.Structure):
    """vmm_sleep_report."""
    _fields_ = [(name, c_u64) for name in (
        "bytes_released", "bytes_kept", "bytes_not_shim", "ns", "segments", "allocations", "bytes_held")] + [
            ("n_holders", c_u32), ("holders", c_u32 * 8), ("flags", c_u32)]


PAUSE_DISCARD, PAUSE_FILE = 1, 2  # VMM_PAUSE_*
SLEEP_HOLDERS_UNKNOWN = 1  # vmm_sleep_report.flags


class ManyTiming(ctypes.Structure):
    """vmm_import_many_timing."""
    _fields_ = [(name, c_u64) for name in (
        "total_ns", "find_ns", "context_ns", "connect_ns", "broker_ns", "export_ns", "import_ns", "reserve_ns",
        "map_ns", "access_ns", "release_ns")] + [(name, c_u32) for name in (
            "ranges", "chunks_cached", "chunks_new", "ranges_mapped", "handles", "requests", "connects", "messages",
            "reserves", "maps", "access_calls", "threads", "fallback", "shared")]


ALLOC_FN = ctypes.CFUNCTYPE(c_int, ctypes.c_void_p, ctypes.POINTER(AllocInfo))
PROC_FN = ctypes.CFUNCTYPE(c_int, ctypes.c_void_p, ctypes.POINTER(ProcInfo))
# Registry.tensors reads vmm_list_tensors' array with one struct.iter_unpack (TENSOR_UNPACK), where
# a callback a name and reading each field through ctypes cost ~3.5 us a tensor
TENSOR_UNPACK = struct.Struct("<%dsIBBHI4xQQ%dq%dq16sQ" % (NAME_MAX + 1, MAX_DIMS, MAX_DIMS))
assert TENSOR_UNPACK.size == ctypes.sizeof(TensorInfo) and all(
    getattr(TensorInfo, f).offset == o for f, o in
    (("pid", 128), ("dtype", 132), ("ndim", 136), ("address", 144), ("nbytes", 152), ("shape", 160),
     ("strides", 160 + 8 * MAX_DIMS), ("alloc_id", 160 + 16 * MAX_DIMS), ("published_ns", 176 + 16 * MAX_DIMS))), \
    "vmm_tensor_info's layout"

# vmm_import_describe's array: ptr, size, device, n_records, alloc_id (vmmshim.h asserts the layout)
IMPORT_DESC = struct.Struct("<QQiI16s")

_P = ctypes.c_void_p  # vmm_registry *, vmm_imported *: opaque
_PROTOTYPES = {
    "vmm_strerror": (ctypes.c_char_p, [c_int]),
    "vmm_last_error": (ctypes.c_char_p, []),
    "vmm_open": (c_int, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "vmm_close": (None, [_P]),
    "vmm_foreach_alloc": (c_int, [_P, ALLOC_FN, ctypes.c_void_p]),
    "vmm_foreach_proc": (c_int, [_P, PROC_FN, ctypes.c_void_p]),
    "vmm_find": (c_int, [_P, c_u32, c_u64, ctypes.POINTER(AllocInfo)]),
    "vmm_find_proc": (c_int, [_P, c_u32, ctypes.POINTER(ProcInfo)]),
    "vmm_import": (c_int, [_P, ctypes.POINTER(AllocInfo), ctypes.POINTER(_P)]),
    "vmm_import_range": (c_int, [_P, c_u32, c_u64, c_u64, ctypes.POINTER(_P)]),
    "vmm_import_many": (c_int, [_P, c_u32, ctypes.POINTER(c_u64), ctypes.POINTER(c_u64), ctypes.c_size_t,
                                ctypes.POINTER(_P)]),
    "vmm_import_ptr": (c_u64, [_P]),
    "vmm_import_size": (c_u64, [_P]),
    "vmm_import_device": (c_int, [_P]),
    "vmm_import_records": (ctypes.c_size_t, [_P, ctypes.POINTER(AllocInfo), ctypes.c_size_t]),
    "vmm_import_describe": (c_int, [ctypes.POINTER(_P), ctypes.c_size_t, ctypes.c_void_p]),
    "vmm_import_many_begin": (c_int, [_P, c_u32, ctypes.POINTER(c_u64), ctypes.POINTER(c_u64), ctypes.c_size_t,
                                      ctypes.c_void_p, ctypes.POINTER(_P)]),
    "vmm_import_many_end": (c_int, [_P, ctypes.POINTER(_P)]),
    "vmm_import_tensors_begin": (c_int, [_P, c_u32, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.c_void_p, ctypes.POINTER(_P)]),
    "vmm_import_many_last_timing": (c_int, [ctypes.POINTER(ManyTiming)]),
    "vmm_import_release": (c_int, [_P]),
    "vmm_import_drop_idle": (c_int, []),
    "vmm_import_read": (c_int, [_P, c_u64, ctypes.c_void_p, c_u64]),
    "vmm_import_check": (c_int, [_P, _P]),
    "vmm_list_tensors": (c_int, [_P, c_u32, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "vmm_list_shards": (c_int, [_P, c_u32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_size_t)]),
    "vmm_weights_state": (c_int, [_P, c_u32, ctypes.POINTER(WeightsInfo)]),
    "vmm_keeper_of": (c_int, [_P, c_u32, ctypes.POINTER(KeeperInfo)]),
    "vmm_pause_process": (c_int, [_P, c_u32, ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(SleepReport),
                                  ctypes.c_size_t]),
    "vmm_resume_process": (c_int, [_P, c_u32, ctypes.c_char_p, ctypes.POINTER(SleepReport), ctypes.c_size_t]),
}

# a source tree's build (this package run from tools/python)
SOURCE_TREE_LIB = _paths.SOURCE_BUILD / "libvmmshim-client.so"

_lock = threading.Lock()
_loaded = None


def _candidates():
    # VMMSHIM_CLIENT_LIB alone when set (named explicitly: nothing else is a good substitute); else
    # the wheel's own (vmmshim/_native/lib), a source tree's build/, the loader's search (_paths.py)
    yield from _paths.client_lib_candidates()
    if os.environ.get("VMMSHIM_CLIENT_LIB"):
        return
    # last: it runs ldconfig (or a compiler), which takes a while
    by_ldconfig = ctypes.util.find_library("vmmshim-client")
    if by_ldconfig:
        yield by_ldconfig


def lib():
    """The client library with its prototypes set; LibraryNotFound when none loads."""
    global _loaded
    with _lock:
        if _loaded is None:
            reasons = []
            for path in _candidates():
                try:
                    handle = ctypes.CDLL(path)
                except OSError as e:
                    reasons.append(str(e))
                    continue
                missing = [name for name in _PROTOTYPES if not hasattr(handle, name)]
                if missing:
                    reasons.append(f"{path} lacks {', '.join(missing)} (older than this package)")
                    continue
                for name, (restype, argtypes) in _PROTOTYPES.items():
                    fn = getattr(handle, name)
                    fn.restype, fn.argtypes = restype, argtypes
                _loaded = handle
                break
            else:
                raise LibraryNotFound("libvmmshim-client.so not loaded (set VMMSHIM_CLIENT_LIB to its path): "
                                      + "; ".join(reasons))
        return _loaded
