#!/usr/bin/env bash
# `make bench-gpu`: what the shim costs against native CUDA, on the GPU machine with build/
# carried from a development machine.  Every number compares a program run natively with the same
# program under LD_PRELOAD=libvmmshim.so: in each round every job runs both ways back to back, the
# side that goes first alternating from round to round, and each shim run has its own registry.
# Jobs: tests/gpu/bench.c in its modes churn, many, oom (and align, round 1 only: it measures no
# time) and tests/gpu/bench_torch.py under three PYTORCH_CUDA_ALLOC_CONF settings.  Prints one
# table (medians over rounds, shim/native ratios, the per-round ratios, a criterion per row), the
# alignment table, and "bench: N passed, N failed".  Raw results and logs: ${OUT:-/tmp}/vmmshim-bench/.
# ROUNDS (default 3) and BENCH_BUDGET (seconds for the whole run, default 480) are settable: a round
# that would not fit in what is left is skipped, and the table says so.
# Then the memory rows of issue 15 and the GPU-bound PyTorch step rows (tests/gpu/bench_mem.py: NVML
# sampled from another process, its own table and "bench-mem: N passed, N failed"; MEM_ROUNDS,
# STEP_ROUNDS, MEM_BUDGET), and a last line "bench: total N passed, N failed" over both tables.
# BENCH_ONLY (comma-separated; default all) picks rows: speed (= churn,many,oom,align,torchspeed,step,
# jaxstep: JAX's GPU-bound and small host-bound steps, workers taking turns, issue 27),
# mem (= torch,graphs,mixed,giveback,pool,coloc,cupy), companion (companion_bench.sh, run by the
# Makefile), weightsync (weight_sync.sh, run by the Makefile: issue 16's takes of a whole model), or
# any of those names.  BENCH_DRY=1 runs nothing on a GPU: it prints what would run and
# feeds made-up results through bench_mem.py's analysis (a check of the logic on a machine without one).
# BENCH_KEEPER=1 attaches a keeper (`vmmctl keep --all`, started before each shim run on its registry)
# to every shim run: the tables' shim columns are then the shim with a keeper, against the same
# criteria.  BENCH_KEEPER=beside compares the shim with a keeper against the shim without one, in
# the same run: the "native" side runs under the shim too (a registry of its own, no keeper), the
# columns say so, and every timed row's criterion is <= 1.02x (issue 17: the owner can't tell).
# BENCH_ONLY=keeper is BENCH_KEEPER=beside with the rows a keeper could move: churn, oom, step,
# giveback (ROUNDS defaults to 7 there: a process lands in a slow phase of this machine now and
# then, whatever the allocator, and only the median of many rounds sees through it).  In beside
# mode the churn rows come from one process per round that runs the cases twice, a keeper
# attached for one of the two sets (keeper_churn): the process is compared with itself.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-bench
CUDA=${CUDA_HOME:-/usr/local/cuda}
ROUNDS_GIVEN=${ROUNDS:-}
ROUNDS=${ROUNDS:-3}
BUDGET=${BENCH_BUDGET:-480}
START=$SECONDS
RAW=$W/raw.txt # "ROUND SIDE JOB R case key=value ..." and "ROUND SIDE JOB EXIT rc=.. s=.."
LOG=$W/log.txt # every run's stdout and stderr
X=$(mktemp -d "${TMPDIR:-/tmp}/vmmshim-bench-bin.XXXXXX") || exit 1
REG=/vmmshim-bench-$$ # prefix of the per-run registry names
DRY=${BENCH_DRY:-0}
unset PYTORCH_CUDA_ALLOC_CONF
export PYTHONUNBUFFERED=1

# BENCH_ONLY -> the selected jobs, each between spaces in SEL
SPEED_JOBS="churn many oom align torchspeed step jaxstep"
MEM_JOBS="torch gpt graphs mixed giveback pool coloc cupy"
SEL=" "
KEEPER=${BENCH_KEEPER:-0}
for tok in $(printf '%s' "${BENCH_ONLY:-all}" | tr ',' ' '); do
  case $tok in
    all) SEL="$SEL$SPEED_JOBS $MEM_JOBS companion weightsync " ;;
    keeper)
      KEEPER=beside
      ROUNDS=${ROUNDS_GIVEN:-7}
      SEL="$SEL churn oom step giveback "
      ;;
    speed) SEL="$SEL$SPEED_JOBS " ;;
    mem) SEL="$SEL$MEM_JOBS " ;;
    churn | many | oom | align | torchspeed | step | jaxstep | torch | gpt | graphs | mixed | giveback | pool | coloc | cupy | companion | weightsync)
      SEL="$SEL$tok " ;;
    *)
      echo "bench: unknown BENCH_ONLY entry '$tok' (all, speed, mem, companion, weightsync, keeper, $SPEED_JOBS $MEM_JOBS)"
      exit 2
      ;;
  esac
done
sel() {
  case $SEL in *" $1 "*) return 0 ;; esac
  return 1
}
LEGACY=0
for j in churn many oom align torchspeed; do sel "$j" && LEGACY=1; done
MEMSEL=""
for j in $MEM_JOBS step jaxstep; do sel "$j" && MEMSEL="$MEMSEL $j"; done
rm -rf "$W"
mkdir -p "$W"
: >"$RAW"
: >"$LOG"
cleanup() {
  rm -rf "$X"
  rm -f /dev/shm"$REG"-*
}
trap cleanup EXIT

echo "== device; selected:$SEL"
[ "$KEEPER" = 1 ] && echo "== every shim run has a keeper attached (vmmctl keep --all on its registry)"
[ "$KEEPER" = beside ] && echo "== the shim with a keeper (vmmctl keep --all) against the shim without one: both columns run under the shim"
if [ "$DRY" = 1 ]; then
  dev="dry run (BENCH_DRY=1)"
else
  dev=$(timeout 30 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 4 | paste -sd ';')
fi
echo "${dev:-nvidia-smi gave no answer}"
echo "device: ${dev:-unknown}" >>"$RAW"

if [ "$DRY" != 1 ] && { [ ! -f "$B/libvmmshim.so" ] || [ ! -f "$B/libvmmshim-client.so" ]; }; then
  echo "bench: $B/libvmmshim.so or libvmmshim-client.so missing (build on the development machine, carry build/)"
  echo "bench: 0 passed, 1 failed"
  exit 1
fi
BENCH=$X/bench
if [ "$LEGACY" = 1 ] && [ -f "$B/libvmmshim-client.so" ] && ! gcc -O2 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I"$CUDA/include" -Itools/include tests/gpu/bench.c -o "$BENCH" \
  -L"$CUDA/lib64" -lcudart -L"$B" -lvmmshim-client -Wl,-rpath,"$CUDA/lib64" -Wl,-rpath,"$B" -lm >"$W/build.log" 2>&1; then
  echo "bench: building tests/gpu/bench.c failed:"
  tail -n 15 "$W/build.log"
fi
BENCH_MEM=$X/bench_mem
case $MEMSEL in
  *mixed* | *giveback* | *pool* | *coloc*)
    if ! gcc -O2 -std=c11 -Wall -Wextra -D_GNU_SOURCE -I"$CUDA/include" tests/gpu/bench_mem.c -o "$BENCH_MEM" \
      -L"$CUDA/lib64" -lcudart -Wl,-rpath,"$CUDA/lib64" -lm >"$W/build-mem.log" 2>&1; then
      echo "bench: building tests/gpu/bench_mem.c failed (its rows say not built):"
      tail -n 15 "$W/build-mem.log"
    fi
    ;;
esac

# run_one ROUND SIDE JOB TIMEOUT COMMAND...: one run, its R lines into RAW, then its EXIT line.
run_one() {
  local round=$1 side=$2 job=$3 t=$4
  shift 4
  local left=$((BUDGET - (SECONDS - START))) rc t0 t1 secs reg=$REG-$round-$job
  if [ "$left" -lt 20 ]; then
    echo "$round $side $job EXIT rc=skipped s=0" >>"$RAW"
    echo "  $side $job: skipped, under 20 s of the ${BUDGET} s budget left"
    return
  fi
  [ "$left" -lt "$t" ] && t=$left
  echo "=== round $round $side $job: $*" >>"$LOG"
  if [ "$DRY" = 1 ]; then
    echo "$round $side $job EXIT rc=dry s=0" >>"$RAW"
    echo "  $side $job: dry run, would run (timeout $t s): $*"
    return
  fi
  t0=$(date +%s.%N)
  if [ "$side" = shim ]; then
    local kp=""
    if [ "$KEEPER" != 0 ]; then # it waits for the registry, and keeps the job from its first allocation
      "$B/vmmctl" --registry "$reg" keep --all >>"$W/keeper.log" 2>&1 &
      kp=$!
    fi
    timeout -k 5 "$t" env VMMSHIM_REGISTRY="$reg" LD_PRELOAD="$B/libvmmshim.so" "$@" >"$X/out" 2>"$X/err" </dev/null
    rc=$?
    if [ -n "$kp" ]; then
      kill -TERM "$kp" 2>/dev/null
      wait "$kp" || echo "  keeper for $job exited with $? (see $W/keeper.log)"
    fi
    rm -f /dev/shm"$reg" /dev/shm"$reg".*
  elif [ "$KEEPER" = beside ]; then # the baseline: the shim without a keeper
    timeout -k 5 "$t" env VMMSHIM_REGISTRY="$reg-base" LD_PRELOAD="$B/libvmmshim.so" "$@" >"$X/out" 2>"$X/err" </dev/null
    rc=$?
    rm -f /dev/shm"$reg"-base /dev/shm"$reg"-base.*
  else # a registry name nobody creates: the bench then reports records=na
    timeout -k 5 "$t" env VMMSHIM_REGISTRY="$reg-native" "$@" >"$X/out" 2>"$X/err" </dev/null
    rc=$?
  fi
  t1=$(date +%s.%N)
  cat "$X/out" "$X/err" >>"$LOG"
  sed -n "s/^R /$round $side $job R /p" "$X/out" >>"$RAW"
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}')
  echo "$round $side $job EXIT rc=$rc s=$secs" >>"$RAW"
  echo "  $side $job: exit $rc, $secs s"
  [ "$rc" = 0 ] || tail -n 2 "$X/err" | sed 's/^/    stderr: /'
}

# keeper_churn ROUND: the churn cases three times in one process under the shim (BENCH_PHASES=3):
# a first set that only warms the pools up (the first mixed churn of a process maps what later
# ones reuse: 10-30% slower), then two, a keeper attached (vmmctl keep PID) for one of them, first
# in even rounds; the set without it is the "native" side.  A process compared with itself: on one
# machine whole processes differ by 5-90% on 0.5 us calls (native or shim, keeper or not), more
# than the 2% the rows judge, which take the median of these per-round ratios.
keeper_churn() {
  local round=$1 kp="" line phase side pid="" t0 rc nokeeper=0
  local reg=$REG-$round-churnk
  local sides=(warm native shim)
  [ $((round % 2)) = 0 ] && sides=(warm shim native)
  if [ "$DRY" = 1 ]; then
    echo "$round native churn EXIT rc=dry s=0" >>"$RAW"
    echo "$round shim churn EXIT rc=dry s=0" >>"$RAW"
    echo "  churn: dry run, would run one process of three churn sets (${sides[*]}; shim = a keeper attached)"
    return
  fi
  echo "=== round $round churn: one process, phases ${sides[*]} (shim = keeper attached)" >>"$LOG"
  t0=$SECONDS
  coproc CHURN { exec env VMMSHIM_REGISTRY="$reg" LD_PRELOAD="$B/libvmmshim.so" BENCH_PHASES=3 timeout -k 5 400 "$BENCH" churn 2>"$X/err"; }
  local out=${CHURN[0]} in=${CHURN[1]} cpid=$CHURN_PID
  side=""
  while IFS= read -r -t 430 line <&"$out"; do
    echo "$line" >>"$LOG"
    case $line in
      "# bench churn pid "*) pid=${line##* } ;;
      "R "*) [ "$side" = native ] || [ "$side" = shim ] && echo "$round $side churn ${line}" >>"$RAW" ;;
      "P ready "*)
        phase=${line#P ready }
        if [ -n "$kp" ]; then kill -TERM "$kp" 2>/dev/null; wait "$kp" 2>/dev/null; kp=""; fi
        side=${sides[$phase]}
        if [ "$side" = shim ]; then
          [ -n "$pid" ] && "$B/vmmctl" --registry "$reg" keep "$pid" >>"$W/keeper.log" 2>&1 &
          kp=$!
          for _ in $(seq 500); do grep -q "pid $pid: keeping" "$W/keeper.log" 2>/dev/null && break; sleep 0.01; done
          if ! grep -q "pid $pid: keeping" "$W/keeper.log" 2>/dev/null; then
            echo "  churn: the keeper did not attach to pid ${pid:-?} (see $W/keeper.log): round $round not counted"
            nokeeper=1
            break
          fi
        fi
        echo go >&"$in" ;;
      "P done") break ;;
    esac
  done
  if [ -n "$kp" ]; then kill -TERM "$kp" 2>/dev/null; wait "$kp" 2>/dev/null; fi
  [ "$nokeeper" = 1 ] && kill -TERM "$cpid" 2>/dev/null
  wait "$cpid" 2>/dev/null
  rc=$?
  if [ "$nokeeper" = 1 ]; then # its lines say nothing about a keeper: none of them counts
    sed -i "/^$round \(native\|shim\) churn R /d" "$RAW"
    rc=nokeeper
  fi
  rm -f /dev/shm"$reg" /dev/shm"$reg".*
  echo "$round native churn EXIT rc=$rc s=$((SECONDS - t0))" >>"$RAW"
  echo "$round shim churn EXIT rc=$rc s=$((SECONDS - t0))" >>"$RAW"
  echo "  churn (one process: ${sides[*]}; shim = keeper attached): exit $rc, $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || tail -n 2 "$X/err" | sed 's/^/    stderr: /'
}

# pair ROUND JOB TIMEOUT COMMAND...: native and shim back to back, odd rounds native first.
pair() {
  local round=$1 job=$2 t=$3
  shift 3
  if [ ! -x "$1" ] && [ "$1" = "$BENCH" ] && [ "$DRY" != 1 ]; then
    echo "$round native $job EXIT rc=notbuilt s=0" >>"$RAW"
    echo "$round shim $job EXIT rc=notbuilt s=0" >>"$RAW"
    return
  fi
  if [ $((round % 2)) = 1 ]; then
    run_one "$round" native "$job" "$t" "$@"
    run_one "$round" shim "$job" "$t" "$@"
  else
    run_one "$round" shim "$job" "$t" "$@"
    run_one "$round" native "$job" "$t" "$@"
  fi
}

TORCH=(python3 tests/gpu/bench_torch.py)
last=0
LEGACY_JOBS=""
sel churn && LEGACY_JOBS="$LEGACY_JOBS churn"
sel many && LEGACY_JOBS="$LEGACY_JOBS many"
sel oom && LEGACY_JOBS="$LEGACY_JOBS oom"
sel align && LEGACY_JOBS="$LEGACY_JOBS align"
sel torchspeed && LEGACY_JOBS="$LEGACY_JOBS torch-default torch-async torch-expandable"
[ "$LEGACY" = 1 ] || ROUNDS=0
for ((r = 1; r <= ROUNDS; r++)); do
  if [ "$r" -gt 1 ] && [ $((SECONDS - START + last)) -gt "$BUDGET" ]; then
    echo "== rounds $r..$ROUNDS skipped: round $((r - 1)) took $last s, $((SECONDS - START)) of ${BUDGET} s spent"
    echo "skipped rounds $r..$ROUNDS (budget ${BUDGET} s)" >>"$RAW"
    break
  fi
  rs=$SECONDS
  echo "== round $r of $ROUNDS ($((SECONDS - START)) s so far)"
  if sel churn && [ "$KEEPER" = beside ] && [ -x "$BENCH" -o "$DRY" = 1 ]; then keeper_churn "$r"
  elif sel churn; then pair "$r" churn 120 "$BENCH" churn; fi
  sel many && pair "$r" many 150 "$BENCH" many
  sel oom && pair "$r" oom 150 "$BENCH" oom
  sel align && [ "$r" = 1 ] && pair "$r" align 60 "$BENCH" align
  if sel torchspeed; then
    pair "$r" torch-default 150 "${TORCH[@]}" default
    pair "$r" torch-async 150 env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync "${TORCH[@]}" async
    pair "$r" torch-expandable 150 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${TORCH[@]}" expandable
  fi
  last=$((SECONDS - rs))
done

legacy_rc=0
if [ "$LEGACY" = 1 ]; then
echo
KEEPER=$KEEPER python3 - "$RAW" "$W/table.md" "$((SECONDS - START))" "$W" "$LEGACY_JOBS" "$DRY" <<'EOF'
import os, statistics, sys

raw, table_path, elapsed, wdir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
beside = os.environ.get("KEEPER") == "beside"  # native column: the shim without a keeper
selected, dry = set(sys.argv[5].split()), sys.argv[6] == "1"
data = {}    # case -> side -> round -> {key: value}
status = {}  # job -> side -> round -> rc text
device, skipped = "unknown", ""
for line in open(raw):
    w = line.split()
    if line.startswith("device:"):
        device = line[len("device:"):].strip()
        continue
    if line.startswith("skipped rounds"):
        skipped = line.strip()
        continue
    if len(w) < 4 or not w[0].isdigit():
        continue
    rnd, side, job = int(w[0]), w[1], w[2]
    if w[3] == "EXIT":
        kv = dict(x.split("=", 1) for x in w[4:] if "=" in x)
        status.setdefault(job, {}).setdefault(side, {})[rnd] = kv.get("rc", "?")
    elif w[3] == "R" and len(w) > 4:
        kv = dict(x.split("=", 1) for x in w[5:] if "=" in x)
        data.setdefault(w[4], {}).setdefault(side, {})[rnd] = kv

def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None

def size(b):
    if b is None:
        return "–"
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"

def why_missing(job, side, rnd):
    rc = status.get(job, {}).get(side, {}).get(rnd)
    if rc is None:
        return "did not run"
    if rc in ("124", "137"):
        return "timed out"
    if rc == "skipped":
        return "skipped (budget)"
    if rc == "notbuilt":
        return "not built"
    if rc == "dry":
        return "dry run"
    if rc == "0":
        return "no result"
    try:
        if int(rc) > 128:
            return f"crashed (signal {int(rc) - 128})"
    except ValueError:
        pass
    return f"exit {rc}"

API = {"sync": "cudaMalloc+cudaFree", "async": "cudaMallocAsync+cudaFreeAsync"}
ROWS = []
# A cudaFree beyond VMMSHIM_GIVE_BACK_HOLD (64 MiB) goes back at once, as natively (issue 27): a
# large pair then costs a real free and allocation, as native's does, so its bound is 1.0x.
for api, limit in (("sync", 0.2), ("async", 1.0)):
    for sz in ("4KiB", "2MiB", "64MiB", "1GiB"):
        ROWS.append(dict(label=f"same-size churn {sz[:-3]} {sz[-3:]}, {API[api]}", job="churn", case=f"pair/{api}/{sz}",
                         kind="time", key="us", unit="µs/pair", max=1.0 if sz == "1GiB" else limit))
for api, limit in (("sync", 1.0), ("async", 1.3)):
    ROWS.append(dict(label=f"mixed churn 256 B..256 MiB, {API[api].replace('+', '/')}", job="churn", case=f"mix/{api}",
                     kind="time", key="us", unit="µs/op", max=limit))
for sz in ("4KiB", "1MiB"):
    for n in (10000, 50000):
        ROWS.append(dict(label=f"{n} x {sz[:-3]} {sz[-3:]} live, cudaMalloc", job="many", case=f"many/{sz}/{n}", kind="many"))
for sz, what in (("4KiB", "4 KiB blocks"), ("1MiB", "1 MiB blocks"), ("64MiB", "64 MiB blocks"), ("mix", "mixed sizes")):
    ROWS.append(dict(label=f"OOM reach, cudaMalloc {what}", job="oom", case=f"oom/{sz}", kind="reach", min=0.99))
# A ~17 ms step of small kernels varies about 15% from process to process whatever the allocator
# (issue 15), more than the 2% asked: these rows report, and the <= 1.02x criterion is judged on
# bench_mem.py's GPU-bound step, alternated over STEP_ROUNDS rounds.
for conf, label in (("default", "default allocator"), ("async", "backend:cudaMallocAsync"),
                    ("expandable", "expandable_segments:True")):
    ROWS.append(dict(label=f"PyTorch step, {label}", job=f"torch-{conf}", case=f"torch/{conf}", kind="time",
                     key="step_ms", unit="ms", max=None,
                     report="report only (small kernels: ±15% per process; ≤ 1.02x is the GPU-bound step's)"))
for conf, label in (("default", "default allocator"), ("async", "backend:cudaMallocAsync"),
                    ("expandable", "expandable_segments:True")):
    ROWS.append(dict(label=f"PyTorch reserved peak, {label}", job=f"torch-{conf}", case=f"torch/{conf}", kind="torchmem",
                     within=0.10 if conf == "async" else None))

def ran_rounds(job):
    """Rounds in which both sides of the job got their turn (the budget may cut a round short)."""
    st = status.get(job, {})
    rounds = set(st.get("native", {})) | set(st.get("shim", {}))
    return sorted(r for r in rounds if "skipped" not in (st.get("native", {}).get(r), st.get("shim", {}).get(r)))

def ratios_text(rs):
    if not rs:
        return "–"
    return f"{min(rs):.2f}–{max(rs):.2f} ({' '.join(f'{x:.2f}' for x in rs)})"

def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None

out_rows, passed, failed = [], 0, 0
for row in ROWS:
    case, job = row["case"], row["job"]
    if job not in selected:
        continue
    rounds = ran_rounds(job)
    runs = {s: data.get(case, {}).get(s, {}) for s in ("native", "shim")}
    notes = []
    broken = False  # a run that crashed, timed out or printed nothing fails its row
    for side in ("native", "shim"):
        why = {}
        for r in rounds:
            if r not in runs[side]:
                why.setdefault(why_missing(job, side, r), []).append(str(r))
                broken = True
        for reason, rs in why.items():
            notes.append(f"{side}: {reason} (round {', '.join(rs)})")
    if not rounds:
        notes.append("did not run")
    both = [r for r in rounds if r in runs["native"] and r in runs["shim"]]
    kind = row["kind"]
    nat = shim = ratio = None
    per = []
    ncell = scell = "–"
    ok = None  # None: report only
    if kind == "time":
        key = row["key"]
        nv = {r: num(runs["native"][r].get(key)) for r in both}
        sv = {r: num(runs["shim"][r].get(key)) for r in both}
        nat, shim = med(nv.values()), med(sv.values())
        per = [sv[r] / nv[r] for r in both if nv[r] and sv[r] is not None]
        ratio = shim / nat if nat and shim is not None else None
        def cell(side, v):
            if v is None:
                return "–"
            text = f"{v:.3f} {row['unit']}" if v < 10 else f"{v:.1f} {row['unit']}"
            fails = sum(int(num(runs[side][r].get("fail")) or 0) for r in both)
            if case.startswith("mix/") or fails:
                text += f", {fails} failed"
            if any(runs[side][r].get("timeout") == "1" for r in both):
                text += " (stopped at the time limit)"
            return text
        ncell, scell = cell("native", nat), cell("shim", shim)
        if beside and row.get("max") is not None:  # issue 17: within 2% of the run without a keeper
            # churn's two sides are one process each round (keeper_churn): judged as pairs
            paired = job == "churn" and bool(per)
            if paired:
                ratio = statistics.median(per)
            crit = "≤ 1.02x the shim without a keeper" + (" (median of per-round ratios, one process each)"
                                                         if paired else "")
            ok = ratio is not None and ratio <= 1.02
        elif row.get("max") is not None:
            crit = f"≤ {row['max']:g}x"
            ok = ratio is not None and ratio <= row["max"]
        else:
            crit = row.get("report", "report only")
    elif kind == "many":
        g = lambda side, k: med([num(runs[side][r].get(k)) for r in both])
        nb, sb, nf, sf = g("native", "bytes"), g("shim", "bytes"), g("native", "fail"), g("shim", "fail")
        nat, shim = nb, sb
        per = [num(runs["shim"][r].get("bytes")) / num(runs["native"][r].get("bytes")) for r in both
               if num(runs["native"][r].get("bytes")) and num(runs["shim"][r].get("bytes")) is not None]
        ratio = sb / nb if nb and sb is not None else None
        if both:
            ncell = f"{size(nb)}, {nf:.0f} failed, {g('native', 'us'):.1f} µs/call"
            rec, nx = g("shim", "records"), g("shim", "notexp")
            scell = f"{size(sb)}, {sf:.0f} failed, {g('shim', 'us'):.1f} µs/call, " + (
                f"{rec:.0f} records ({nx:.0f} not exportable)" if rec is not None else "records n/a")
            if any(runs[s][r].get("timeout") == "1" for s in ("native", "shim") for r in both):
                notes.append("stopped at the time limit")  # fewer calls: the counts would flatter
                broken = True
        crit = "fails ≤ native, bytes ≤ 1.1x + 64 MiB"
        ok = None not in (nb, sb, nf, sf) and sf <= nf and sb <= 1.1 * nb + (64 << 20)
    elif kind == "reach":
        g = lambda side, k: med([num(runs[side][r].get(k)) for r in both])
        nat, shim = g("native", "reach"), g("shim", "reach")
        per = [num(runs["shim"][r].get("reach")) / num(runs["native"][r].get("reach")) for r in both
               if num(runs["native"][r].get("reach"))]
        ratio = shim / nat if nat and shim is not None else None
        if both:
            ncell = f"{size(nat)} ({size(g('native', 'ballast'))} ballast)"
            rec, nx = g("shim", "records"), g("shim", "notexp")
            scell = f"{size(shim)} ({size(g('shim', 'ballast'))} ballast), " + (
                f"{nx:.0f} of {rec:.0f} records not exportable" if rec is not None else "records n/a")
            for s in ("native", "shim"):
                stops = {runs[s][r].get("stopped") for r in both} - {"oom"}
                if stops:  # "cap", "time" or "ballast": not the device's limit
                    notes.append(f"{s} stopped by: {', '.join(sorted(stops))}")
                    broken = True
        crit = f"≥ {row['min']:g}x"
        ok = ratio is not None and ratio >= row["min"]
    elif kind == "torchmem":
        def peak(side, r):  # the async backend reports through memory_stats, the others too
            kv = runs[side][r]
            v = num(kv.get("reserved_peak"))
            return v if v is not None else num(kv.get("max_reserved"))
        nv = {r: peak("native", r) for r in both}
        sv = {r: peak("shim", r) for r in both}
        nat, shim = med(nv.values()), med(sv.values())
        per = [sv[r] / nv[r] for r in both if nv[r] and sv[r] is not None]
        ratio = shim / nat if nat and shim is not None else None
        if both:
            def cell(side, v):
                ap = med([num(runs[side][r].get("allocated_peak")) for r in both])
                mr = med([num(runs[side][r].get("max_reserved")) for r in both])
                return f"{size(v)} reserved peak, {size(ap)} allocated peak, max_memory_reserved {size(mr)}"
            ncell, scell = cell("native", nat), cell("shim", shim)
        if row["within"] is not None:
            crit = f"within {row['within']:.0%}"
            ok = ratio is not None and abs(ratio - 1) <= row["within"]
        else:
            crit = "report only"
    if ok is not None and (not both or broken):
        ok = False
    if dry:  # nothing ran: the row shows what would have, and counts for nothing
        ok, crit = None, crit + " (dry run, not counted)"
    if ok is not None:
        passed, failed = passed + bool(ok), failed + (not ok)
    verdict = crit if ok is None else f"{crit}: {'PASS' if ok else 'FAIL'}"
    ratio_text = f"{ratio:.2f}" if ratio is not None else "–"
    label = row["label"] + (f" — {'; '.join(notes)}" if notes else "")
    out_rows.append(f"| {label} | {ncell} | {scell} | {ratio_text} | {ratios_text(per)} | {verdict} |")

n_rounds = len(set().union(*[set(ran_rounds(j)) for j in status])) if status else 0
keeper = os.environ.get("KEEPER") == "1"
head = ("| case | shim, no keeper (median) | shim + keeper (median) | with/without keeper | per-round with/without: "
        "min–max (each) | criterion |" if beside else
        "| case | native (median) | shim (median) | shim/native | per-round shim/native: min–max (each) | criterion |")
lines = [f"bench: {device}, {elapsed} s, {n_rounds} round(s)"
         + ("; the shim side with a keeper attached (vmmctl keep --all)" if keeper else "")
         + ("; both sides under the shim, the second with a keeper attached (vmmctl keep --all)" if beside else "")
         + (f"; {skipped}" if skipped else "") + f"; raw results in {wdir}", "", head,
         "|---|---|---|---|---|---|"] + out_rows

# alignment: round 1 only, no ratios
al = sorted({int(c.split("/")[2]) for c in data if c.startswith("align/")})
if "align" not in selected:
    pass
elif al:
    def a(api, sz, side, key):
        v = num(data.get(f"align/{api}/{sz}", {}).get(side, {}).get(1, {}).get(key))
        return "–" if v is None else size(v).replace(".00 ", " ")
    lines += ["", "Alignment (largest power of two dividing all 32 addresses, capped at 2 MiB) and smallest gap between "
              "32 live blocks, native / shim:", "",
              "| size | cudaMalloc align | cudaMalloc min gap | cudaMallocAsync align | cudaMallocAsync min gap |",
              "|---|---|---|---|---|"]
    def size_label(sz):
        for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            for off, sign in ((0, ""), (1, " + 1 B"), (-1, " − 1 B")):
                if sz - off >= f and (sz - off) % f == 0:
                    return f"{(sz - off) // f} {unit}{sign}"
        return f"{sz} B"
    for sz in al:
        cells = [f"{a(api, sz, 'native', k)} / {a(api, sz, 'shim', k)}" for api in ("malloc", "async") for k in ("align", "gap")]
        lines.append(f"| {size_label(sz)} | " + " | ".join(cells) + " |")
else:
    lines += ["", "Alignment: no results (" + why_missing("align", "native", 1) + ")"]
lines += ["", f"bench: {passed} passed, {failed} failed"]
text = "\n".join(lines)
print(text)
open(table_path, "w").write(text + "\n")
sys.exit(0 if failed == 0 else 1)
EOF
  legacy_rc=$?
fi

mem_rc=0
if [ -n "$MEMSEL" ]; then
  echo
  # shellcheck disable=SC2086 # MEMSEL is a list of job names
  BENCH_SHIM="$B/libvmmshim.so" BENCH_MEM_BIN="$BENCH_MEM" BENCH_DRY="$DRY" BENCH_KEEPER="$KEEPER" BENCH_VMMCTL="$B/vmmctl" \
    python3 tests/gpu/bench_mem.py $MEMSEL
  mem_rc=$?
fi
if [ "$LEGACY" = 1 ] && [ -n "$MEMSEL" ]; then # the two closing lines, summed
  p=0 f=0
  for t in "$W/table.md" "$W/mem-table.md"; do
    l=$(grep -E '^bench(-mem)?: [0-9]+ passed, [0-9]+ failed' "$t" 2>/dev/null | tail -n 1)
    l=${l:-"x: 0 passed, 1 failed"} # a table that never got written counts as one failure
    p=$((p + $(printf '%s' "$l" | sed -E 's/.*: ([0-9]+) passed.*/\1/')))
    f=$((f + $(printf '%s' "$l" | sed -E 's/.* ([0-9]+) failed.*/\1/')))
  done
  echo
  echo "bench: total $p passed, $f failed (cost table and memory table)"
fi
[ "$legacy_rc" = 0 ] && [ "$mem_rc" = 0 ]
