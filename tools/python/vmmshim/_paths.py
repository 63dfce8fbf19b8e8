"""Where the native parts are: inside the installed wheel first (vmmshim/_native, what
tools/python/build_wheel.py puts there), else a source tree's build/ (this package run from
tools/python), else the system (`make install`'s lib directories, PATH, the loader's search).  An environment variable names one
explicitly and then nothing else is tried: VMMSHIM_CLIENT_LIB (the client library, _lib.py),
VMMSHIM_SHIM_LIB (the libvmmshim.so `vmmshim run` and `doctor` preload), VMMSHIM_VMMCTL (vmmctl)."""
import os
import pathlib
import shutil
import sys

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
NATIVE = PACKAGE_DIR / "_native"
SOURCE_BUILD = PACKAGE_DIR.parents[2] / "build"


def bundled():
    """True when this package came with its native parts (an installed wheel)."""
    return (NATIVE / "lib" / "libvmmshim.so").is_file()


def _first(env, *paths):
    named = os.environ.get(env)
    if named:
        return named
    for p in paths:
        if p.is_file():
            return str(p)
    return None


def shim_lib():
    """libvmmshim.so's path, or None."""
    return _first("VMMSHIM_SHIM_LIB", NATIVE / "lib" / "libvmmshim.so", SOURCE_BUILD / "libvmmshim.so",
                  *(pathlib.Path(d) / "libvmmshim.so" for d in (sys.prefix + "/lib", "/usr/local/lib", "/usr/lib")))


def client_lib_candidates():
    """The client library's paths in the order to try (the environment's, when set, alone)."""
    named = os.environ.get("VMMSHIM_CLIENT_LIB")
    if named:
        return [named]
    out = [str(p) for p in (NATIVE / "lib" / "libvmmshim-client.so", SOURCE_BUILD / "libvmmshim-client.so")
           if p.is_file()]
    return out + ["libvmmshim-client.so"]


def vmmctl():
    """vmmctl's path, or None."""
    return _first("VMMSHIM_VMMCTL", NATIVE / "bin" / "vmmctl", SOURCE_BUILD / "vmmctl") or shutil.which("vmmctl")


def tms_dir():
    """The directory to put first on PYTHONPATH so that `import torch_memory_saver` finds vmmshim's
    stand-in (vmmshim/_tms), or None."""
    d = PACKAGE_DIR / "_tms"
    return str(d) if (d / "torch_memory_saver" / "__init__.py").is_file() else None


def include_dir():
    """The directory holding vmmshim.h, or None."""
    for d in (NATIVE / "include", PACKAGE_DIR.parents[1] / "include"):
        if (d / "vmmshim.h").is_file():
            return str(d)
    return None


def lib_dir():
    """The directory holding the client library (for -L), or None."""
    for p in client_lib_candidates():
        if os.path.isfile(p):
            return os.path.dirname(os.path.abspath(p))
    return None


def vmmctl_main():
    """The `vmmctl` console script: the bundled binary, run in this process's place."""
    path = vmmctl()
    if not path or os.path.realpath(path) == os.path.realpath(sys.argv[0]):
        sys.stderr.write("vmmctl: error: the vmmctl binary is not installed with this vmmshim package "
                         "(reinstall the wheel, or set VMMSHIM_VMMCTL)\n")
        return 127
    os.execv(path, ["vmmctl"] + sys.argv[1:])
