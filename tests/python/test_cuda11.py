"""A program linked against CUDA 11's runtime (libcudart.so.11.0) under the shim, over the emulated
driver: tests/cuda11/cuda11_prog.c built against the emulated runtime as libcudart.so.11.0 (its
soname and version node, build/fakecuda11), so its cudaMalloc is cudaMalloc@libcudart.so.11.0.
Natively it runs; under the shim its allocation is backed, published as cudaMalloc, exportable,
and another process reads its bytes; the shim found the real runtime's functions in
libcudart.so.11.0 (nothing assumes libcudart.so.13).  NVIDIA's own libcudart 11.8 cannot run
over the emulated driver (it resolves ~380 driver entry points through cuGetProcAddress, among
them cuGetExportTable, which the emulation lacks): `make cuda11` builds the program against 11.8
for tests/gpu/cuda11.sh on a GPU.  Ends with "N passed, N failed"."""
import os
import subprocess
import sys

import harness
from harness import BUILD

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()
PROG = BUILD / "progs11" / "cuda11_prog"
FAKE11 = BUILD / "fakecuda11"


def env11(preload):
    env = harness.preload_env() if preload else dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{FAKE11}:{env['LD_LIBRARY_PATH']}"
    return env


def main():
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(PROG)], capture_output=True, text=True).stdout
    T.check("cudaMalloc@libcudart.so.11.0" in syms and "cudaFree@libcudart.so.11.0" in syms,
            "the program needs cudaMalloc and cudaFree of version libcudart.so.11.0")
    native = subprocess.run([str(PROG), "65536"], input="\n", capture_output=True, text=True, env=env11(False),
                            timeout=60)
    T.check(native.returncode == 0 and native.stdout.strip().endswith("ok"), f"natively: {native.stdout}{native.stderr}")
    p = harness.LineProcess([str(PROG), str(4 << 20)], env11(True))
    try:
        first = p.readline(60)
        line = p.readline(60).split()
        if not T.check(first.startswith("runtime ") and line and line[0] == "ready",
                       f"under the shim it allocates and checks its bytes: {first!r} {line!r}"):
            return
        pid, address, size = int(line[1]), int(line[2], 16), int(line[3])
        maps = open(f"/proc/{pid}/maps").read()
        T.check("/libvmmshim.so" in maps and "/fakecuda11/libcudart.so.11.0" in maps,
                "the shim and libcudart.so.11.0 are loaded in it")
        with vmmshim.Registry() as reg:
            try:
                a = reg.find(pid, address)
            except vmmshim.Error as e:
                T.check(False, f"its cudaMalloc is published: {e}")
                return
            T.check(a.api == "cudaMalloc" and a.size == size and a.exportable,
                    f"published as cudaMalloc, {size} bytes, exportable: {a!r} exportable={a.exportable}")
            with reg.open(pid, address) as buf:
                T.check(buf.read(0, 4096) == bytes((i * 7 + 3) & 0xFF for i in range(4096)),
                        "another process reads the bytes it wrote")
        T.check(p.command("") == "ok", "it frees and ends well")
        p.proc.wait(30)
        T.check(p.proc.returncode == 0, f"exit status 0: {p.proc.returncode}")
    finally:
        p.end()
    real = BUILD / "cuda11" / "cuda11_prog"
    if real.exists():
        d = subprocess.run(["readelf", "-d", str(real)], capture_output=True, text=True).stdout
        T.check("[libcudart.so.11.0]" in d and (real.parent / "libcudart.so.11.0").exists(),
                "make cuda11's program (CUDA 11.8 headers) needs libcudart.so.11.0, which lies beside it")
        print("note: build/cuda11/cuda11_prog (NVIDIA's libcudart 11.8) runs on a GPU only: tests/gpu/cuda11.sh")


if __name__ == "__main__":
    try:
        main()
    finally:
        harness.cleanup()
    T.done()
