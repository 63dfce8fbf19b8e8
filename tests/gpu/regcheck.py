"""Checks on a `vmmctl list --json` listing, for matrix.sh, run.sh and ddp.sh.

  regcheck.py cover LIST OUT [--api NAME]
      Every "# param NAME 0xADDR NBYTES" line of OUT (a program's stdout) must lie inside
      exportable records (handle kind "broker") of LIST, of api NAME if given; adjacent records
      count together, so a parameter across two pages is covered by both.  One line per
      parameter, then "covered K of P parameters".  Exit 0 when P > 0 and K == P, else 1.

  regcheck.py prealloc LIST OUT
      JAX's preallocated bytes from the "# memory_stats {json}" line of OUT (pool_bytes when
      present and > 0, else bytes_limit, else bytes_reservable_limit) against the bytes of the
      records in LIST.  Prints one line for the matrix's "published" cell.  Exit 0 when the
      records hold >= 90% of them ("yes: ..."), 3 when they do not or the stats are missing
      ("partial: X of Y bytes ..."), 1 when LIST has no record at all.

  regcheck.py pids LIST --api NAME PID...
      Per PID: its records of api NAME, how many are exportable, their bytes; then one line
      "api NAME: N records, B bytes, E exportable, in K of P processes".  Exit 0 when every PID
      has at least one such record, else 1.

A record spans [address, address + requested_size).  LIST may be empty or unreadable (vmmctl
failed): that reads as no records.
"""
import json
import re
import sys


def load(path):
    try:
        with open(path) as f:
            text = f.read()
        recs = json.loads(text) if text.strip() else []
    except (OSError, ValueError) as e:
        print(f"# regcheck: {path}: {e}", file=sys.stderr)
        return []
    return [r for r in recs if isinstance(r, dict)]


def exportable(r):
    return "broker" in (r.get("handle_kinds") or [])


def size(r):
    return int(r.get("requested_size") or 0)


def mib(n):
    return f"{n / 1048576:.1f} MiB"


def api_summary(recs):
    counts = {}
    for r in recs:
        counts[r.get("api", "?")] = counts.get(r.get("api", "?"), 0) + 1
    return ", ".join(f"{a} x{n}" for a, n in sorted(counts.items()))


def cover(argv):
    api = None
    if "--api" in argv:
        i = argv.index("--api")
        api = argv[i + 1]
        del argv[i:i + 2]
    listing, out = argv
    recs = [r for r in load(listing) if (api is None or r.get("api") == api) and exportable(r)]
    recs.sort(key=lambda r: int(r["address"]))
    # runs of touching records: (start, end, how many records)
    runs = []
    for r in recs:
        a, e = int(r["address"]), int(r["address"]) + size(r)
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], e)
            runs[-1][2] += 1
        else:
            runs.append([a, e, 1])
    params = []
    with open(out, errors="replace") as f:
        for line in f:
            m = re.match(r"# param (\S+) (0x[0-9a-fA-F]+) (\d+)", line)
            if m:
                params.append((m.group(1), int(m.group(2), 16), int(m.group(3))))
    what = f"exportable {api} records" if api else "exportable records"
    ok = 0
    for name, a, n in params:
        hit = [r for r in runs if r[0] <= a and a + n <= r[1]]
        inside = [r for r in recs if int(r["address"]) < a + n and a < int(r["address"]) + size(r)]
        if hit:
            ok += 1
            print(f"param {name} 0x{a:x} {n} B: inside {len(inside)} {what} "
                  f"(0x{inside[0]['address']:x}.., {', '.join(str(size(r)) for r in inside)} B)")
        else:
            print(f"param {name} 0x{a:x} {n} B: NOT inside {what} ({len(inside)} overlap it)")
    print(f"covered {ok} of {len(params)} parameters")
    return 0 if params and ok == len(params) else 1


def prealloc(argv):
    listing, out = argv
    recs = load(listing)
    held = sum(size(r) for r in recs)
    exp_bytes = sum(size(r) for r in recs if exportable(r))
    stats = None
    with open(out, errors="replace") as f:
        for line in f:
            if line.startswith("# memory_stats "):
                try:
                    stats = json.loads(line[len("# memory_stats "):])
                except ValueError:
                    stats = None
    n_exp = sum(1 for r in recs if exportable(r))
    desc = f"{len(recs)} records: {api_summary(recs)}; {n_exp} exportable, holding {exp_bytes} B"
    if not recs:
        print(f"NO (0 records; memory_stats {stats})")
        return 1
    key, want = None, 0
    for k in ("pool_bytes", "bytes_limit", "bytes_reservable_limit"):
        if isinstance(stats, dict) and int(stats.get(k) or 0) > 0:
            key, want = k, int(stats[k])
            break
    if not key:
        print(f"partial: {held} of ? bytes (JAX gave no memory_stats size: {stats}; {desc})")
        return 3
    pct = f"{100.0 * held / want:.1f}%"
    if held * 10 >= want * 9:
        print(f"yes: {len(recs)} ({api_summary(recs)}; {n_exp} exportable; {held} of {want} B = {pct} of {key})")
        return 0
    print(f"partial: {held} of {want} bytes ({pct} of {key}; {desc})")
    return 3


def pids(argv):
    api = None
    if "--api" in argv:
        i = argv.index("--api")
        api = argv[i + 1]
        del argv[i:i + 2]
    listing, want = argv[0], [int(p) for p in argv[1:]]
    recs = load(listing)
    tot_n = tot_b = tot_e = have = 0
    for p in want:
        mine = [r for r in recs if int(r.get("pid", -1)) == p]
        sel = [r for r in mine if api is None or r.get("api") == api]
        b = sum(size(r) for r in sel)
        e = sum(1 for r in sel if exportable(r))
        print(f"pid {p}: {len(sel)} {api or 'any'} records, {e} exportable, {b} B ({mib(b)}); "
              f"all its records: {api_summary(mine) or 'none'}")
        tot_n, tot_b, tot_e = tot_n + len(sel), tot_b + b, tot_e + e
        have += 1 if sel else 0
    print(f"api {api or 'any'}: {tot_n} records, {tot_b} bytes ({mib(tot_b)}), {tot_e} exportable, "
          f"in {have} of {len(want)} processes")
    return 0 if want and have == len(want) else 1


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("cover", "prealloc", "pids"):
        print(__doc__, file=sys.stderr)
        return 2
    return {"cover": cover, "prealloc": prealloc, "pids": pids}[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
