"""DLPack export in pure ctypes (dlpack.h v0.8, the unversioned "dltensor" capsule; dtype codes as
dlpack.h 1.1 numbers them, float8 included).

A capsule owns one DLManagedTensor until a consumer renames it "used_dltensor"; from then on the
consumer owns it and calls its deleter when the tensor dies.  Until that deleter runs (or the
unconsumed capsule is destroyed) the exporting Buffer, and with it the import that maps the
bytes, must stay alive: _live holds it, keyed by the DLManagedTensor's address."""
import ctypes
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


_export_types = {}


def _export_type(ndim):
    """A structure with the managed tensor first, so that its address is the export's, and room
    for ndim shape and stride entries, which live with it for as long as the consumer holds the
    tensor (ndim 0: arrays of one entry, never read, so that the pointers are not NULL)."""
    cls = _export_types.get(ndim)
    if cls is None:
        n = max(ndim, 1)
        cls = type(f"_Export{ndim}", (ctypes.Structure,),
                   {"_fields_": [("managed", DLManagedTensor), ("shape", ctypes.c_int64 * n),
                                 ("strides", ctypes.c_int64 * n)]})
        _export_types[ndim] = cls
    return cls


NAME = b"dltensor"  # referenced by every capsule: it must outlive them, so it is module-level

_live = {}
_live_lock = threading.Lock()


def _delete(managed):
    with _live_lock:
        entry = _live.pop(managed, None)
    if entry is not None:
        entry[1]._export_freed()


_DELETER = DELETER(_delete)

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
    exp = _export_type(len(shape))()
    for i, (n, s) in enumerate(zip(shape, strides)):
        exp.shape[i] = n
        exp.strides[i] = s
    t = exp.managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(KDL_CUDA, device)
    t.ndim = len(shape)
    t.dtype = DLDataType(*dtype)
    t.shape = ctypes.cast(exp.shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(exp.strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    exp.managed.deleter = _DELETER
    address = ctypes.addressof(exp)
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
