"""DLPack export in pure ctypes (dlpack.h v0.8, the unversioned "dltensor" capsule; dtype codes as
dlpack.h 1.1 numbers them, float8 included).

A capsule owns one DLManagedTensor until a consumer renames it "used_dltensor"; from then on the
consumer owns it and calls its deleter when the tensor dies.  Until that deleter runs (or the
unconsumed capsule is destroyed) the exporting Buffer, and with it the import that maps the
bytes, must stay alive: _live holds it, keyed by the DLManagedTensor's address."""
import ctypes
import struct
import threading

KDL_CUDA = 2
KDL_UINT = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# The deleter takes the DLManagedTensor's address (a pointer either way in the C ABI).
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


# The exported tensor is written with one struct.pack_into per part rather than field by field
# through ctypes: a take of a whole model exports hundreds of them, and ctypes' per-field cost was
# most of a view's.  The byte layout is DLManagedTensor's, which the assert below holds to it.
_HEAD = struct.Struct("<QiiiBBHQQQQQ")  # data, device, ndim, dtype, shape, strides, byte_offset, ctx, deleter
assert _HEAD.size == ctypes.sizeof(DLManagedTensor) == 64
assert DLManagedTensor.deleter.offset == 56 and DLTensor.shape.offset == 24 and DLTensor.dtype.offset == 20

_export_types = {}


def _export_type(ndim):
    """Room for the managed tensor first, so that its address is the export's, then ndim shape and
    stride entries, which live with it for as long as the consumer holds the tensor (ndim 0: one
    entry each, never read, so that the pointers are not NULL); with the Struct that packs them."""
    kind = _export_types.get(ndim)
    if kind is None:
        n = max(ndim, 1)
        kind = (ctypes.c_uint64 * (_HEAD.size // 8 + 2 * n), struct.Struct(f"<{n}q{n}q"), n)
        _export_types[ndim] = kind
    return kind


NAME = b"dltensor"  # referenced by every capsule: it must outlive them, so it is module-level

_live = {}
_live_lock = threading.Lock()


def _delete(managed):
    with _live_lock:
        entry = _live.pop(managed, None)
    if entry is not None:
        entry[1]._export_freed()


_DELETER = DELETER(_delete)
_DELETER_ADDRESS = ctypes.cast(_DELETER, ctypes.c_void_p).value

# Own function objects, so that the argtypes set here never change ctypes.pythonapi's for others.
_api = ctypes.PyDLL(None)
_capsule_is_valid = _api.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]
_capsule_get_pointer = _api.PyCapsule_GetPointer
_capsule_get_pointer.restype, _capsule_get_pointer.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]

CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _destroy_capsule(capsule):
    # A consumed capsule was renamed "used_dltensor": its tensor is the consumer's to delete.
    if _capsule_is_valid(capsule, NAME):
        _delete(_capsule_get_pointer(capsule, NAME))


_DESTRUCTOR = CAPSULE_DESTRUCTOR(_destroy_capsule)

_capsule_new = _api.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, CAPSULE_DESTRUCTOR]


def capsule(owner, ptr, size, device, shape=None, strides=None, dtype=(KDL_UINT, 8, 1)):
    """A "dltensor" capsule of a tensor at device pointer ptr on CUDA device `device`: by default
    1-D uint8 of size bytes, else of shape and strides (in elements, always given: DLPack >= 1.2
    wants them non-NULL) and dtype (code, bits, lanes).  ptr is the first element's address and
    byte_offset 0, as PyTorch and CuPy export views (dlpack.h notes that producers do not keep
    data 256-byte aligned, and consumers add byte_offset anyway).  owner._export_freed() is called
    once the tensor is deleted."""
    if shape is None:
        shape, strides = (size,), (1,)
    ndim = len(shape)
    array_type, tail, room = _export_type(ndim)
    exp = array_type()
    address = ctypes.addressof(exp)
    _HEAD.pack_into(exp, 0, ptr, KDL_CUDA, device, ndim, dtype[0], dtype[1], dtype[2], address + 64,
                    address + 64 + 8 * room, 0, 0, _DELETER_ADDRESS)
    if ndim:
        tail.pack_into(exp, 64, *shape, *strides)
    with _live_lock:
        _live[address] = (exp, owner)
    try:
        return _capsule_new(address, NAME, _DESTRUCTOR)
    except BaseException:
        with _live_lock:
            del _live[address]
        raise


def live_exports():
    """How many tensors exported by this process are not deleted yet."""
    with _live_lock:
        return len(_live)
