#!/usr/bin/env bash
# The two-GPU soak (issue 18): PyTorch DDP over NCCL (tests/gpu/ddp_soak.py, two ranks on GPUs 0
# and 1) under the shim for DDP_SOAK_SECONDS (default 600), with the same run natively beside it
# on the same two GPUs at the same time for the reference losses (run together rather than one
# after the other so both fit one 10-minute window; the losses depend on the step, not the
# speed), while two companions (tests/gpu/soak_companion.c) import random live allocations the
# whole time, each from the other GPU than its rank's memory: rank 0's from GPU 1, rank 1's from
# GPU 0 (imports over the peer mapping).  Every 15 s: NVML's used memory per process (nvidia-smi
# --query-compute-apps) and per GPU, and each shim rank's live record count (vmmctl ps --json).
#
# Checks (PASS/FAIL, then "ddp-soak: N passed, N failed"):
#   - both runs trained the whole time and exited 0;
#   - the same losses as the native run at every logged step both logged (exact, or within a
#     relative 1e-5, which the line says);
#   - 0 error lines in the shim run's stderr; both companions: exit 0, imports made, 0 errors;
#   - memory flat after a warm-up of DDP_SOAK_WARMUP (120) s: each shim rank's process memory
#     max - min <= 64 MiB + the native rank's own max - min; each companion's max - min <= 64 MiB;
#     each GPU's used memory max - min <= 128 MiB + both native ranks' spreads on it
#     (when nvidia-smi shows no processes, the per-process rows say so and are not counted);
#   - each shim rank's record count flat after the warm-up: max - min <= 64.
#
# The device machine runs each command for at most 600 s, so the soak runs detached:
#   DDP_SOAK_SECONDS=600 tests/gpu/ddp_soak.sh start   starts everything under setsid in
#                                    $DDP_SOAK_DIR (default /tmp/vmmshim-ddpsoak), returns at once
#   tests/gpu/ddp_soak.sh wait [MAX_S]   waits up to MAX_S (default 590) s for the end; then prints
#                                    the summary and copies the folder to ${OUT:-/tmp}/vmmshim-ddpsoak
#                                    (exit 0 all passed, 1 some failed); not done by then: the
#                                    progress so far, a partial copy, exit 3 (call wait again)
#   tests/gpu/ddp_soak.sh status     the last sample, at once
#   tests/gpu/ddp_soak.sh stop       kills the soak's process group
#   tests/gpu/ddp_soak.sh            start, then wait without a limit (a machine without one)
# DDP_SOAK_ALLOC_CONF sets PYTORCH_CUDA_ALLOC_CONF for both runs (default: unset).  NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1.  Every program runs under timeout.
set -u
SELF=$(readlink -f "$0")
cd "$(dirname "$SELF")/../.." || exit 1
ROOT=$PWD
B=$ROOT/${BUILD:-build}
G=$ROOT/tests/gpu
D=${DDP_SOAK_DIR:-/tmp/vmmshim-ddpsoak}
SECS=${DDP_SOAK_SECONDS:-600}
WARM=${DDP_SOAK_WARMUP:-120}
export VMMSHIM_REGISTRY=/vmmshim-ddpsoak PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset NCCL_P2P_DISABLE

die() { echo "ddp-soak: $*"; echo "ddp-soak: 0 passed, 1 failed"; exit 1; }
running() { [ -f "$D/supervisor.pid" ] && kill -0 "$(cat "$D/supervisor.pid")" 2>/dev/null; }

start() {
  if running; then die "a soak is running already (supervisor $(cat "$D/supervisor.pid")); 'wait' or 'stop' it"; fi
  if [ ! -f "$B/libvmmshim.so" ] || [ ! -f "$B/libvmmshim-client.so" ] || [ ! -x "$B/vmmctl" ]; then die "$B is incomplete"; fi
  case $SECS in '' | *[!0-9]*) die "DDP_SOAK_SECONDS must be a whole number of seconds" ;; esac
  [ "$SECS" -ge 60 ] || die "DDP_SOAK_SECONDS must be at least 60"
  ngpu=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${ngpu:-0}" -ge 2 ] || die "needs two GPUs, found ${ngpu:-0}"
  rm -rf "$D"; mkdir -p "$D"
  gcc -O2 -std=c11 -D_GNU_SOURCE -Itools/include "$G/soak_companion.c" -o "$D/companion" -L"$B" -lvmmshim-client \
    -ldl -Wl,-rpath,"$B" 2>"$D/build.err" || { cat "$D/build.err"; die "building the companion failed"; }
  timeout 30 "$B/vmmctl" gc >/dev/null 2>&1
  rm -f "/dev/shm$VMMSHIM_REGISTRY"
  echo "$SECS $WARM ${DDP_SOAK_ALLOC_CONF:-}" >"$D/params"
  setsid nohup "$SELF" _run </dev/null >"$D/supervisor.log" 2>&1 &
  echo $! >"$D/supervisor.pid"
  sleep 1 # the supervisor writes its own pid (setsid may have forked)
  echo "ddp-soak: started (supervisor $(cat "$D/supervisor.pid"), ${SECS} s of training, warm-up ${WARM} s); files in $D"
  echo "ddp-soak: collect with: tests/gpu/ddp_soak.sh wait 590   (repeat until it prints the summary)"
}

# ---- the detached supervisor ----------------------------------------------------------------

sample_header="t_s shim_r0_mib shim_r1_mib native_r0_mib native_r1_mib comp0_mib comp1_mib gpu0_mib gpu1_mib recs_r0 recs_r1"

pid_of() { # FILE RANK: the pid a run's rank printed
  sed -n "s/^# rank $2 pid \\([0-9]*\\)$/\\1/p" "$1" 2>/dev/null | head -n 1
}

supervise() {
  echo $$ >"$D/supervisor.pid" # the leader of the soak's own session and process group
  read -r SECS WARM CONF <"$D/params"
  export PYTORCH_CUDA_ALLOC_CONF=${CONF:-}
  [ -n "$PYTORCH_CUDA_ALLOC_CONF" ] || unset PYTORCH_CUDA_ALLOC_CONF
  local t0=$SECONDS limit=$((SECS + 300))
  echo "supervisor: $(date -u +%FT%TZ), training ${SECS} s, warm-up ${WARM} s, alloc conf '${CONF:-}'"
  timeout -k 10 "$limit" python3 -u "$G/ddp_soak.py" --init "file://$D/store.native" --seconds "$SECS" \
    >"$D/native.out" 2>"$D/native.err" &
  local npid=$!
  timeout -k 10 "$limit" env LD_PRELOAD="$B/libvmmshim.so" python3 -u "$G/ddp_soak.py" --init "file://$D/store.shim" \
    --seconds "$SECS" >"$D/shim.out" 2>"$D/shim.err" &
  local spid=$!
  echo "$npid $spid" >"$D/wrappers.pid" # timeout wrappers: a signal to one reaches its whole group
  local i s0="" s1="" n0="" n1=""
  for ((i = 0; i < 900; i++)); do # at most 180 s for both runs to set up
    s0=$(pid_of "$D/shim.out" 0); s1=$(pid_of "$D/shim.out" 1)
    n0=$(pid_of "$D/native.out" 0); n1=$(pid_of "$D/native.out" 1)
    [ -n "$s0" ] && [ -n "$s1" ] && [ -n "$n0" ] && [ -n "$n1" ] && grep -q '^# training' "$D/shim.out" && break
    kill -0 "$spid" 2>/dev/null || break
    sleep 0.2
  done
  echo "supervisor: shim ranks ${s0:-?} ${s1:-?}, native ranks ${n0:-?} ${n1:-?} after $((SECONDS - t0)) s"
  local c0="" c1="" cpid0="" cpid1="" csecs=$((SECS - 25))
  if [ -n "$s0" ] && [ -n "$s1" ]; then
    timeout -k 5 $((csecs + 60)) "$D/companion" "$s0" "$csecs" 1 >"$D/companion0.txt" 2>"$D/companion0.err" &
    cpid0=$!
    timeout -k 5 $((csecs + 60)) "$D/companion" "$s1" "$csecs" 0 >"$D/companion1.txt" 2>"$D/companion1.err" &
    cpid1=$!
    echo "$cpid0 $cpid1" >>"$D/wrappers.pid"
  fi
  echo "$sample_header" >"$D/samples.txt"
  local start=$SECONDS t mem gpus ps
  while kill -0 "$spid" 2>/dev/null; do
    t=$((SECONDS - start))
    # the companions' own pids: the children of their timeout wrappers
    [ -n "$cpid0" ] && [ -z "$c0" ] && c0=$(pgrep -P "$cpid0" 2>/dev/null | head -n 1)
    [ -n "$cpid1" ] && [ -z "$c1" ] && c1=$(pgrep -P "$cpid1" 2>/dev/null | head -n 1)
    mem=$(timeout 20 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
    gpus=$(timeout 20 nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits 2>/dev/null)
    ps=$(timeout 20 "$B/vmmctl" ps --json 2>/dev/null)
    m() { [ -n "$1" ] && echo "$mem" | awk -F', *' -v p="$1" '$1 == p { print $2; exit }'; }
    g() { echo "$gpus" | awk -F', *' -v i="$1" '$1 == i { print $2; exit }'; }
    r() { [ -n "$1" ] && printf '%s' "$ps" | python3 -c 'import json,sys
try: print(next((p["n_allocs"] for p in json.load(sys.stdin) if p["pid"] == int(sys.argv[1])), ""))
except Exception: print("")' "$1"; }
    v() { [ -n "$1" ] && echo "$1" || echo -; }
    echo "$t $(v "$(m "$s0")") $(v "$(m "$s1")") $(v "$(m "$n0")") $(v "$(m "$n1")") $(v "$(m "$c0")") $(v "$(m "$c1")")" \
      "$(v "$(g 0)") $(v "$(g 1)") $(v "$(r "$s0")") $(v "$(r "$s1")")" >>"$D/samples.txt"
    sleep 15
  done
  wait "$spid"; local src=$?
  wait "$npid"; local nrc=$?
  local crc0=1 crc1=1
  if [ -n "$cpid0" ]; then wait "$cpid0"; crc0=$?; fi
  if [ -n "$cpid1" ]; then wait "$cpid1"; crc1=$?; fi
  echo "supervisor: shim exit $src, native exit $nrc, companions exit $crc0 $crc1, after $((SECONDS - t0)) s"
  timeout 120 python3 - "$D" "$src" "$nrc" "$crc0" "$crc1" "$SECS" "$WARM" >"$D/summary.txt" 2>&1 <<'PY'
import re, sys
d, src, nrc, crc0, crc1, secs, warm = sys.argv[1], *map(int, sys.argv[2:7]), float(sys.argv[7])

def lines(name):
    try:
        return open(f"{d}/{name}", errors="replace").read().splitlines()
    except OSError:
        return []

def losses(name):
    out = {}
    for l in lines(name):
        m = re.match(r"rank (\d+) step (\d+) loss (\S+)$", l)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = m.group(3)
    return out

def steps(name):
    return {int(m.group(1)): int(m.group(2)) for l in lines(name) for m in [re.match(r"rank (\d+) done (\d+)$", l)] if m}

nat, sh = losses("native.out"), losses("shim.out")
common = sorted(set(nat) & set(sh))
exact = sum(nat[k] == sh[k] for k in common)
worst = 0.0
for k in common:
    a, b = float(nat[k]), float(sh[k])
    worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1e-30))
sdone, ndone = steps("shim.out"), steps("native.out")
errs = [l for l in lines("shim.err") if "vmmshim: error" in l or "Traceback" in l]
def noisy(name):  # lines that may be benign, counted against the native run's
    return [l for l in lines(name) if "Error" in l or "NCCL WARN" in l or "vmmshim: warning" in l]
snoise, nnoise = noisy("shim.err"), noisy("native.err")
comp = []
for i, rc in ((0, crc0), (1, crc1)):
    tot = [l for l in lines(f"companion{i}.txt") if l.startswith("companion:")]
    m = re.match(r"companion: (\d+) imports .*?, (\d+) stale, (\d+) errors", tot[-1]) if tot else None
    cerr = [l for l in lines(f"companion{i}.err") if l.strip()]
    comp.append((i, rc, tot[-1].strip() if tot else "no summary line", int(m.group(1)) if m else 0,
                 int(m.group(3)) if m else -1, cerr))

rows = [l.split() for l in lines("samples.txt")[1:]]
def col(i):
    return [float(r[i]) for r in rows if len(r) > i and r[i] != "-" and float(r[0]) >= warm]
names = ["t", "shim rank 0", "shim rank 1", "native rank 0", "native rank 1", "companion 0", "companion 1",
         "GPU 0", "GPU 1", "records rank 0", "records rank 1"]
series = {n: col(i) for i, n in enumerate(names) if i}
def spread(n):
    v = series[n]
    return max(v) - min(v) if v else None
def show(n, unit="MiB"):
    v = series[n]
    if not v:
        return f"{n}: no samples after {warm:.0f} s"
    return (f"{n}: min {min(v):.0f}, max {max(v):.0f}{' ' + unit if unit else ''} (spread {max(v) - min(v):.0f}), first {v[0]:.0f}, "
            f"last {v[-1]:.0f}, {len(v)} samples")

print(f"ddp-soak: {secs} s asked; shim ranks stopped at steps {sdone or '?'} (exit {src}), native at {ndone or '?'} "
      f"(exit {nrc}); {len(rows)} samples every 15 s")
print(f"losses: {len(common)} logged (rank, step) pairs in common, {exact} identical, largest relative difference "
      f"{worst:.2e}")
for n in names[1:]:
    print(show(n, "" if n.startswith("records") else "MiB"))
for i, rc, tot, imports, cerrs, cerr in comp:
    print(f"companion {i} (rank {i}'s memory, from GPU {1 - i}): exit {rc}; {tot}" + (f"; stderr: {cerr[0]}" if cerr else ""))
print(f"shim stderr: {len(errs)} error lines" + (f"; first: {errs[0].strip()}" if errs else ""))
print(f"lines with 'Error', 'NCCL WARN' or 'vmmshim: warning': {len(snoise)} in the shim run's stderr, {len(nnoise)} in "
      f"the native run's" + (f"; first: {snoise[0].strip()}" if snoise else ""))

checks = []
def add(name, ok):
    checks.append((name, ok))
add("both runs trained the whole time and exited 0",
    src == 0 and nrc == 0 and len(sdone) == 2 and len(ndone) == 2 and bool(rows) and float(rows[-1][0]) >= secs - 60)
if common and exact == len(common):
    add(f"the same losses as the native run: exact at all {len(common)} logged steps of both ranks", True)
else:
    add(f"the same losses as the native run: {exact} of {len(common)} exact, largest relative difference {worst:.2e} "
        f"(within 1e-5 passes)", bool(common) and worst <= 1e-5)
add("0 error lines ('vmmshim: error', Traceback) in the shim run's stderr", not errs)
add("no more 'Error' / 'NCCL WARN' / 'vmmshim: warning' lines in the shim run's stderr than in the native run's",
    len(snoise) <= len(nnoise))
for i, rc, tot, imports, cerrs, cerr in comp:
    add(f"companion {i} (rank {i}'s memory, imported from GPU {1 - i}): {imports} imports, {max(cerrs, 0)} errors, "
        f"exit {rc}", rc == 0 and imports > 0 and cerrs == 0 and not cerr)
have_proc = any(series[n] for n in ("shim rank 0", "shim rank 1"))
if have_proc:
    for r in (0, 1):
        s, nsp = spread(f"shim rank {r}"), spread(f"native rank {r}") or 0
        add(f"shim rank {r}'s memory flat after {warm:.0f} s: spread {s if s is None else round(s)} MiB <= 64 + native's "
            f"{nsp:.0f}", s is not None and s <= 64 + nsp)
    for i in (0, 1):
        s = spread(f"companion {i}")
        add(f"companion {i}'s memory flat after {warm:.0f} s: spread {s if s is None else round(s)} MiB <= 64",
            s is not None and s <= 64)
else:
    print("note: nvidia-smi showed no per-process memory here: those rows are not counted")
nat_sp = (spread("native rank 0") or 0) + (spread("native rank 1") or 0)
for gi in (0, 1):
    s = spread(f"GPU {gi}")
    add(f"GPU {gi}'s used memory flat after {warm:.0f} s: spread {s if s is None else round(s)} MiB <= 128 + native "
        f"ranks' {nat_sp:.0f}", s is not None and s <= 128 + nat_sp)
for r in (0, 1):
    s = spread(f"records rank {r}")
    add(f"shim rank {r}'s record count flat after {warm:.0f} s: spread {s if s is None else round(s)} <= 64",
        s is not None and s <= 64)
p = sum(ok for _, ok in checks)
for name, ok in checks:
    print(("PASS " if ok else "FAIL ") + name)
print(f"ddp-soak: {p} passed, {len(checks) - p} failed")
PY
  if ! grep -q '^ddp-soak: [0-9]* passed' "$D/summary.txt"; then
    { echo "FAIL the summary could not be made"; echo "ddp-soak: 0 passed, 1 failed"; } >>"$D/summary.txt"
  fi
  echo "supervisor: done $(date -u +%FT%TZ)"
  touch "$D/finished"
}

# ---- collecting -----------------------------------------------------------------------------

copy_out() {
  local to=${OUT:-/tmp}/vmmshim-ddpsoak
  [ "$to" = "$D" ] && return 0
  rm -rf "$to"; mkdir -p "$to"
  cp -r "$D"/. "$to"/ 2>/dev/null
  rm -f "$to/companion" # the binary
  echo "ddp-soak: files copied to $to"
}

progress() {
  echo "ddp-soak: $(tail -n 1 "$D/samples.txt" 2>/dev/null | awk '{ print "t=" $1 " s, GPU used MiB " $8 " " $9 ", records " $10 " " $11 }')"
  tail -n 2 "$D/companion0.txt" "$D/companion1.txt" 2>/dev/null | grep '^companion' | tail -n 2 | sed 's/^/  /'
  grep -h ' step ' "$D/shim.out" 2>/dev/null | tail -n 1 | sed 's/^/  shim: /'
}

why_failed() {
  local f
  for f in supervisor.log shim.err native.err companion0.err companion1.err; do
    [ -s "$D/$f" ] && { echo "--- $f (last lines)"; tail -n 8 "$D/$f"; }
  done
  return 0
}

wait_end() { # MAX_S (empty: no limit)
  local max=${1:-} t0=$SECONDS next=$((SECONDS + 60))
  [ -f "$D/supervisor.pid" ] || die "no soak started in $D ('start' first)"
  while [ ! -f "$D/finished" ]; do
    if ! running; then
      echo "ddp-soak: the supervisor is gone without finishing"; why_failed; copy_out
      echo "ddp-soak: 0 passed, 1 failed"; return 1
    fi
    if [ -n "$max" ] && [ $((SECONDS - t0)) -ge "$max" ]; then
      echo "ddp-soak: still running after ${max} s of waiting"; progress; copy_out; return 3
    fi
    if [ "$SECONDS" -ge "$next" ]; then progress; next=$((SECONDS + 60)); fi
    sleep 2
  done
  cat "$D/summary.txt"
  grep -q '^FAIL' "$D/summary.txt" && why_failed
  copy_out
  grep -q '^ddp-soak: [0-9]* passed, 0 failed' "$D/summary.txt"
}

case ${1:-all} in
  start) start ;;
  wait) wait_end "${2:-590}" ;;
  status) if running; then echo "ddp-soak: running"; else echo "ddp-soak: not running"; fi; progress ;;
  stop)
    if running; then
      # the programs run under timeout, each in a process group of its own: TERM to each wrapper
      # reaches its group (the DDP ranks too); then the supervisor's group
      # shellcheck disable=SC2013 # pids, one word each
      for w in $(cat "$D/wrappers.pid" 2>/dev/null); do kill -TERM "$w" 2>/dev/null; done
      kill -- "-$(cat "$D/supervisor.pid")" && echo "ddp-soak: stopped"
    else
      echo "ddp-soak: not running"
    fi ;;
  _run) supervise ;;
  all) start && wait_end "" ;;
  *) echo "usage: $0 [start|wait [MAX_S]|status|stop]"; exit 2 ;;
esac
