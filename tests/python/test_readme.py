"""The README's companions, run exactly as they appear there: the C one (after
`<!-- companion-c -->`, a 5-line body) compiled against tools/include and the build's client
library, the Python one (after `<!-- companion-python -->`, 3 lines) run with the package; both
against a live owner over the emulated driver, both printing the allocation's first 16 bytes.
Ends with "N passed, N failed"."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import harness
from harness import BUILD, PACKAGE, ROOT, Owner, pattern

harness.setup()
T = harness.Tally()


def snippet(readme, marker, lang):
    blocks = re.findall(r"<!-- %s -->\n```%s\n(.*?)```\n" % (marker, lang), readme, re.S)
    T.check(len(blocks) == 1, f"README.md has {len(blocks)} ```{lang} blocks after <!-- {marker} -->, not 1")
    return blocks[0] if blocks else ""


def main():
    readme = (ROOT / "README.md").read_text()
    c_src, py_src = snippet(readme, "companion-c", "c"), snippet(readme, "companion-python", "python")
    body = re.search(r"\bmain\([^)]*\)\s*\{[^\n]*\n(.*)\n\}\s*$", c_src, re.S)
    T.check(body and len(body.group(1).splitlines()) == 5, f"the C companion's body is not 5 lines:\n{c_src}")
    T.check(len(py_src.splitlines()) == 3, f"the Python companion is not 3 lines:\n{py_src}")
    tmp = tempfile.mkdtemp(prefix="vmmshim-readme-")
    own = None
    try:
        with open(os.path.join(tmp, "companion.c"), "w") as f:
            f.write(c_src)
        with open(os.path.join(tmp, "companion.py"), "w") as f:
            f.write(py_src)
        exe = os.path.join(tmp, "companion")
        cc = subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Werror", f"-I{ROOT / 'tools' / 'include'}",
                             os.path.join(tmp, "companion.c"), "-o", exe, f"-L{BUILD}", "-lvmmshim-client",
                             f"-Wl,-rpath,{BUILD}"], capture_output=True, text=True)
        T.check(cc.returncode == 0, f"the C companion does not build: {cc.stderr[-800:]}")
        own = Owner("1", "0.25a")
        for i, (address, _, _) in enumerate(own.buffers):
            want = pattern(i, 0, 16).hex() + "\n"
            args = [str(own.pid), hex(address)]
            c_out = subprocess.run([exe, *args], capture_output=True, text=True) if cc.returncode == 0 else None
            py_out = subprocess.run([sys.executable, os.path.join(tmp, "companion.py"), *args], capture_output=True,
                                    text=True, env=dict(os.environ, PYTHONPATH=str(PACKAGE)))
            T.check(c_out is not None and c_out.returncode == 0 and c_out.stdout == want,
                    f"the C companion on buffer {i}: {c_out and (c_out.returncode, c_out.stdout, c_out.stderr)}, "
                    f"want {want!r}")
            T.check(py_out.returncode == 0 and py_out.stdout == want,
                    f"the Python companion on buffer {i}: {py_out.returncode} {py_out.stdout!r} {py_out.stderr[-300:]}")
        # a bad address: the C one prints vmm_last_error()'s line, the Python one raises NotFound
        bad = [str(own.pid), "0x10"]
        if cc.returncode == 0:
            c_bad = subprocess.run([exe, *bad], capture_output=True, text=True)
            T.check(c_bad.returncode == 1 and c_bad.stdout == "" and "no live allocation" in c_bad.stderr and
                    c_bad.stderr.count("\n") == 1, f"the C companion on a bad address: {c_bad.stderr!r}")
        py_bad = subprocess.run([sys.executable, os.path.join(tmp, "companion.py"), *bad], capture_output=True,
                                text=True, env=dict(os.environ, PYTHONPATH=str(PACKAGE)))
        T.check(py_bad.returncode == 1 and "vmmshim.NotFound: " in py_bad.stderr and
                "no live allocation" in py_bad.stderr, f"the Python companion on a bad address: {py_bad.stderr[-300:]}")
    finally:
        if own:
            own.end()
        shutil.rmtree(tmp, ignore_errors=True)
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
