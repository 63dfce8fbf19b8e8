"""The table of tests/gpu/tms.sh's bench: every tms_bench.py process's "R ..." lines, by setting
(tms, standin, standin-expandable), and the targets of issue 39:
  pause and resume time, standin / tms <= 1.0 (medians over every round of every process);
  NVML once every tag sleeps, standin <= tms, and <= tms after its empty_cache();
  losses and tokens bit-exact in every process, and the same digest in all of them.
  python3 tests/gpu/tms_table.py DIR      (DIR: the .out/.rc files)
Prints the table, a PASS or FAIL line per target, "tms: N passed, N failed"; exit 1 on a failure."""
import glob
import os
import statistics
import sys

SETTINGS = ("tms", "standin", "standin-expandable")
GiB = 1 << 30


def parse(path):
    rows = []
    for line in open(path, errors="replace"):
        if not line.startswith("R "):
            continue
        kind, *fields = line.split()[1:]
        rows.append((kind, dict(f.split("=", 1) for f in fields if "=" in f)))
    return rows


def main(d):
    data = {s: {"cycles": [], "exact": [], "rc": []} for s in SETTINGS}
    for out in sorted(glob.glob(os.path.join(d, "*-o*.out"))):
        name = os.path.basename(out)[:-4]
        setting = name.rsplit("-o", 1)[0]
        if setting not in data:
            continue
        rc_path = out[:-4] + ".rc"
        data[setting]["rc"].append(int(open(rc_path).read().strip() or 1) if os.path.exists(rc_path) else 1)
        for kind, f in parse(out):
            if kind == "cycle":
                data[setting]["cycles"].append({k: float(v) for k, v in f.items() if v not in ("None",)})
            elif kind == "exact":
                data[setting]["exact"].append(f)
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        passed, failed = passed + bool(ok), failed + (not ok)
        print(f"{'PASS' if ok else 'FAIL'} {what}")

    def med(s, key):
        xs = [c[key] for c in data[s]["cycles"] if key in c]
        return (statistics.median(xs), min(xs), max(xs), len(xs)) if xs else None

    print("| setting | processes (rc) | pause s, median [min-max] | resume s | NVML before GiB | "
          "NVML all paused | after empty_cache | resumed |")
    print("|---|---|---|---|---|---|---|---|")
    for s in SETTINGS:
        cells = []
        for key in ("pause_s", "resume_s"):
            m = med(s, key)
            cells.append(f"{m[0]:.3f} [{m[1]:.3f}-{m[2]:.3f}]" if m else "-")
        for key in ("nvml_before", "nvml_paused", "nvml_emptied", "nvml_resumed"):
            m = med(s, key)
            cells.append(f"{m[0] / GiB:.2f}" if m else "-")
        print(f"| {s} | {len(data[s]['rc'])} ({','.join(map(str, data[s]['rc']))}) | " + " | ".join(cells) + " |")
    tms = data["tms"]["cycles"]
    for s in ("standin", "standin-expandable"):
        check(data[s]["rc"] and all(r == 0 for r in data[s]["rc"]) and data[s]["exact"] and
              all(e.get("losses") == "1" and e.get("tokens") == "1" for e in data[s]["exact"]),
              f"{s}: every process exits 0 with losses and tokens bit-exact against its reference "
              f"({[(e.get('losses'), e.get('tokens')) for e in data[s]['exact']]})")
        if not tms:
            print(f"SKIP {s} against tms: no tms rounds")
            continue
        for key in ("pause_s", "resume_s"):
            a, b = med(s, key), med("tms", key)
            if a and b:
                check(a[0] <= b[0], f"{s}: {key} {a[0]:.3f} s against tms {b[0]:.3f} s: {a[0] / b[0]:.2f}x (<= 1.0)")
        a, b, c = med(s, "nvml_paused"), med("tms", "nvml_paused"), med("tms", "nvml_emptied")
        if a and b and c:
            check(a[0] <= b[0] and a[0] <= c[0],
                  f"{s}: NVML with every tag paused {a[0] / GiB:.2f} GiB against tms {b[0] / GiB:.2f}, "
                  f"tms after empty_cache {c[0] / GiB:.2f}")
    digests = {e.get("digest") for s in SETTINGS for e in data[s]["exact"]}
    tms_exact = [(e.get("losses"), e.get("tokens")) for e in data["tms"]["exact"]]
    print(f"NOTE tms (reported, not judged): rc {data['tms']['rc']}, losses/tokens exact {tms_exact}")
    check(len(digests) == 1, f"the same losses and tokens in every process of every setting: digests {sorted(map(str, digests))}")
    print(f"tms: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/vmmshim-tms"))
