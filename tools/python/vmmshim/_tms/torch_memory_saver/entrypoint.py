"""TorchMemorySaver, as torch_memory_saver's entrypoint.py has it, over vmmshim (vmmshim/_saver.py)."""
import ctypes
import os
import sys
from collections import defaultdict
from contextlib import contextmanager
from typing import Literal, Optional

from vmmshim import _saver, _sleep, _sleep_torch
from vmmshim._errors import NotUnderShim

_TAG_DEFAULT = _saver.TAG_DEFAULT
CpuBackupBackend = Literal["mmap", "pinned"]
_warned = set()


def _warn_once(key, text):
    if key not in _warned:
        _warned.add(key)
        sys.stderr.write(f"vmmshim: warning: {text}\n")


class TorchMemorySaver:
    def __init__(self):
        self._impl_ctor_kwargs = {}
        self._impl = None

    @contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """Allocations of this thread inside are paused and resumed under tag: their contents kept in
        host memory (enable_cpu_backup), in a file (enable_disk_backup), or discarded."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise AssertionError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        self._ensure_initialized()
        with self._impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup, enable_disk_backup=enable_disk_backup,
                               cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag: str = _TAG_DEFAULT,
                   enable_cpu_backup: bool = False, cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """torch.cuda.graph, with the graph's memory pausable under tag."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        self._ensure_initialized()
        with self._impl.cuda_graph(cuda_graph=cuda_graph, pool=pool, stream=stream,
                                   capture_error_mode=capture_error_mode, tag=tag,
                                   enable_cpu_backup=enable_cpu_backup, cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def disable(self):
        self._ensure_initialized()
        with self._impl.disable():
            yield

    def pause(self, tag: Optional[str] = None):
        """Pause the memory of tag (None: of every tag)."""
        self._ensure_initialized()
        _saver.pause(tag)

    def resume(self, tag: Optional[str] = None):
        """Resume the memory of tag (None: of every tag)."""
        self._ensure_initialized()
        _saver.resume(tag)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        """Accepted for compatibility: "preload" and "torch" both allocate through the shim."""
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {hook_mode!r}")
        assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        """New device memory that would leave less than value bytes free fails as out-of-memory (the
        shim's vmm_set_alloc_margin: every allocation through its pools, not only a region's)."""
        self._ensure_initialized()
        _saver.set_margin(int(value))

    @property
    def retain_cpu_backup(self) -> bool:
        return _saver.settings["retain"]

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        _saver.settings["retain"] = bool(value)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """x's contents in its host backup (paused, or retained after a resume) as a CPU tensor, or
        None.  zero_copy: a view of the backup itself, valid until the resume that lets it go."""
        self._ensure_initialized()
        return self._impl.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        """Where disk backups go.  The shim reads VMMSHIM_PAUSE_DIR when the process starts: this
        process keeps that one (one unlinked file per pause there), children started after use path."""
        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        _saver.settings["disk_dir"] = path
        if os.path.realpath(os.environ.get("VMMSHIM_PAUSE_DIR", "/tmp")) != os.path.realpath(path):
            _warn_once("disk", f"torch_memory_saver: disk backups of this process go to VMMSHIM_PAUSE_DIR "
                       f"({os.environ.get('VMMSHIM_PAUSE_DIR') or os.environ.get('TMPDIR') or '/tmp'}), read at its "
                       f"start; {path} serves the processes it starts from now")
        os.environ["VMMSHIM_PAUSE_DIR"] = os.path.abspath(path)

    def _validate_cpu_backup_backend(self, enable_cpu_backup, cpu_backup_backend):
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in _saver.BACKENDS:
            raise ValueError(f"cpu_backup_backend must be one of {_saver.BACKENDS}, not {cpu_backup_backend!r}")

    def _ensure_initialized(self):
        if self._impl is not None:
            return
        self._impl = _TorchMemorySaverImpl(**self._impl_ctor_kwargs)
        del self._impl_ctor_kwargs


# TMS's C names of the thread config's fields: (the stand-in's Config attribute, passed as bytes)
_CONFIG_FIELDS = {"current_tag": ("tag", True), "interesting_region": ("interesting", False),
                  "enable_cpu_backup": ("cpu_backup", False), "cpu_backup_backend": ("backend", True),
                  "enable_disk_backup": ("disk", False)}


class _Cdll:
    """The calls TMS's C library offers (its tests make them): tms_get_<field> / tms_set_<field> of
    the thread config, pause, resume and the settings, over the stand-in; any other name is the
    process's CUDA runtime symbol."""

    def tms_pause(self, tag):
        _saver.pause(tag.decode() if tag else None)
        return 0

    def tms_resume(self, tag):
        _saver.resume(tag.decode() if tag else None)
        return 0

    def tms_get_retain_cpu_backup(self):
        return _saver.settings["retain"]

    def tms_set_retain_cpu_backup(self, on):
        _saver.settings["retain"] = bool(on)

    def set_memory_margin_bytes(self, value):
        _saver.set_margin(int(value))

    def __getattr__(self, name):
        verb, _, field = name[len("tms_"):].partition("_") if name.startswith("tms_") else ("", "", "")
        if verb in ("get", "set") and field in _CONFIG_FIELDS:
            attr, text = _CONFIG_FIELDS[field]
            if verb == "get":
                return lambda: getattr(_saver.config(), attr).encode() if text else getattr(_saver.config(), attr)
            return lambda value: _saver.set_config(**{attr: value.decode() if text else bool(value)})
        for lib in _runtime_libraries():
            try:
                return getattr(lib, name)
            except AttributeError:
                continue
        raise AttributeError(name)


def _runtime_libraries():
    yield ctypes.CDLL(None)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        paths = set()
    for p in sorted(paths):
        yield ctypes.CDLL(p)


class _BinaryWrapper:
    def __init__(self):
        self.cdll = _Cdll()

    def set_config(self, *, tag, interesting_region, enable_cpu_backup, cpu_backup_backend=None,
                   enable_disk_backup=False):
        _saver.set_config(tag=tag, interesting=bool(interesting_region), cpu_backup=bool(enable_cpu_backup),
                          backend=cpu_backup_backend, disk=bool(enable_disk_backup))


class _TorchMemorySaverImpl:
    def __init__(self, hook_mode="preload"):
        import torch
        self._hook_mode = hook_mode
        try:
            _sleep._functions()
        except NotUnderShim:
            raise NotUnderShim("vmmshim: error: torch_memory_saver: this process does not run under the shim: start "
                               "it with `vmmshim run --torch-memory-saver --`, or inside configure_subprocess()",
                               12) from None
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.replace(" ", "").lower() and os.environ.get("VMMSHIM_SLEEP_ADOPTED") != "1":
            _warn_once("adopted", "torch_memory_saver: expandable_segments without VMMSHIM_SLEEP_ADOPTED=1: region "
                       "memory stays on the device through a pause (vmmshim run --torch-memory-saver sets it)")
        self._binary_wrapper = _BinaryWrapper()
        self._mem_pools = defaultdict(lambda: torch.cuda.MemPool())
        self._torch = torch

    @contextmanager
    def region(self, tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        torch = self._torch
        backend = (cpu_backup_backend or _saver.config().backend) if enable_cpu_backup else ""
        # TMS's key: a fresh PyTorch pool per tag, mode and device, so that cached blocks of other
        # memory are never handed out inside (a MemPool belongs to its device)
        key = (tag, enable_cpu_backup, enable_disk_backup, backend, torch.cuda.current_device())
        with torch.cuda.use_mem_pool(self._mem_pools[key]):
            _sleep_torch.route_behind()
            with self._with_region_config(tag=tag, enable_cpu_backup=enable_cpu_backup,
                                          cpu_backup_backend=cpu_backup_backend, enable_disk_backup=enable_disk_backup):
                yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup, cpu_backup_backend):
        with self._torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self._with_region_config(tag=tag, enable_cpu_backup=enable_cpu_backup,
                                          cpu_backup_backend=cpu_backup_backend):
                yield

    @contextmanager
    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup=False):
        was = _saver.config()
        _saver.set_config(tag=tag, interesting=True, cpu_backup=bool(enable_cpu_backup),
                          backend=cpu_backup_backend or was.backend, disk=bool(enable_disk_backup))
        try:
            yield
        finally:
            _saver.set_config(tag=was.tag, interesting=was.interesting, cpu_backup=was.cpu_backup,
                              backend=was.backend, disk=was.disk)

    @contextmanager
    def disable(self, dispose_mem_pool_after_use=True):
        assert dispose_mem_pool_after_use, "Only dispose_mem_pool_after_use=true is supported now"
        assert _saver.config().interesting, "disable() should be called only when tms is active"
        torch = self._torch
        _saver.set_config(interesting=False)
        try:
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                _sleep_torch.route_behind()
                yield
            with _sleep_torch.stepped_aside():  # its cache is emptied: PyTorch refuses that while routed
                del pool
            # and its memory is the device's at once, not held for quick reuse: TMS's disable() leaves
            # nothing behind, which its users measure (training_engine: NVML back to the pause's)
            _sleep.give_back()
        finally:
            _saver.set_config(interesting=True)

    def get_cpu_backup(self, x, zero_copy=False):
        torch = self._torch
        assert x.is_cuda, f"{x.device=}"
        assert x.is_contiguous(), f"{x.shape=} {x.stride()=} {x.dtype=}"
        n = x.nbytes
        if n == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        if zero_copy:
            host = _saver.host_copy(x.data_ptr(), n)
            if host is None:
                return None
            flat = torch.frombuffer((ctypes.c_uint8 * n).from_address(host), dtype=torch.uint8)
        else:
            data = _saver.read_host_copy(x.data_ptr(), n)
            if data is None:
                return None
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(x.dtype).view(x.shape)
