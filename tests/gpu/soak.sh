#!/usr/bin/env bash
# The soak (issue 11): a PyTorch training loop under the shim for SOAK_SECONDS (default 1200: 20
# minutes), with the same loop run natively beside it on the same GPU for the reference losses.
# Meanwhile a companion (tests/gpu/soak_companion.c) imports and checksums random live
# allocations of the trainer without pause, `vmmctl dump` copies the whole trainer every minute,
# and every 15 s the trainer's device memory (nvidia-smi) and its registry record count are
# sampled.  Prints the figures and PASS/FAIL lines, closing with "N passed, N failed".
# Everything lands in ${OUT:-/tmp}/vmmshim-soak/ (summary.txt is the report).
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-soak; rm -rf "$W"; mkdir -p "$W"
CUDA=${CUDA_HOME:-/usr/local/cuda}
SECS=${SOAK_SECONDS:-1200}
export VMMSHIM_REGISTRY=/vmmshim-soak-$$
DUMP=/dev/shm/vmmshim-soak-dump-$$
trap 'rm -rf "$DUMP"; rm -f /dev/shm$VMMSHIM_REGISTRY' EXIT
gcc -O2 -std=c11 -D_GNU_SOURCE -Itools/include tests/gpu/soak_companion.c -o "$W/companion" -L"$B" -lvmmshim-client -ldl \
  -Wl,-rpath,"$B" || { echo "soak: building the companion failed"; echo "0 passed, 1 failed"; exit 1; }

SOAK_SECONDS=$SECS python3 tests/gpu/soak_train.py >"$W/native.txt" 2>&1 &
npid=$!
SOAK_SECONDS=$SECS LD_PRELOAD="$B/libvmmshim.so" python3 tests/gpu/soak_train.py >"$W/shim.txt" 2>"$W/shim.err" &
spid=$!
start=$SECONDS
until grep -q '^step 0 ' "$W/shim.txt" 2>/dev/null || ! kill -0 $spid 2>/dev/null; do sleep 1; done
"$W/companion" $spid $((SECS - 30)) >"$W/companion.txt" 2>"$W/companion.err" &
cpid=$!
echo "t_s trainer_mib companion_mib native_mib records" >"$W/samples.txt"
: >"$W/dumps.txt"
next_dump=$((SECONDS + 60))
while kill -0 $spid 2>/dev/null; do
  t=$((SECONDS - start))
  mem=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
  m() { echo "$mem" | awk -F', *' -v p="$1" '$1 == p { print $2 }' | head -n 1; }
  recs=$("$B/vmmctl" list --pid $spid --json 2>/dev/null | python3 -c 'import json,sys
try: print(len(json.load(sys.stdin)))
except Exception: print("-")')
  echo "$t $(m $spid) $(m $cpid) $(m $npid) $recs" >>"$W/samples.txt"
  if [ $SECONDS -ge $next_dump ] && kill -0 $spid 2>/dev/null; then
    d0=$SECONDS
    timeout 120 "$B/vmmctl" dump $spid -o "$DUMP" >"$W/dump.out" 2>"$W/dump.err"; rc=$?
    echo "t=$t rc=$rc s=$((SECONDS - d0)) $(tail -n 1 "$W/dump.out" | tr '\n' ' ') $(grep -c 'error' "$W/dump.err") error lines" >>"$W/dumps.txt"
    [ $rc = 0 ] || { echo "--- dump at t=$t"; head -n 5 "$W/dump.err"; } >>"$W/dump_errors.txt"
    rm -rf "$DUMP"
    next_dump=$((next_dump + 60))
  fi
  sleep 15
done
wait $spid; src=$?
wait $npid; nrc=$?
wait $cpid; crc=$?
python3 - "$W" "$src" "$nrc" "$crc" "$SECS" <<'PY' | tee "$W/summary.txt"
import re, sys
w, src, nrc, crc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def losses(path):
    d = {}
    for line in open(path):
        m = re.match(r"step (\d+) loss (\S+)", line)
        if m: d[int(m.group(1))] = m.group(2)
    return d
nat, sh = losses(f"{w}/native.txt"), losses(f"{w}/shim.txt")
common = sorted(set(nat) & set(sh))
same = sum(nat[s] == sh[s] for s in common)
done = [l for l in open(f"{w}/shim.txt") if l.startswith("done")]
steps = int(done[0].split()[1]) if done else max(sh, default=-1) + 1
err_lines = [l for l in open(f"{w}/shim.err") if "vmmshim: error" in l or "Traceback" in l or "Error" in l]
comp = [l for l in open(f"{w}/companion.txt") if l.startswith("companion:")]
samples = [l.split() for l in open(f"{w}/samples.txt").read().splitlines()[1:]]
def col(i, after):
    return [float(r[i]) for r in samples if len(r) > i and r[i] not in ("", "-") and float(r[0]) >= after]
warm = 120
tm, recs = col(1, warm), col(4, warm)
dumps = open(f"{w}/dumps.txt").read().splitlines()
dump_fail = [d for d in dumps if " rc=0 " not in d]
print(f"soak: {secs} s asked; the trainer under the shim ran {steps} steps (exit {src}), the native one exit {nrc}")
print(f"losses: {len(common)} logged steps in common (every 10th step), {same} identical to the native run's"
      + (f"; first difference at step {next(s for s in common if nat[s] != sh[s])}" if same != len(common) else ""))
if tm: print(f"trainer device memory after {warm} s: min {min(tm):.0f} MiB, max {max(tm):.0f} MiB, first {tm[0]:.0f}, last {tm[-1]:.0f} ({len(tm)} samples)")
if recs: print(f"registry records of the trainer after {warm} s: min {min(recs):.0f}, max {max(recs):.0f}, first {recs[0]:.0f}, last {recs[-1]:.0f}")
print(comp[0].strip() if comp else "companion: no summary line")
print(f"vmmctl dump: {len(dumps)} runs, {len(dump_fail)} failed" + (f"; last: {dumps[-1]}" if dumps else ""))
print(f"trainer stderr: {len(err_lines)} error lines" + (f"; first: {err_lines[0].strip()}" if err_lines else ""))
checks = [
    ("the trainer ran the whole time and exited 0", src == 0 and nrc == 0 and bool(done)),
    ("the same losses as the native run", len(common) > 0 and same == len(common)),
    ("0 errors in the trainer", not err_lines),
    ("0 errors in the companion", crc == 0 and bool(comp) and " 0 errors" in comp[0]),
    ("every vmmctl dump succeeded", len(dumps) > 0 and not dump_fail),
    ("trainer memory flat after warm-up (last <= first + 1% + 64 MiB)", bool(tm) and tm[-1] <= tm[0] * 1.01 + 64),
    ("registry record count flat after warm-up (max - min <= 64)", bool(recs) and max(recs) - min(recs) <= 64),
]
p = sum(ok for _, ok in checks)
for name, ok in checks: print(("PASS " if ok else "FAIL ") + name)
print(f"{p} passed, {len(checks) - p} failed")
PY
