"""tests/gpu/weight_sync.sh --dry over the emulated driver: the GPU benchmark of issue 16 (a companion
taking every parameter of a trainer by open_many and open_tensors, the 7B-class layout, eight
companions after every step) runs its whole orchestration with stand-in trainers under the shim,
so the script that the next GPU session runs in one command is known to work up to torch itself.
Checks each part's summary and the closing line; ends with "N passed, N failed"."""
import os
import re
import subprocess
import tempfile

import harness

harness.setup()
T = harness.Tally()


def main():
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, BUILD=str(harness.BUILD), OUT=out)
        env.pop("VMMSHIM_BROKER_DIR", None)  # the script makes its own
        r = subprocess.run([str(harness.ROOT / "tests" / "gpu" / "weight_sync.sh"), "--dry"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=280)
        text = r.stdout
        for part, least in (("gpt2", 12), ("7b", 4), ("load", 1)):
            m = re.search(rf"^weight-sync {part}: (\d+) passed, (\d+) failed", text, re.M)
            T.check(m is not None and int(m.group(1)) >= least and m.group(2) == "0",
                    f"part {part}: {m.group(0) if m else 'no summary'}")
        T.check(re.search(r"\| open_many \| [\d.]+ ms \| [\d.]+ ms \|", text) is not None, "the takes' table")
        T.check("1 req, " in text and "1 SetAccess" in text, "one request and one SetAccess a take")
        m = re.search(r"^weight-sync: (\d+) passed, (\d+) failed", text, re.M)
        T.check(r.returncode == 0 and m is not None and m.group(2) == "0", f"exit {r.returncode}: "
                f"{m.group(0) if m else 'no closing line'}")
        if T.failed:
            print(text[-6000:])
    harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
