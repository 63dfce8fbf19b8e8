#!/usr/bin/env python3
"""make wheel: one platform wheel, vmmshim-<version>-py3-none-<platform>.whl, built offline with the
standard library (zipfile and a RECORD; no setuptools or wheel package), byte for byte the same for
the same inputs.  It holds no Python extension module, so one wheel serves every CPython 3.8+:

    vmmshim/                    the Python package (tools/python/vmmshim)
    vmmshim/_native/lib/        libvmmshim.so (RPATH $ORIGIN) with libunwind.so.8 (RUNPATH $ORIGIN,
                                set with patchelf) and what that links (ldd: liblzma.so.5) beside
                                it, libvmmshim-client.so
    vmmshim/_native/bin/vmmctl  run through the `vmmctl` console script
    vmmshim/_native/include/    vmmshim.h and every local header it includes
    vmmshim/_native/share/      vmmshim.conf, every option at its default

Console scripts: `vmmshim` (python -m vmmshim: list, run, doctor, path) and `vmmctl`.  The platform
tag is manylinux_2_<N>_<arch> where glibc 2.<N> is the newest symbol version any bundled file needs
(objdump -T).  Refused: a shim or client library that links libcuda or libcudart (the driver and
runtime are the machine's, found at run time, whatever CUDA major they are), a shim without $ORIGIN
in its RPATH.

    python3 tools/python/build_wheel.py --build build --out build/dist
"""
import argparse
import base64
import hashlib
import io
import os
import pathlib
import platform
import re
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tools" / "python" / "vmmshim"
HEADER = ROOT / "tools" / "include" / "vmmshim.h"
INCLUDE_DIRS = [ROOT / "tools" / "include", ROOT / "shim"]  # the build's -I order (Makefile CPPFLAGS)
CONFIG = ROOT / "config" / "vmmshim.conf"
# what every glibc system has: never bundled
SYSTEM_LIBS = re.compile(r"^(linux-vdso|linux-gate|ld-linux[-\w.]*|libc|libm|libdl|libpthread|librt)\.so")
# 1980-01-01, zip's earliest, unless SOURCE_DATE_EPOCH says otherwise: the same bytes every build
EPOCH = (1980, 1, 1, 0, 0, 0)


def die(msg):
    sys.exit(f"build_wheel: error: {msg}")


def version():
    text = (PACKAGE / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if not m:
        die("no __version__ in vmmshim/__init__.py")
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    if f'version = "{m.group(1)}"' not in pyproject:
        die(f"vmmshim.__version__ {m.group(1)} is not pyproject.toml's version")
    return m.group(1)


def run(*argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        die(f"{argv[0]} is missing (make wheel installs it as root; else: sudo apt-get install -y {argv[0]})")
    if r.returncode != 0:
        die(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def dynamic(path):
    """(NEEDED names, RPATH/RUNPATH entries) of an ELF file (readelf -d)."""
    needed, rpath = [], []
    for line in run("readelf", "-d", str(path)).splitlines():
        m = re.search(r"\((NEEDED|RPATH|RUNPATH)\).*\[(.*)\]", line)
        if m and m.group(1) == "NEEDED":
            needed.append(m.group(2))
        elif m:
            rpath += [f"{m.group(1)} {p}" for p in m.group(2).split(":")]
    return needed, rpath


def glibc_needed(path):
    """The newest GLIBC_2.N symbol version the file needs, as (2, N) (objdump -T)."""
    best = (2, 0)
    for m in re.finditer(r"GLIBC_(\d+)\.(\d+)", run("objdump", "-T", str(path))):
        best = max(best, (int(m.group(1)), int(m.group(2))))
    return best


def ldd_deps(path):
    """{soname: real path} of what the file links, glibc's own libraries left out (ldd)."""
    deps = {}
    for line in run("ldd", str(path)).splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m and not SYSTEM_LIBS.match(m.group(1)):
            if m.group(2) == "not":
                die(f"{path} links {m.group(1)}, which ldd does not find")
            deps[m.group(1)] = pathlib.Path(m.group(2)).resolve()
    return deps


def headers(build):
    """{name inside include/: file}: the build's installed header (make writes build/include/vmmshim.h
    whole, with shim/api/vmm_api.h inside it), else vmmshim.h and every header it includes with
    "...", found as the build finds them (beside the including file, then tools/include, then
    shim), each under the name the #include gives."""
    whole = build / "include" / "vmmshim.h"
    if whole.is_file():
        if re.search(r'^\s*#\s*include\s+"', whole.read_text(), re.M):
            die(f"{whole} includes a local header: it should be the whole public header (make)")
        return {"vmmshim.h": whole}
    found, todo = {"vmmshim.h": HEADER}, [HEADER]
    while todo:
        f = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), re.M):
            if name in found:
                continue
            for d in [f.parent] + INCLUDE_DIRS:
                if (d / name).is_file():
                    found[name] = d / name
                    todo.append(d / name)
                    break
            else:
                die(f'{f}: #include "{name}" not found')
    return found


def patched_unwind(unwind, out):
    """libunwind.so.8's bytes with RUNPATH $ORIGIN (patchelf, as auditwheel does): the shim opens it by
    path, and a dlopen'ed library's own dependencies (liblzma.so.5) are searched by its own RUNPATH,
    never by the RPATH of the library that opened it."""
    tmp = out / ".libunwind.so.8"
    tmp.write_bytes(unwind.read_bytes())
    try:
        run("patchelf", "--set-rpath", "$ORIGIN", str(tmp))
        return tmp.read_bytes()
    finally:
        tmp.unlink()


def urlsafe_sha256(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build", help="the build directory (make's BUILD)")
    ap.add_argument("--out", default=None, help="where the wheel goes (default: BUILD/dist)")
    args = ap.parse_args()
    build = (ROOT / args.build).resolve() if not os.path.isabs(args.build) else pathlib.Path(args.build)
    out = pathlib.Path(args.out).resolve() if args.out else build / "dist"
    ver = version()

    shim, client, vmmctl = build / "libvmmshim.so", build / "libvmmshim-client.so", build / "vmmctl"
    unwind = build / "libunwind.so.8"
    for f in (shim, client, vmmctl, unwind):
        if not f.is_file():
            die(f"{f} is missing: run make first")
    for f in (shim, client, vmmctl):
        needed, rpath = dynamic(f)
        cuda = [n for n in needed if re.match(r"lib(cuda|cudart)\.so", n)]
        if cuda:
            die(f"{f.name} links {', '.join(cuda)}: the driver and runtime must be found at run time")
        san = [n for n in needed if re.match(r"lib(asan|tsan|ubsan|hwasan|msan)\.so", n)]
        if san:
            die(f"{f.name} links {', '.join(san)}: a sanitizer build; make the wheel from the plain build")
    if "RPATH $ORIGIN" not in dynamic(shim)[1]:
        die(f"{shim} has no RPATH $ORIGIN (readelf -d): rebuild it with this Makefile")

    out.mkdir(parents=True, exist_ok=True)
    native = "vmmshim/_native/"
    files = {}  # name in the wheel -> (bytes, executable)
    files[native + "lib/libvmmshim.so"] = (shim.read_bytes(), True)
    files[native + "lib/libvmmshim-client.so"] = (client.read_bytes(), True)
    files[native + "lib/libunwind.so.8"] = (patched_unwind(unwind, out), True)
    for soname, real in sorted(ldd_deps(unwind).items()):
        files[native + "lib/" + soname] = (real.read_bytes(), True)
    files[native + "bin/vmmctl"] = (vmmctl.read_bytes(), True)
    for name, f in sorted(headers(build).items()):
        files[native + "include/" + name] = (f.read_bytes(), False)
    files[native + "share/vmmshim.conf"] = (CONFIG.read_bytes(), False)
    for f in sorted(PACKAGE.rglob("*.py")):
        files["vmmshim/" + f.relative_to(PACKAGE).as_posix()] = (f.read_bytes(), False)

    # the platform: the newest glibc any bundled ELF file needs
    elves = [n for n, (data, _) in files.items() if data[:4] == b"\x7fELF"]
    tmp = out / ".glibc-probe"
    need, by = (2, 17), "-"
    for n in elves:
        tmp.write_bytes(files[n][0])
        g = glibc_needed(tmp)
        if g > need:
            need, by = g, n.rsplit("/", 1)[1]
    tmp.unlink()
    arch = platform.machine()
    plat = f"manylinux_{need[0]}_{need[1]}_{arch}"
    tag = f"py3-none-{plat}"

    dist = f"vmmshim-{ver}.dist-info/"
    readme = (PACKAGE.parent / "README.md").read_text()
    meta = (f"Metadata-Version: 2.1\nName: vmmshim\nVersion: {ver}\n"
            "Summary: vmmshim: CUDA allocations backed by exportable VMM memory (LD_PRELOAD shim), its registry "
            "tools (vmmctl) and the Python companion\n"
            "Requires-Python: >=3.8\nDescription-Content-Type: text/markdown\n\n" + readme)
    files[dist + "METADATA"] = (meta.encode(), False)
    files[dist + "WHEEL"] = (("Wheel-Version: 1.0\nGenerator: vmmshim build_wheel.py\nRoot-Is-Purelib: false\n"
                              f"Tag: {tag}\n").encode(), False)
    files[dist + "entry_points.txt"] = (b"[console_scripts]\nvmmctl = vmmshim._paths:vmmctl_main\n"
                                        b"vmmshim = vmmshim.__main__:entry\n", False)
    files[dist + "top_level.txt"] = (b"vmmshim\n", False)

    record = io.StringIO()
    for name in sorted(files):
        data = files[name][0]
        record.write(f"{name},{urlsafe_sha256(data)},{len(data)}\n")
    record.write(f"{dist}RECORD,,\n")
    files[dist + "RECORD"] = (record.getvalue().encode(), False)

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = EPOCH
    if epoch:
        import time
        when = max(EPOCH, time.gmtime(int(epoch))[:6])
    wheel = out / f"vmmshim-{ver}-{tag}.whl"
    for old in out.glob("vmmshim-*.whl"):
        old.unlink()
    # the dist-info last, RECORD last of all (what pip and the spec recommend)
    order = sorted((n for n in files if not n.startswith(dist))) + sorted(n for n in files if n.startswith(dist)
                                                                            and n != dist + "RECORD")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name in order + [dist + "RECORD"]:
            data, exe = files[name]
            zi = zipfile.ZipInfo(name, when)
            zi.external_attr = (0o100755 if exe else 0o100644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.create_system = 3
            z.writestr(zi, data)
    shown = wheel.relative_to(ROOT) if str(wheel).startswith(str(ROOT) + "/") else wheel
    print(f"wheel: {shown} "
          f"({wheel.stat().st_size // 1024} KiB; glibc {need[0]}.{need[1]} needed, by {by})")


if __name__ == "__main__":
    main()
