"""The sleep table of issue 29 from the processes tests/gpu/sleep.sh ran:

  sleep_table.py DIR [--tms-missing] [--dry]
                          DIR holds SETTING-oOUTER.out (the process's stdout: its "R ..." lines and
                          its own "N passed, N failed"), .err (its stderr) and .rc (its exit status;
                          "skip-budget" when the driver did not start it for lack of time)

Prints one markdown table (per setting, over every round of every process of it: the median and the
min-max of pause and resume seconds and GB/s, each GB/s also as a fraction of the pinned bandwidth
measured in the same process; NVML used before, paused and resumed, the process's own share; how
many rounds the neighbour's allocation failed before the pause and succeeded after it; whether every
process's losses equalled its run that never slept; the KV tensor's discard pause and resume), then
one PASS/FAIL line per target and per process, then "sleep: N passed, N failed".  Exit 1 on a failure.
--tms-missing: no torch_memory_saver build, its comparisons SKIP; --dry: the emulated driver ran it,
the measured targets print as DRY and are not counted.

Targets (vmmshim's settings; torch_memory_saver's rows are the baseline, reported):
  - pause GB/s >= 0.9x pinned device-to-host, per setting (median of the rounds' fractions);
  - vmmshim's pause and resume <= 1.0x torch_memory_saver's under the default allocator: per outer
    round the ratio of the two processes' median seconds, the median of those ratios;
  - vmmshim's NVML after the pause <= torch_memory_saver's (default allocator; medians);
  - the neighbour's allocation failed before and succeeded after every pause, per setting;
  - the losses after sleeping equal the run that never slept, every process, per setting;
  - every process ran to its end with its own checks passing (torch_memory_saver's: ran to its end)."""
import os
import re
import statistics
import sys

# (name, label, is vmmshim); the order of the table
SETTINGS = (
    ("shim-default", "vmmshim, default allocator", True),
    ("shim-expandable", "vmmshim, `expandable_segments:True` + `VMMSHIM_SLEEP_ADOPTED=1`", True),
    ("shim-async", "vmmshim, `backend:cudaMallocAsync`", True),
    ("tms", "torch_memory_saver (preload, CPU backup), default allocator", False),
    ("jax", "vmmshim, JAX (`pause()` of everything)", True),
)
GB = 1e9
GiB = float(1 << 30)


def parse_value(v):
    if v in ("None", "na"):
        return None
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def parse(text):
    """[(kind, {key: value})] of a process's "R kind k=v ..." lines, in order."""
    out = []
    for line in text.splitlines():
        w = line.split()
        if len(w) >= 2 and w[0] == "R":
            fields = {}
            for kv in w[2:]:
                k, sep, v = kv.partition("=")
                if sep:
                    fields[k] = parse_value(v)
            out.append((w[1], fields))
    return out


class Process:
    """One process's results: name, outer, rc (an int, or a string such as "skip-budget"), R lines,
    its own tally, its stderr's last lines."""

    def __init__(self, name, outer, out, err, rc):
        self.name, self.outer, self.rc = name, outer, rc
        self.text, self.err = out, err
        self.r = parse(out)
        m = re.findall(r"^(\d+) passed, (\d+) failed$", out, re.M)
        self.tally = (int(m[-1][0]), int(m[-1][1])) if m else None
        self.skip = next((line for line in out.splitlines() if line.startswith("SKIP")), None)

    def all(self, kind):
        return [f for k, f in self.r if k == kind]

    def one(self, kind):
        got = self.all(kind)
        return got[-1] if got else {}

    @property
    def done(self):
        return bool(self.all("done"))

    def sleeps(self):
        """The sleep rounds, each with the process's pinned bandwidth beside it."""
        pin = self.one("pinned")
        rows = []
        for f in self.all("sleep"):
            f = dict(f)
            f["d2h"], f["h2d"] = pin.get("d2h"), pin.get("h2d")
            rows.append(f)
        return rows


def load(directory):
    """{name: [Process]} from DIR's files, each list in outer-round order."""
    procs = {}
    for fn in sorted(os.listdir(directory)):
        m = re.fullmatch(r"(.+)-o(\d+)\.rc", fn)
        if not m:
            continue
        base = os.path.join(directory, fn[:-3])

        def read(ext):
            try:
                with open(base + ext, errors="replace") as f:
                    return f.read()
            except OSError:
                return ""
        rc_text = read(".rc").strip()
        rc = int(rc_text) if re.fullmatch(r"-?\d+", rc_text) else rc_text or "missing"
        procs.setdefault(m.group(1), []).append(Process(m.group(1), int(m.group(2)), read(".out"), read(".err"), rc))
    for v in procs.values():
        v.sort(key=lambda p: p.outer)
    return procs


def spread(xs, fmt):
    """"median (min-max)" of the values that are not None; "-" when none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    med = fmt(statistics.median(xs))
    return med if len(xs) == 1 else f"{med} ({fmt(min(xs))}–{fmt(max(xs))})"


def ratio(a, b):
    return a / b if a is not None and b else None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def table(procs):
    """The markdown table's lines."""
    s3 = "{:.3f}".format
    g1 = "{:.1f}".format
    f2 = "{:.2f}".format
    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    out = ["| setting | processes | rounds | GB kept | pause s | pause GB/s | × pinned d2h | resume s | resume GB/s "
           "| × pinned h2d | NVML own GiB: before / paused / resumed | neighbour ok | losses equal | KV GB "
           "| KV pause s | KV resume s |",
           "|" + "---|" * 16]
    for name, label, _ in SETTINGS:
        ps = procs.get(name, [])
        if not ps:
            continue
        rows = [f for p in ps for f in p.sleeps()]
        kvs = [f for p in ps for f in p.all("kv")]
        ok = sum(1 for f in rows if f.get("neighbour") == 1 and f.get("neighbour_before") == 0)
        losses = [p.one("losses").get("equal") for p in ps if p.one("losses")]
        nvml = " / ".join(spread([f.get(k) for f in rows], gib) for k in ("nvml_before", "nvml_paused", "nvml_resumed"))
        out.append("| " + " | ".join([
            label, f"{sum(1 for p in ps if p.done)}/{len(ps)}", str(len(rows)),
            spread([f.get("bytes") / GB if f.get("bytes") is not None else None for f in rows], f2),
            spread([f.get("pause_s") for f in rows], s3),
            spread([f.get("pause_GBps") for f in rows], g1),
            spread([ratio(f.get("pause_GBps"), f.get("d2h")) for f in rows], f2),
            spread([f.get("resume_s") for f in rows], s3),
            spread([f.get("resume_GBps") for f in rows], g1),
            spread([ratio(f.get("resume_GBps"), f.get("h2d")) for f in rows], f2),
            nvml, f"{ok}/{len(rows)}",
            f"{sum(1 for x in losses if x == 1)}/{len(losses)}",
            spread([f.get("bytes") / GB if isinstance(f.get("bytes"), int) else None for f in kvs], f2),
            spread([f.get("pause_s") for f in kvs], s3),
            spread([f.get("resume_s") for f in kvs], s3),
        ]) + " |")
    return out


class Verdicts:
    """PASS/FAIL/SKIP lines; dry: the measured targets (add(..., measured=True)) are printed as DRY
    and not counted, since over the emulated driver nothing measured is real."""

    def __init__(self, dry=False):
        self.lines, self.passed, self.failed, self.dry = [], 0, 0, dry

    def add(self, ok, what, measured=False):
        if measured and self.dry:
            self.lines.append(f"DRY ({'pass' if ok else 'fail'}, not counted) {what}")
        elif ok is None:
            self.lines.append(f"SKIP {what}")
        elif ok:
            self.passed += 1
            self.lines.append(f"PASS {what}")
        else:
            self.failed += 1
            self.lines.append(f"FAIL {what}")


def err_tail(p, n=5):
    """The last stdout line and the last n stderr lines: where it stopped, and why."""
    out = [line for line in p.text.splitlines() if line.strip()]
    lines = [line for line in p.err.splitlines() if line.strip()]
    return (f"last stdout: {out[-1][:200] if out else '(none)'}; last stderr: "
            + (" | ".join(lines[-n:]) if lines else "(none)"))


def verdicts(procs, tms_missing=False, dry=False):
    v = Verdicts(dry)
    f2 = "{:.2f}".format
    # every process: ran to its end, its own checks passing
    for name, label, shim in SETTINGS:
        for p in procs.get(name, []):
            who = f"{name} outer {p.outer}"
            if p.rc == "skip-budget":
                v.add(False, f"{who}: not started, the time budget was spent")
            elif p.rc == 3 or p.skip:
                v.add(None, f"{who}: {p.skip or 'skipped (exit 3)'}")
            elif p.rc in (124, 137):
                v.add(False, f"{who}: timed out (exit {p.rc}); {err_tail(p)}")
            elif not p.done or p.tally is None:
                v.add(False, f"{who}: crashed (exit {p.rc}) before its end; {err_tail(p)}")
            elif p.rc != 0 or p.tally[1]:
                fails = [line[6:] for line in p.text.splitlines() if line.startswith("FAIL: ")]
                v.add(False, f"{who}: its own checks {p.tally[0]} passed, {p.tally[1]} failed: " + "; ".join(fails[:4]))
            elif shim or not any(line.startswith("NOTE") for line in p.text.splitlines()):
                v.add(True, f"{who}: ran to its end, its own checks {p.tally[0]} passed, 0 failed")
            else:
                notes = sum(1 for line in p.text.splitlines() if line.startswith("NOTE"))
                v.add(True, f"{who}: ran to its end ({notes} notes on its own behaviour, not counted)")
    # per vmmshim setting: bandwidth, neighbour, losses
    for name, label, shim in SETTINGS:
        ps = [p for p in procs.get(name, []) if not p.skip and p.rc != 3]
        if not shim or not ps:
            continue
        rows = [f for p in ps for f in p.sleeps()]
        fr = med([ratio(f.get("pause_GBps"), f.get("d2h")) for f in rows])
        v.add(fr is not None and fr >= 0.9,
              f"{name}: pause at {f2(fr) if fr is not None else '?'}x pinned device-to-host bandwidth (>= 0.9x; "
              f"median over {len(rows)} rounds)", measured=True)
        ok = sum(1 for f in rows if f.get("neighbour") == 1 and f.get("neighbour_before") == 0)
        v.add(bool(rows) and ok == len(rows),
              f"{name}: the neighbour's allocation of the released bytes failed before and succeeded after "
              f"the pause in {ok} of {len(rows)} rounds", measured=True)
        eq = [p.one("losses").get("equal") for p in ps]
        v.add(bool(eq) and all(x == 1 for x in eq),
              f"{name}: losses after sleeping equal the run that never slept in {sum(1 for x in eq if x == 1)} "
              f"of {len(eq)} processes")
    # against torch_memory_saver, default allocator
    shim = {p.outer: p for p in procs.get("shim-default", []) if p.sleeps()}
    tms = {p.outer: p for p in procs.get("tms", []) if p.sleeps()}
    if tms_missing or not procs.get("tms"):
        for what in ("pause", "resume", "NVML after the pause"):
            v.add(None, f"vmmshim's {what} against torch_memory_saver's: no torch_memory_saver build (.tms)")
        return v
    both = sorted(set(shim) & set(tms))
    for key, what in (("pause_s", "pause"), ("resume_s", "resume")):
        rs = [ratio(med([f.get(key) for f in shim[o].sleeps()]), med([f.get(key) for f in tms[o].sleeps()]))
              for o in both]
        rs = [x for x in rs if x is not None]
        m = med(rs)
        v.add(m is not None and m <= 1.0,
              f"vmmshim's {what} at {f2(m) if m is not None else '?'}x torch_memory_saver's, default allocator "
              f"(<= 1.0x; per outer round: {', '.join(f2(x) for x in rs) or 'none paired'})", measured=True)
    a = med([f.get("nvml_paused") for o in both for f in shim[o].sleeps()])
    b = med([f.get("nvml_paused") for o in both for f in tms[o].sleeps()])
    v.add(a is not None and b is not None and a <= b,
          f"vmmshim's NVML after the pause {a / GiB if a is not None else float('nan'):.2f} GiB against "
          f"torch_memory_saver's {b / GiB if b is not None else float('nan'):.2f} GiB (the process's own; <=)",
          measured=True)
    return v


def main(argv):
    if not argv:
        print("usage: sleep_table.py DIR [--tms-missing] [--dry]", file=sys.stderr)
        return 2
    procs = load(argv[0])
    for line in table(procs):
        print(line)
    print()
    v = verdicts(procs, tms_missing="--tms-missing" in argv, dry="--dry" in argv)
    for line in v.lines:
        print(line)
    print(f"sleep: {v.passed} passed, {v.failed} failed")
    return 0 if v.failed == 0 and v.passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
