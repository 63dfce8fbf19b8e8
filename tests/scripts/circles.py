#!/usr/bin/env python3
"""Finds circles of files: .c files under shim/ and tools/ that call back and forth.

Why: a pair of files that call each other shares something that belongs one floor down; such
pairs grow silently, so CI checks for them.  The call graph comes from the built objects (nm), not
from parsing C: file A depends on file B when A's object needs a symbol that B's object defines.
Only the project's own names count (vmm_ and vmm__): the names the shim interposes (dlsym, cu*,
cuda*) are called by their public names through the system's headers, and which library answers
is the dynamic linker's choice, not a file's call into another (--all-symbols counts them too).
Every strongly connected group of more than one file is a circle.

A circle still listed in the allow-list (tests/scripts/circles.allow, one circle a line: its files,
separated by spaces; '#' starts a comment) is known, waits for its own refactor and passes; a
circle that is not listed fails.  An allow-list line no circle needs any more is reported, so it
can be deleted.

Usage: circles.py [--build DIR] [--allow FILE] [-v]   (run from anywhere; make the build first)
Closes with "circles: N passed, N failed" and exits non-zero when a circle is not allowed.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def symbols(obj, everything):
    out = subprocess.run(["nm", obj], check=True, capture_output=True, text=True).stdout
    defined, needed = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if not everything and not parts[-1].startswith("vmm"):
            continue
        if len(parts) == 2 and parts[0] == "U":
            needed.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRVWG" and not parts[1].islower():
            defined.add(parts[2])
    return defined, needed


def sccs(graph):
    """Tarjan's strongly connected components (iterative)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = n; n += 1; stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = n; n += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--allow", default=os.path.join(ROOT, "tests/scripts/circles.allow"))
    ap.add_argument("--all-symbols", action="store_true", help="count the interposed public names too")
    ap.add_argument("-v", action="store_true", help="print every file's edges and their symbols")
    a = ap.parse_args()
    objdir = os.path.join(ROOT, a.build, "obj")
    files = {}
    for top in ("shim", "tools"):
        for d, _, names in os.walk(os.path.join(objdir, top)):
            for name in names:
                if name.endswith(".o"):
                    obj = os.path.join(d, name)
                    files[os.path.relpath(obj, objdir)[:-2] + ".c"] = symbols(obj, a.all_symbols)
    if not files:
        print(f"circles: no objects under {objdir}: build first")
        print("circles: 0 passed, 1 failed")
        return 1
    owner = {}
    for f, (defined, _) in files.items():
        for s in defined:
            owner[s] = f
    graph, why = {f: set() for f in files}, {}
    for f, (_, needed) in files.items():
        for s in needed:
            g = owner.get(s)
            if g and g != f:
                graph[f].add(g)
                why.setdefault((f, g), []).append(s)
    if a.v:
        for f in sorted(graph):
            for g in sorted(graph[f]):
                print(f"{f} -> {g}: {' '.join(sorted(why[(f, g)]))}")
    allowed = []
    if os.path.exists(a.allow):
        with open(a.allow) as fh:
            for line in fh:
                line = line.split("#", 1)[0].split()
                if line:
                    allowed.append(set(line))
    used = [False] * len(allowed)
    passed = failed = 0
    for comp in sccs(graph):
        if len(comp) < 2:
            passed += 1
            continue
        hit = [i for i, s in enumerate(allowed) if set(comp) <= s]
        for i in hit:
            used[i] = True
        print(f"circle{' (allowed)' if hit else ''}: {' '.join(comp)}")
        for f in comp:
            for g in sorted(graph[f] & set(comp)):
                print(f"    {f} -> {g}: {' '.join(sorted(why[(f, g)])[:6])}")
        if hit:
            passed += 1
        else:
            failed += 1
    for i, u in enumerate(used):
        if not u:
            print(f"note: allow-list line no longer needed: {' '.join(sorted(allowed[i]))}")
    print(f"circles: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
