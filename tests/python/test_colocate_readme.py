"""The README's colocated RL loop (use 4, after `<!-- use-colocate -->`) against the script that runs
it on a GPU: every line of the block, leading and trailing spaces aside, must stand within one line of
tests/gpu/colocate.py, and in the block's order, so the README cannot drift from what
`tests/gpu/colocate.sh` runs; the block shows the loop's six steps.  The command after
`<!-- use-colocate-run -->` must be tests/gpu/colocate.sh, executable, and `make test-gpu`
(tests/gpu/run.sh) must run it.  colocate.py must compile.  Reads files only: no build, no GPU, no
torch.  Ends with "N passed, N failed"."""
import os
import re

import harness
from harness import ROOT

T = harness.Tally()
SCRIPT = ROOT / "tests" / "gpu" / "colocate.py"


def snippet(readme, marker, lang):
    blocks = re.findall(r"<!-- %s -->\n```%s\n(.*?)```\n" % (marker, lang), readme, re.S)
    T.check(len(blocks) == 1, f"README.md has {len(blocks)} ```{lang} blocks after <!-- {marker} -->, not 1")
    return blocks[0] if blocks else ""


def placed(lines, code):
    """For each line, the index of the first code line at or after the previous one's that holds it
    (None where there is none: the rest are searched from where the last one was found)."""
    out, at = [], 0
    for line in lines:
        found = next((i for i in range(at, len(code)) if line in code[i]), None)
        out.append(found)
        if found is not None:
            at = found + 1
    return out


def main():
    readme = (ROOT / "README.md").read_text()
    source = SCRIPT.read_text()
    code = [line.strip() for line in source.splitlines()]
    block = snippet(readme, "use-colocate", "python")
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    T.check(8 <= len(lines) <= 20, f"the README's loop has {len(lines)} lines, not 8 to 20")
    missing = [line for line in lines if not any(line in c for c in code)]
    T.check(not missing, f"README lines that are no line of tests/gpu/colocate.py: {missing}")
    where = placed(lines, code)
    astray = [line for line, i in zip(lines, where) if i is None and line not in missing]
    T.check(not astray, f"README lines out of colocate.py's order (after the line before them there): {astray}")
    steps = [n for n in range(1, 7) if any(f"# {n}." in line for line in lines)]
    T.check(steps == list(range(1, 7)), f"the README's loop shows steps {steps}, not 1 to 6")
    for call in ('vmmshim.pause("optim")', 'vmmshim.resume("optim")', 'vmmshim.resume("kv")',
                 'vmmshim.pause("kv", keep=False)', "open_torch(", "vmmshim.region("):
        T.check(any(call in line for line in lines), f"the README's loop lacks {call}")
    # the checker itself: a line changed by one character is found nowhere
    if lines:
        T.check(not any(lines[1] + "x" in c for c in code) and not any(lines[1].replace("(", "[", 1) in c for c in code),
                f"a changed line still matches: {lines[1]!r}")
    try:
        compile(source, str(SCRIPT), "exec")
        error = None
    except SyntaxError as e:
        error = e
    T.check(error is None, f"tests/gpu/colocate.py does not compile: {error}")

    run = [line for line in snippet(readme, "use-colocate-run", "sh").splitlines() if line.strip()]
    T.check(len(run) == 1 and run[0].split()[0] == "tests/gpu/colocate.sh",
            f"the README's command is not one line running tests/gpu/colocate.sh: {run}")
    sh = ROOT / "tests" / "gpu" / "colocate.sh"
    T.check(sh.is_file() and os.access(sh, os.X_OK), "tests/gpu/colocate.sh is missing or not executable")
    gpu = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    T.check(any("tests/gpu/colocate.sh" in line and not line.lstrip().startswith("#") for line in gpu.splitlines()),
            "tests/gpu/run.sh (make test-gpu) does not run tests/gpu/colocate.sh")
    T.done()


if __name__ == "__main__":
    main()
