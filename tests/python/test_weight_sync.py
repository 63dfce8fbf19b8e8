"""tests/gpu/weight_sync.sh --dry over the emulated driver: the GPU benchmark of issue 16 (a companion
taking every parameter of a trainer by open_many and open_tensors, the 7B-class layout, eight
companions after every step, the first take from a freshly started owner) runs its whole orchestration with stand-in trainers under the shim,
so the script that the next GPU session runs in one command is known to work up to torch itself.
Checks each part's summary and the closing line; ends with "N passed, N failed"."""
import os
import re
import subprocess
import tempfile

import harness

harness.setup()
T = harness.Tally()


def check_paired_ratios():
    """The load part's estimator: a step with companions over its nearest neighbours without.  Over
    a machine whose step jumps between two levels 10% apart, a 3% cost of the companions must come
    out as 3%, where the ratio of the two medians does not."""
    import importlib.util
    import random
    import statistics
    spec = importlib.util.spec_from_file_location("weight_sync", harness.ROOT / "tests" / "gpu" / "weight_sync.py")
    ws = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ws)
    rng = random.Random(1)
    labels, ms, level = [], [], 21.5
    for i in range(600):
        if i % 9 == 0:
            level = 21.5 if rng.random() < 0.6 else 23.9  # runs of steps at one level or the other
        lab = "with" if rng.random() < 0.5 else "without"
        labels.append(lab)
        ms.append(level * (1.03 if lab == "with" else 1.0) * (1 + rng.uniform(-0.005, 0.005)))
    r = statistics.median(ws.paired_ratios(labels, ms, "with"))
    T.check(abs(r - 1.03) < 0.005, f"paired ratio over a two-level machine: {r:.4f} for a 3% cost")
    # a step with no neighbour without within reach is left out, not set against a far one
    T.check(ws.paired_ratios(["with"] * 5 + ["without"], [2.0] * 5 + [1.0], "with", reach=3) == [2.0] * 3,
            "steps with no neighbour without within 3 are left out")
    T.check(ws.paired_ratios(["without", "with", "without"], [1.0, 1.1, 4.0], "with") == [1.1 / 2.0],
            "both sides: their geometric mean")


def main():
    check_paired_ratios()
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, BUILD=str(harness.BUILD), OUT=out)
        env.pop("VMMSHIM_BROKER_DIR", None)  # the script makes its own
        r = subprocess.run([str(harness.ROOT / "tests" / "gpu" / "weight_sync.sh"), "--dry"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
        text = r.stdout
        for part, least in (("gpt2", 12), ("7b", 4), ("load", 1), ("first", 6)):
            m = re.search(rf"^weight-sync {part}: (\d+) passed, (\d+) failed", text, re.M)
            T.check(m is not None and int(m.group(1)) >= least and m.group(2) == "0",
                    f"part {part}: {m.group(0) if m else 'no summary'}")
        T.check(re.search(r"\| open_many \| [\d.]+ ms \| [\d.]+ ms \|", text) is not None, "the takes' table")
        T.check("1 req, " in text and "1 SetAccess" in text, "one request and one SetAccess a take")
        T.check(re.search(r"^\| first take, fresh owner \| [\d.]+ ms \|", text, re.M) is not None and
                re.search(r"^\| steady \(a later cold companion\) \| [\d.]+ ms \|", text, re.M) is not None,
                "the first-take part's rows")
        m = re.search(r"^load: each step with companions against the nearest steps without on either side: with "
                      r"median [\d.]+ \(quartiles [\d.na-]+, (\d+) steps\); fresh median [\d.]+ \(quartiles [\d.na-]+, "
                      r"(\d+) steps\)", text, re.M)
        T.check(m is not None and int(m.group(1)) > 0 and int(m.group(2)) > 0,
                f"the load part's paired steps: {m.group(0) if m else 'no such line'}")
        m = re.search(r"^weight-sync: (\d+) passed, (\d+) failed", text, re.M)
        T.check(r.returncode == 0 and m is not None and m.group(2) == "0", f"exit {r.returncode}: "
                f"{m.group(0) if m else 'no closing line'}")
        if T.failed:
            print(text[-6000:])
    harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
