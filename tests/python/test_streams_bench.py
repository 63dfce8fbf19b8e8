"""tests/gpu/streams.sh with STREAMS_DRY: issue 38's two-GPU bench (FSDP2 and DDP, three allocator
settings, native against the shim) fed made-up runs, so the analysis the GPU session trusts is known
to pass the shim that matches native and to fail the faults it exists to catch: twice native's memory
under cudaMallocAsync (the fault before db253d3), a wrong UsedMemHigh, a loss that differs, a slow step,
a missing run; and to pass DDP's live peak moving by a bucket set between runs, natively too.
Ends with "N passed, N failed"."""
import os
import re
import subprocess
import tempfile

import harness

T = harness.Tally()
SCRIPT = harness.ROOT / "tests" / "gpu" / "streams.sh"
TABLE = harness.ROOT / "tests" / "gpu" / "streams.py"


def dry(case, out):
    r = subprocess.run([str(SCRIPT)], env=dict(os.environ, STREAMS_DRY=case, OUT=out), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    m = re.search(r"^streams: (\d+) passed, (\d+) failed$", r.stdout, re.M)
    fails = re.findall(r"^FAIL (.*)$", r.stdout, re.M)
    return r.returncode, (int(m[1]), int(m[2])) if m else None, fails, r.stdout


def main():
    with tempfile.TemporaryDirectory() as out:
        rc, tally, fails, text = dry("good", out)
        T.check(rc == 0 and tally is not None and tally == (46, 0),
                f"shim as native: all 46 checks pass (exit {rc}, {tally}, {fails[:2]})")
        T.check(len(re.findall(r"^(fsdp|ddp) +(default|expandable|async) +[01] ", text, re.M)) == 12,
                "the table: a row per mode, allocator setting and GPU")

        rc, tally, fails, text = dry("bimodal", out)
        T.check(rc == 0 and tally is not None and tally[1] == 0,
                f"DDP's allocated peak a bucket set up on one rank in some runs, native and shim alike, with what "
                f"is held beyond it as native's: passes (exit {rc}, {tally}, {fails[:2]})")

        rc, tally, fails, text = dry("usedhigh", out)
        T.check(rc == 1 and len(fails) == 4 and
                sum("fsdp async GPU" in f and "max_memory_allocated (UsedMemHigh)" in f for f in fails) == 2,
                f"UsedMemHigh 512 MiB off under cudaMallocAsync: both GPUs' allocated rows fail (exit {rc}, {fails})")

        rc, tally, fails, text = dry("twice", out)
        want = {f"fsdp async GPU {g}: {what}" for g in (0, 1) for what in ("max_memory_reserved", "NVML peak")}
        got = {f.split(" MiB")[0].rsplit(" ", 1)[0] for f in fails}
        T.check(rc == 1 and want == got, f"twice native under cudaMallocAsync: exactly the reserved and NVML rows of "
                f"fsdp async fail (exit {rc}, failed: {sorted(got)})")

        rc, tally, fails, text = dry("drift", out)
        T.check(rc == 1 and len(fails) == 2 and any("ddp default: losses bit-identical" in f for f in fails)
                and any(re.match(r"ddp default: step 1\.200x", f) for f in fails),
                f"a differing loss and a 1.2x step fail, nothing else (exit {rc}, {fails})")

        os.remove(os.path.join(out, "vmmshim-streams", "2.shim.async.ddp.out"))
        r = subprocess.run(["python3", str(TABLE), "table", os.path.join(out, "vmmshim-streams")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        T.check(r.returncode == 1 and "FAIL ddp async: every run finished with both ranks' measurements "
                "(2 rounds): missing 2.shim" in r.stdout, "a missing run fails its row, and the table still ends: "
                + (r.stdout.splitlines() or ["nothing"])[-1])
        if T.failed:
            print(text[-3000:])
    T.done()


if __name__ == "__main__":
    main()
