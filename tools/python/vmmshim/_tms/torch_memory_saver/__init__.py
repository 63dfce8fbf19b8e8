"""vmmshim's stand-in for torch_memory_saver: the same API, backed by libvmmshim.so (vmmshim/_saver.py
says how TMS's terms map onto the shim's, tools/python/README.md what differs).  On the path only
when asked for: `vmmshim run --torch-memory-saver -- CMD`, or PYTHONPATH=$(vmmshim path tms)."""
try:
    import vmmshim  # noqa: F401
except ImportError:  # run from a source tree whose tools/python is not on the path
    import os as _os
    import sys as _sys
    _sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))))
    import vmmshim  # noqa: F401

from vmmshim import _saver as _s

if _s.foreign_hook():
    raise ImportError(f"vmmshim: error: torch_memory_saver: the real torch_memory_saver's hook ({_s.foreign_hook()}) "
                      "is loaded too, and only one library may own the allocations: drop it from LD_PRELOAD, or run "
                      "without vmmshim's stand-in")

from .entrypoint import TorchMemorySaver  # noqa: E402
from .hooks.mode_preload import configure_subprocess  # noqa: E402

torch_memory_saver = TorchMemorySaver()
_s.hand_in_c_entries()  # the shim's tms_pause and tms_resume pause what this module would
BACKEND = "vmmshim"
