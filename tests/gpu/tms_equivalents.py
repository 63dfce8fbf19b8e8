"""The checks of torch_memory_saver's suite that test its internals, done through the stand-in's public
API instead (tests/gpu/tms.sh suite runs it under `vmmshim run --torch-memory-saver`):
  granularity   cuda_vmm_granularity.py calls TMS's C entry points tms_pause/tms_resume, which the
                stand-in does not export; the same behaviour through torch_memory_saver.pause/resume
                under TMS_INIT_ENABLE=1: a 6912-byte cudaMalloc (not 2 MiB-aligned) round-trips a byte
                after a cycle, and one freed while paused leaves the other intact;
  disk          disk_backup.py counts one file per allocation in set_disk_backup_dir's directory; the
                shim keeps a pause in one unlinked file in VMMSHIM_PAUSE_DIR: three cycles restore
                13.4 MB of fp32 bit-exact, the file (found among the process's fds) holds at least the
                tensor's bytes, the same number each cycle, and is gone after the resume.
Prints "PASS/FAIL equivalent NAME: ..." and "equivalents: N passed, N failed"."""
import ctypes
import os
import sys
import tempfile

import torch

os.environ["TMS_INIT_ENABLE"] = "1"  # read by the stand-in at each thread's first config
# where the shim keeps a file pause: read at its start (set_disk_backup_dir changes it for children only)
PAUSE_DIR = os.path.realpath(os.environ.get("VMMSHIM_PAUSE_DIR") or os.environ.get("TMPDIR") or "/tmp")
from torch_memory_saver import torch_memory_saver as saver  # noqa: E402

passed = failed = 0


def check(ok, what):
    global passed, failed
    passed, failed = passed + bool(ok), failed + (not ok)
    print(f"{'PASS' if ok else 'FAIL'} equivalent {what}", flush=True)


def granularity():
    rt = ctypes.CDLL(None)
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rt.cudaFree.argtypes = [ctypes.c_void_p]

    def round_trip(p, v):
        w, r = ctypes.c_ubyte(v), ctypes.c_ubyte()
        return (rt.cudaMemcpy(p, ctypes.byref(w), 1, 1) == 0 and rt.cudaMemcpy(ctypes.byref(r), p, 1, 2) == 0
                and r.value == v)

    torch.cuda.init()
    p = ctypes.c_void_p()
    ok = rt.cudaMalloc(ctypes.byref(p), 6912) == 0 and round_trip(p, 0xA5)
    saver.pause()
    saver.resume()
    ok = ok and round_trip(p, 0x5A) and rt.cudaFree(p) == 0
    gone, keep = ctypes.c_void_p(), ctypes.c_void_p()
    ok2 = rt.cudaMalloc(ctypes.byref(gone), 6912) == 0 and rt.cudaMalloc(ctypes.byref(keep), 6912) == 0
    ok2 = ok2 and round_trip(keep, 0xA5)
    saver.pause()
    ok2 = ok2 and rt.cudaFree(gone) == 0
    saver.resume()
    ok2 = ok2 and round_trip(keep, 0x5A) and rt.cudaFree(keep) == 0
    check(ok and ok2, f"granularity: a 6912-byte cudaMalloc through a cycle {ok}, one freed while paused {ok2}")


def pause_files():
    """(path, size) of each deleted file this process holds open in the pause directory."""
    d, out = PAUSE_DIR, []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and os.path.dirname(target[:-10]) == d:
            out.append((target, os.fstat(int(fd)).st_blocks * 512))
    return out


def disk():
    saver.set_disk_backup_dir(tempfile.mkdtemp(prefix="tms_disk_"))  # says where this process's go instead
    numel = (1 << 20) * 13 // 4 + 12345
    with saver.region(tag="disk", enable_disk_backup=True):
        big = torch.randn((numel,), dtype=torch.float32, device="cuda")
    oracle = big.cpu().clone()
    sizes, exact = set(), True
    for _ in range(3):
        saver.pause("disk")
        files = pause_files()
        sizes.add(sum(s for _, s in files))
        big_bytes_on_disk = sum(s for _, s in files) >= big.numel() * 4
        saver.resume("disk")
        exact = exact and torch.equal(big.cpu(), oracle) and big_bytes_on_disk
    check(exact and len(sizes) == 1 and not pause_files(),
          f"disk: 3 cycles bit-exact with the tensor's bytes on disk {exact}, the same disk use each cycle {sorted(sizes)}, "
          f"no file left after resume {not pause_files()}")


if __name__ == "__main__":
    granularity()
    disk()
    print(f"equivalents: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
