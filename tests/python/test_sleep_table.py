"""tests/gpu/sleep_table.py and sleep.sh --dry, without a GPU: the sleep table of issue 29 is made
from canned "R ..." lines of every kind of process (passing, failing its own checks, crashed, timed
out, skipped, not started for lack of time, torch_memory_saver's) and must give the medians, the
per-outer-round ratios against torch_memory_saver and exactly the PASS/FAIL lines they call for;
then sleep.sh --dry runs its whole orchestration over the emulated driver (stand-in trainers under
the shim), once as it should go and once with a process that dies, which must get a FAIL line with
its stderr while the next process still runs.  Ends with "N passed, N failed"."""
import importlib.util
import os
import re
import subprocess
import tempfile

import harness

harness.setup()
T = harness.Tally()
spec = importlib.util.spec_from_file_location("sleep_table", harness.ROOT / "tests" / "gpu" / "sleep_table.py")
st = importlib.util.module_from_spec(spec)
spec.loader.exec_module(st)
GiB = 1 << 30


def process(pause, resume, gbps, paused_gib=3.0, d2h=50.0, neighbour=(0, 1), equal=1, tally=(9, 0), extra="",
            done=True, rounds=3):
    """A trainer's stdout: pause/resume seconds and pause GB/s per round (lists), the rest fixed."""
    lines = ["R setup mode=shim alloc_conf=default backend=native layers=22 width=2048 rounds=3 steps=4 device=H100",
             f"R pinned d2h={d2h} h2d=40.0 bytes=2147483648",
             "R model params=1100048384 optim_bytes=6600290304 reference_s=3.2",
             "R neighbour filled=60000000000 footprint=60500000000 headroom=2147483648 asks=6331854848"]
    for r in range(rounds):
        nb = neighbour[r] if isinstance(neighbour, list) else neighbour
        lines.append(f"R sleep round={r} pause_s={pause[r]} bytes=6600290304 pause_GBps={gbps[r]} released=6600290304 "
                     f"resume_s={resume[r]} resume_GBps={6.6 / resume[r]:.4f} nvml_before={int(9.5 * GiB)} "
                     f"nvml_paused={int(paused_gib * GiB)} nvml_resumed={int(9.5 * GiB)} neighbour_before={nb[0]} "
                     f"neighbour={nb[1]} not_shim=0 shim_pause_s=0.1 shim_resume_s=0.2")
    if done:
        lines.append(f"R losses equal={equal} first_differing_step={-1 if equal else 5} steps=16 last=2.1 "
                     f"reference_last=2.1")
        for r in range(rounds):
            lines.append(f"R kv round={r} bytes=34359738368 pause_s=0.0{r + 2} resume_s=0.1{r} released=34359738368 "
                         f"kept=0")
        lines += [extra, "R done seconds=31.5", f"{tally[0]} passed, {tally[1]} failed"]
    return "\n".join(x for x in lines if x) + "\n"


def write(d, name, outer, out, rc, err=""):
    base = os.path.join(d, f"{name}-o{outer}")
    for ext, text in ((".out", out), (".err", err), (".rc", f"{rc}\n")):
        with open(base + ext, "w") as f:
            f.write(text)


def canned(d):
    write(d, "shim-default", 1, process([0.14, 0.13, 0.15], [0.30, 0.31, 0.29], [46, 47, 48], paused_gib=3.0), 0)
    write(d, "shim-default", 2, process([0.15, 0.16, 0.14], [0.28, 0.27, 0.29], [44, 45, 46], paused_gib=3.1), 0)
    tms = "NOTE (not counted): round 0: something of its own\n"
    write(d, "tms", 1, process([0.20, 0.21, 0.19], [0.25, 0.24, 0.26], [30, 31, 32], paused_gib=3.5,
                               tally=(8, 0), extra=tms.strip()), 0)
    write(d, "tms", 2, process([0.18, 0.18, 0.18], [0.26, 0.26, 0.26], [35, 36, 37], paused_gib=3.6, tally=(8, 0)), 0)
    # its own check failed, a vacuous neighbour round, losses differ, pause at 0.8x pinned
    write(d, "shim-expandable", 1,
          process([0.2] * 3, [0.3] * 3, [40, 40, 40], neighbour=[(0, 1), (1, 1), (0, 1)], equal=0, tally=(8, 1),
                  extra="FAIL: round 1: the neighbour's allocation of 6331854848 bytes: before the pause succeeded"), 1)
    write(d, "shim-async", 1, process([0.2], [0.3], [45], done=False, rounds=1), 134,
          err="Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access\n")
    write(d, "shim-async", 2, process([0.2], [0.3], [45], done=False, rounds=1), 124)
    write(d, "jax", 1, "SKIP JAX has no GPU (platform cpu)\n", 3)
    write(d, "jax", 2, "", "skip-budget")


def check_canned():
    with tempfile.TemporaryDirectory() as d:
        canned(d)
        procs = st.load(d)
        T.check(sorted(procs) == ["jax", "shim-async", "shim-default", "shim-expandable", "tms"] and
                [p.outer for p in procs["shim-default"]] == [1, 2], f"load: {sorted(procs)}")
        rows = {line.split(" | ")[0][2:]: line for line in st.table(procs)[2:]}
        row = rows.get("vmmshim, default allocator", "")
        # pause GB/s 44..48 over d2h 50: fractions 0.88..0.96, median 0.92; pause s median 0.145
        T.check("| 2/2 | 6 | 6.60 (6.60–6.60) | 0.145 (0.130–0.160) | 46.0 (44.0–48.0) | 0.92 (0.88–0.96) |" in row,
                f"shim-default row: {row}")
        T.check("| 3.05 (3.00–3.10) |" not in row and " / 3.05 (3.00–3.10) / " in row and "| 6/6 | 2/2 |" in row,
                f"shim-default NVML, neighbour and losses columns: {row}")
        T.check("| 34.36 (34.36–34.36) | 0.030 (0.020–0.040) | 0.110 (0.100–0.120) |" in row, f"shim-default KV: {row}")
        T.check("| 2/3 | 0/1 |" in rows.get("vmmshim, `expandable_segments:True` + `VMMSHIM_SLEEP_ADOPTED=1`", ""),
                "expandable: 2 of 3 neighbour rounds, 0 of 1 losses")
        T.check("| 0/2 | 2 |" in rows.get("vmmshim, `backend:cudaMallocAsync`", ""), "async: no process done, 2 rounds")
        T.check("| 0/2 | 0 |" in rows.get("vmmshim, JAX (`pause()` of everything)", ""), "jax: nothing ran")

        v = st.verdicts(procs)
        text = "\n".join(v.lines)

        def has(prefix, pattern):
            ok = re.search("^" + prefix + " " + pattern, text, re.M) is not None
            T.check(ok, f"a line {prefix} {pattern}")

        has("PASS", r"shim-default outer 1: ran to its end, its own checks 9 passed, 0 failed$")
        has("PASS", r"tms outer 1: ran to its end \(1 notes on its own behaviour, not counted\)$")
        has("FAIL", r"shim-expandable outer 1: its own checks 8 passed, 1 failed: round 1: the neighbour")
        has("FAIL", r"shim-async outer 1: crashed \(exit 134\) before its end; last stdout: R sleep round=0 .*"
                    r"last stderr: Traceback \(most recent call last\): \| RuntimeError: CUDA error: an illegal")
        has("FAIL", r"shim-async outer 2: timed out \(exit 124\)")
        has("SKIP", r"jax outer 1: SKIP JAX has no GPU")
        has("FAIL", r"jax outer 2: not started, the time budget was spent")
        has("PASS", r"shim-default: pause at 0\.92x pinned device-to-host bandwidth")
        has("FAIL", r"shim-expandable: pause at 0\.80x pinned")
        has("PASS", r"shim-default: the neighbour's allocation .* in 6 of 6 rounds")
        has("FAIL", r"shim-expandable: the neighbour's allocation .* in 2 of 3 rounds")
        has("FAIL", r"shim-expandable: losses .* in 0 of 1 processes")
        has("FAIL", r"shim-async: losses .* in 0 of 2 processes")
        # per outer round: pause 0.14/0.20 = 0.70 and 0.15/0.18 = 0.83; resume 0.30/0.25, 0.28/0.26
        has("PASS", r"vmmshim's pause at 0\.77x torch_memory_saver's, default allocator \(<= 1\.0x; per outer round: "
                    r"0\.70, 0\.83\)")
        has("FAIL", r"vmmshim's resume at 1\.14x torch_memory_saver's, default allocator \(<= 1\.0x; per outer round: "
                    r"1\.20, 1\.08\)")
        has("PASS", r"vmmshim's NVML after the pause 3\.05 GiB against torch_memory_saver's 3\.55 GiB")
        T.check(not re.search(r"^(PASS|FAIL) tms: ", text, re.M), "no targets judged for torch_memory_saver itself")
        T.check((v.passed, v.failed) == (text.count("\nPASS") + text.startswith("PASS"), text.count("\nFAIL")),
                f"the tally counts the lines: {v.passed} passed, {v.failed} failed")

        # no torch_memory_saver: its comparisons SKIP, not FAIL; --dry: measured targets not counted
        for name in os.listdir(d):
            if name.startswith("tms-"):
                os.unlink(os.path.join(d, name))
        v2 = st.verdicts(st.load(d), tms_missing=True)
        T.check(sum(1 for x in v2.lines if x.startswith("SKIP vmmshim's")) == 3 and
                not any("torch_memory_saver" in x for x in v2.lines if x.startswith(("PASS", "FAIL"))),
                "without .tms the three comparisons SKIP")
        v3 = st.verdicts(st.load(d), dry=True)
        T.check(any(x.startswith("DRY (fail, not counted) shim-expandable: pause at 0.80x") for x in v3.lines) and
                not any(x.startswith("FAIL shim-expandable: pause") for x in v3.lines), "--dry: bandwidth not counted")


def dry(crash):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, BUILD=str(harness.BUILD), OUT=out, SLEEP_OUTER="1", SLEEP_ROUNDS="2",
                   SLEEP_DRY_CRASH="1" if crash else "0", TMS_DIR=os.path.join(out, "no-tms"))
        env.pop("VMMSHIM_BROKER_DIR", None)  # the script makes its own
        env.pop("VMMSHIM_REGISTRY", None)
        r = subprocess.run([str(harness.ROOT / "tests" / "gpu" / "sleep.sh"), "--dry"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=200)
        return r.returncode, r.stdout


def check_dry():
    rc, text = dry(False)
    last = text.strip().splitlines()[-2] if text.strip() else ""
    T.check(rc == 0 and re.search(r"^sleep: [1-9]\d* passed, 0 failed$", text, re.M) is not None,
            f"sleep.sh --dry: exit {rc}, {last}")
    T.check("SKIP tms: " in text and "PASS shim-default outer 1: ran to its end" in text and
            "PASS shim-async: losses after sleeping equal the run that never slept in 1 of 1" in text,
            "its lines: tms skipped (no .tms), the stand-ins ran, losses equal")
    T.check(re.search(r"^\| vmmshim, default allocator \| 1/1 \| 2 \| 0\.01 ", text, re.M) is not None,
            "the table's shim-default row")
    rc, text = dry(True)
    T.check(rc == 1 and re.search(r"^FAIL shim-async outer 1: crashed \(exit 134\) before its end; .*last stderr: "
                                  r"sleep_standin: dying on purpose", text, re.M) is not None and
            "PASS shim-default outer 1: ran to its end" in text,
            f"a process that dies: its FAIL line with its stderr, the others still run (exit {rc})")
    if rc != 1:
        print(text[-3000:])


def main():
    check_canned()
    check_dry()
    harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
