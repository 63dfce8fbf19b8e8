"""Element types of Buffer.view(): their DLPack codes (dlpack.h's DLDataTypeCode) and their
__cuda_array_interface__ typestr (NumPy's array-interface notation; None where NumPy has none).
A dtype may be given as its name ("bfloat16"), a torch dtype (torch.bfloat16), a NumPy dtype or
scalar type (numpy.float32, numpy.dtype("int8"), ml_dtypes.bfloat16), or Python's bool, int or
float; none of those frameworks is imported here."""

# dlpack.h DLDataTypeCode
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL = 0, 1, 2, 4, 6
KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E5M2 = 10, 12


class DType:
    """name, itemsize (bytes), DLPack (code, bits, lanes), and typestr (None: no NumPy type)."""

    def __init__(self, name, code, bits, typestr):
        self.name, self.code, self.bits, self.typestr = name, code, bits, typestr
        self.itemsize = bits // 8
        self.dlpack = (code, bits, 1)

    def __repr__(self):
        return f"vmmshim.dtype({self.name!r})"

    def __eq__(self, other):
        return isinstance(other, DType) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


DTYPES = {d.name: d for d in (
    DType("bool", KDL_BOOL, 8, "|b1"),
    DType("int8", KDL_INT, 8, "|i1"),
    DType("int16", KDL_INT, 16, "<i2"),
    DType("int32", KDL_INT, 32, "<i4"),
    DType("int64", KDL_INT, 64, "<i8"),
    DType("uint8", KDL_UINT, 8, "|u1"),
    DType("float16", KDL_FLOAT, 16, "<f2"),
    DType("float32", KDL_FLOAT, 32, "<f4"),
    DType("float64", KDL_FLOAT, 64, "<f8"),
    DType("bfloat16", KDL_BFLOAT, 16, None),
    DType("float8_e4m3fn", KDL_FLOAT8_E4M3FN, 8, None),
    DType("float8_e5m2", KDL_FLOAT8_E5M2, 8, None),
)}

# other names of the same types: PyTorch's (torch.half is str()'d "torch.float16" already, but
# the names are accepted as strings too), NumPy's type characters and bool_ for bool
ALIASES = {"half": "float16", "float": "float32", "double": "float64", "short": "int16", "int": "int32",
           "long": "int64", "bool_": "bool", "b1": "bool", "i1": "int8", "i2": "int16", "i4": "int32",
           "i8": "int64", "u1": "uint8", "f2": "float16", "f4": "float32", "f8": "float64", "bf16": "bfloat16"}

# Python's own types, as NumPy takes them
PY_TYPES = {bool: "bool", int: "int64", float: "float64"}


def _name_of(dtype):
    """The name dtype goes by, without importing the framework it comes from."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, type) and dtype in PY_TYPES:
        return PY_TYPES[dtype]
    module = type(dtype).__module__ or ""
    if module.split(".")[0] == "torch":
        return str(dtype).split(".", 1)[-1]  # "torch.bfloat16" -> "bfloat16"
    if isinstance(dtype, type):  # numpy.float32, ml_dtypes.bfloat16: scalar types
        return dtype.__name__
    name = getattr(dtype, "name", None)  # numpy.dtype(...), jax's dtypes (NumPy's)
    if isinstance(name, str):
        if getattr(dtype, "byteorder", "=") == ">":
            raise ValueError(f"vmmshim: {dtype!r} is big-endian; device memory is little-endian")
        return name
    raise TypeError(f"vmmshim: not a dtype: {dtype!r} (give a name such as 'float32', a torch or NumPy dtype)")


BY_DLPACK = {d.dlpack: d for d in DTYPES.values()}


def from_dlpack(code, bits, lanes):
    """The DType of a DLPack (code, bits, lanes); None for one a view cannot take."""
    return BY_DLPACK.get((code, bits, lanes))


def of_published(name, pid, dlpack):
    """The DType of pid's published tensor `name` of DLPack dtype dlpack (code, bits, lanes);
    ValueError for one a view cannot take."""
    dt = BY_DLPACK.get(tuple(dlpack))
    if dt is None:
        raise ValueError(f"vmmshim: tensor {name!r} of pid {pid} is of DLPack dtype {tuple(dlpack)}, which a view "
                         f"cannot take (one of: {', '.join(DTYPES)})")
    return dt


def resolve(dtype):
    """The DType that dtype names; ValueError for a type a view cannot take, TypeError for
    something that is no dtype."""
    if isinstance(dtype, DType):
        return dtype
    name = _name_of(dtype)
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    found = DTYPES.get(key)
    if found is None:
        raise ValueError(f"vmmshim: unsupported dtype {name!r}; one of: {', '.join(DTYPES)}")
    return found
