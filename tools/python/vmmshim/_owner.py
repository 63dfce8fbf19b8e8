"""The owner side of named tensors: vmmshim.publish(name, tensor), publish_many(mapping) and
unpublish(name), in a process running under libvmmshim.so (LD_PRELOAD).  They call the shim's
own vmm_publish_many and vmm_unpublish, which ctypes.CDLL(None) finds among the preloaded
library's symbols; the client library is not needed.  A tensor is anything with
__cuda_array_interface__ (shape, strides, typestr taken from it) or, failing that, __dlpack__
(the capsule's DLTensor read with ctypes, not consumed); a torch tensor that requires grad is
described through its detach()."""
import contextlib
import ctypes
import threading

from . import _lib, _shards
from ._errors import BY_STATUS, Error, InvalidArgument, NotUnderShim

KDL_CUDA = 2
# __cuda_array_interface__ typestr kinds as DLPack codes
_KINDS = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}

_lock = threading.Lock()
_shim = None
_job = None  # the job tag this process published under

_api = ctypes.PyDLL(None)
_is_valid = _api.PyCapsule_IsValid
_is_valid.restype, _is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_get_pointer = _api.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _lib.DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):  # DLManagedTensor: the tensor first
    _fields_ = [("dl_tensor", _DLTensor)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack >= 1.0)
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


def _functions():
    """The shim's vmm_publish_many, vmm_unpublish and vmm_publish_error; NotUnderShim without it."""
    global _shim
    with _lock:
        if _shim is None:
            try:
                here = ctypes.CDLL(None)
                fns = (here.vmm_publish_many, here.vmm_unpublish, here.vmm_publish_error)
            except (OSError, AttributeError):
                raise NotUnderShim("vmmshim.publish: not running under the shim: start the program with "
                                   "LD_PRELOAD=/path/to/libvmmshim.so", _lib.NO_SHIM) from None
            fns[0].restype, fns[0].argtypes = ctypes.c_int, [ctypes.POINTER(_lib.TensorDesc), ctypes.c_size_t]
            fns[1].restype, fns[1].argtypes = ctypes.c_int, [ctypes.c_char_p]
            fns[2].restype, fns[2].argtypes = ctypes.c_char_p, []
            _shim = fns
        return _shim


def _check(status, who):
    if status != _lib.OK:
        reason = (_functions()[2]() or b"").decode("utf-8", "replace")
        # the reason names the C function; say which Python one was called
        head, sep, rest = reason.partition(": ")
        if sep and head.startswith("vmm_"):
            reason = f"{who}: {rest}"
        raise BY_STATUS.get(status, Error)(reason, status)


def _from_cai(cai):
    """(address, (code, bits, lanes), shape, strides in elements) from __cuda_array_interface__."""
    if cai.get("mask") is not None:
        raise ValueError("a masked array (its __cuda_array_interface__ has a mask)")
    typestr = cai["typestr"]
    order, kind, size = typestr[0], typestr[1], int(typestr[2:])
    if kind not in _KINDS:
        raise ValueError(f"__cuda_array_interface__ typestr {typestr!r} is no number type")
    if order == ">" and size > 1:
        raise ValueError(f"typestr {typestr!r} is big-endian; device memory is little-endian")
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        out, step = [], 1
        for n in reversed(shape):
            out.insert(0, step)
            step *= max(n, 1)
        strides = tuple(out)
    else:
        if any(s % size for s in strides):
            raise ValueError(f"strides {tuple(strides)} (bytes) are not whole elements of {size} bytes")
        strides = tuple(int(s) // size for s in strides)
    return int(cai["data"][0]), (_KINDS[kind], size * 8, 1), shape, strides


def _from_dlpack(obj):
    """The same from the DLTensor of obj.__dlpack__() (read, never consumed: dropping the capsule
    lets the producer free it)."""
    device = getattr(obj, "__dlpack_device__", None)
    if device is not None and int(device()[0]) != KDL_CUDA:
        raise ValueError(f"it lives on DLPack device type {int(device()[0])}, not CUDA ({KDL_CUDA})")
    capsule = obj.__dlpack__()
    if _is_valid(capsule, b"dltensor"):
        t = _Managed.from_address(_get_pointer(capsule, b"dltensor")).dl_tensor
    elif _is_valid(capsule, b"dltensor_versioned"):
        t = _ManagedVersioned.from_address(_get_pointer(capsule, b"dltensor_versioned")).dl_tensor
    else:
        raise ValueError("__dlpack__ gave no DLPack capsule")
    if t.device.device_type != KDL_CUDA:
        raise ValueError(f"it lives on DLPack device type {t.device.device_type}, not CUDA ({KDL_CUDA})")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        out, step = [], 1
        for n in reversed(shape):
            out.insert(0, step)
            step *= max(n, 1)
        strides = tuple(out)
    dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
    address = (t.data or 0) + t.byte_offset
    del capsule
    return address, dtype, shape, strides


def describe(obj):
    """(address, (code, bits, lanes), shape, strides in elements) of a CUDA tensor: from
    __cuda_array_interface__, else __dlpack__; a torch tensor that requires grad through detach()."""
    reasons = []
    candidates = [obj]
    while candidates:
        cand = candidates.pop(0)
        try:
            cai = cand.__cuda_array_interface__
        except AttributeError:
            cai = None
        except Exception as e:  # torch: bfloat16 has no typestr, a tensor that requires grad none at all
            reasons.append(f"__cuda_array_interface__: {e}")
            cai = None
        if cai is not None:
            try:
                return _from_cai(cai)
            except (KeyError, TypeError, ValueError, IndexError) as e:
                reasons.append(f"__cuda_array_interface__: {e}")
        if hasattr(cand, "__dlpack__"):
            try:
                return _from_dlpack(cand)
            except Exception as e:  # producers raise what they like (BufferError, RuntimeError, ...)
                reasons.append(f"__dlpack__: {e}")
        if cand is obj and callable(getattr(obj, "detach", None)):
            try:
                candidates.append(obj.detach())
            except Exception as e:
                reasons.append(f"detach(): {e}")
    if not reasons:
        raise TypeError(f"vmmshim.publish: a {type(obj).__name__} is no CUDA tensor (it has neither "
                        f"__cuda_array_interface__ nor __dlpack__)")
    raise ValueError(f"vmmshim.publish: cannot describe this {type(obj).__name__} as a CUDA tensor: "
                     + "; ".join(reasons))


def _name_bytes(name):
    if not isinstance(name, str):
        raise TypeError(f"vmmshim.publish: a name is a str, not {type(name).__name__}")
    if "\0" in name:
        raise InvalidArgument(f"vmmshim.publish: name {name!r} holds a NUL character", _lib.INVALID)
    return name.encode("utf-8")


def _extra(name):
    """A shim function newer than vmm_publish_many (vmm_publish_shards and family); NotUnderShim
    naming it when the preloaded shim predates it."""
    _functions()
    fn = getattr(ctypes.CDLL(None), name, None)
    if fn is None:
        raise NotUnderShim(f"vmmshim: the preloaded shim predates {name}", _lib.NO_SHIM)
    return fn


def publish_many(tensors, version=None, job=None):
    """Publish several tensors by name at once, all or none: tensors is a mapping of name to
    tensor (model.state_dict()) or an iterable of (name, tensor) pairs.  A name published before
    is replaced.  Every tensor is described before any name changes; errors as publish's.
    A DTensor (FSDP2's parameters) publishes its local shard, with where it lies in the whole
    tensor (mesh, placements, this rank's coordinate, the global shape), for Group to assemble.
    version: a number companions see per name (Group.take says which version it took).
    job: the tag companions find this rank's job by (Group(job=...)), kept until another is given;
    default, once some tensor is a DTensor, torchrun's run id (TORCHELASTIC_RUN_ID) or else
    MASTER_ADDR:MASTER_PORT."""
    global _job
    items = list(tensors.items()) if hasattr(tensors, "items") else list(tensors)
    sharded = _publish(items, "vmmshim.publish_many", version)
    if job is None and sharded and _job is None:
        job = _shards.default_job()
    if job is not None and str(job) != _job:
        _check(_job_fn()(str(job).encode()), "vmmshim.publish_many")
        _job = str(job)


def _job_fn():
    fn = _extra("vmm_publish_job")
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_char_p]
    return fn


def _publish(items, who, version=None):
    """Publishes items; whether any was a DTensor."""
    fns = _functions()
    n = len(items)
    if n == 0:
        return False
    descs = (_lib.TensorDesc * n)()
    shards = (_lib.Shard * n)()
    any_shard = False
    keep = []  # the names' bytes and the shape and stride arrays, alive until the call returns
    for i, item in enumerate(items):
        try:
            name, obj = item
        except (TypeError, ValueError):
            raise TypeError(f"vmmshim.publish_many wants a mapping or (name, tensor) pairs, not {item!r}") from None
        raw = _name_bytes(name)
        if _shards.is_dtensor(obj):
            try:
                shards[i] = _shards.shard_desc(obj)
            except ValueError as e:
                raise ValueError(f"{who}: tensor {name!r}: {e}") from None
            obj = obj.to_local()
            any_shard = True
        try:
            address, (code, bits, lanes), shape, strides = describe(obj)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (tensor {name!r})") from None
        dims = max(len(shape), 1)
        shape_arr = (ctypes.c_int64 * dims)(*shape)
        strides_arr = (ctypes.c_int64 * dims)(*strides)
        keep.append((raw, shape_arr, strides_arr))
        d = descs[i]
        d.name, d.address, d.ndim = raw, address, len(shape)
        d.dtype = _lib.DType(code, bits, lanes)
        d.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
        d.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    if not any_shard and version is None:
        _check(fns[0](descs, n), who)
        return False
    fn = _extra("vmm_publish_shards")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_lib.TensorDesc), ctypes.POINTER(_lib.Shard), ctypes.c_size_t, ctypes.c_uint64]
    _check(fn(descs, shards, n, int(version or 0)), who)
    return any_shard


def publish(name, tensor):
    """Publish tensor (CUDA memory of this process, allocated under the shim) as name, for
    companions to find (Registry.tensors, open_tensors, `vmmctl list --names`).  Publishing a
    name again replaces it, as dict assignment does.  The name lives until unpublish(name), or
    until the allocation holding the tensor is freed (with PyTorch: its cached block, which
    outlives the tensor: unpublish a tensor you drop).  Raises NotUnderShim outside the shim,
    InvalidArgument (a name empty, over 127 bytes of UTF-8 or holding control characters; no
    elements; negative strides; more than 8 dimensions), NotFound (memory that is not the
    shim's), Access (memory the shim could not make exportable), OutOfMemory (262144 names), and
    TypeError / ValueError for an object that is no CUDA tensor."""
    _publish([(name, tensor)], "vmmshim.publish")


@contextlib.contextmanager
def updating(version):
    """Around an in-place change of published tensors (an optimizer step): companions that take
    with Group (or check vmm_weights_state around their copies) copy again rather than mix the
    tensors before and after.  The change counts as done, at `version`, once the current CUDA
    stream reaches the end of the block (a host function queued there: the block does not wait)."""
    begin = _extra("vmm_update_begin")
    begin.restype, begin.argtypes = ctypes.c_int, []
    end = _extra("vmm_update_end")
    end.restype, end.argtypes = ctypes.c_int, [ctypes.c_uint64, ctypes.c_void_p]
    _check(begin(), "vmmshim.updating")
    try:
        yield
    finally:
        _check(end(int(version), _shards.current_stream()), "vmmshim.updating")


def unpublish(name):
    """Drop a name published by this process; NotFound when there is none."""
    fns = _functions()
    _check(fns[1](_name_bytes(name)), "vmmshim.unpublish")
