#!/usr/bin/env bash
# `vmmctl keep` on a real GPU (one GPU; build/ carried from a development machine; about 5 minutes
# for every variant, each well under 10).  For each variant a trainer (tests/gpu/keep_train.py)
# runs under the shim with a keeper attached (`vmmctl keep PID --on-exit dump DIR`), prints after
# every synchronized step the FNV-1a of each parameter and the logits of a fixed probe batch, then
# the XXH3-64 of each of its allocations (the dump manifest's checksum), and dies; then:
#   - the keeper says how it died (SIGKILL, or SIGSEGV) and that it keeps its allocations;
#   - the dump the keeper wrote by itself: every allocation the trainer listed, with its checksum,
#     and the manifest naming the keeper and the signal;
#   - `vmmctl list --all` shows the dead pid's allocations kept;
#   - a companion (keep_check.py) opens the dead pid's named tensors (Registry.open_tensors): each
#     one's FNV-1a is the trainer's last, and the model rebuilt from them gives the trainer's last
#     logits;
#   - `vmmctl release PID`: the keeper stops, and NVML's used memory drops by what it held;
#     `vmmctl gc` reclaims the records.
# Variants (KEEP_ONLY, comma-separated; default all): torch-kill (default caching allocator,
# SIGKILL), torch-segv (os.kill SIGSEGV), torch-expandable (expandable_segments:True),
# torch-async (backend:cudaMallocAsync), jax (JAX's default allocator, the preallocating BFC arena,
# XLA_PYTHON_CLIENT_MEM_FRACTION=.05).  A variant whose framework is missing is skipped.
# KEEP_DRY=1: no GPU: the stand-in trainer (keep_train.py stub) over the emulated driver
# (build/fakecuda), variants stub-kill and stub-segv, NVML rows skipped: a check of this script.
# KEEP_STEPS (20).  Prints PASS/FAIL lines and "keep: N passed, N failed"; files in
# ${OUT:-/tmp}/vmmshim-keep.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-keep
rm -rf "$W"
mkdir -p "$W"
DRY=${KEEP_DRY:-0}
STEPS=${KEEP_STEPS:-20}
export VMMSHIM_REGISTRY=/vmmshim-keep-$$ VMMSHIM_BROKER_DIR=$W/brokers PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export VMMSHIM_CLIENT_LIB=$B/libvmmshim-client.so PYTHONPATH=$PWD/tools/python:$PWD/tests/gpu
export KEEP_SUM_LIB=$B/tests/libchecksums.so
[ "$DRY" = 1 ] && export LD_LIBRARY_PATH=$B/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
pass=0
fail=0
ok() {
  pass=$((pass + 1))
  echo "PASS $*"
}
bad() {
  fail=$((fail + 1))
  echo "FAIL $*"
}
finish() {
  "$B/vmmctl" gc >/dev/null 2>&1
  rm -f "/dev/shm$VMMSHIM_REGISTRY" "/dev/shm$VMMSHIM_REGISTRY".*
  echo "keep: $pass passed, $fail failed"
  [ "$fail" = 0 ] && [ "$pass" -gt 0 ]
  exit $?
}
# wait_for FILE TEXT SECONDS: until FILE holds TEXT
wait_for() {
  local k
  for ((k = 0; k < $3 * 100; k++)); do
    grep -qF -- "$2" "$1" 2>/dev/null && return 0
    sleep 0.01
  done
  return 1
}
used_mib() { # NVML's used memory of GPU 0, MiB (nothing in a dry run)
  [ "$DRY" = 1 ] && return
  timeout 20 nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | tr -d ' '
}

[ -f "$KEEP_SUM_LIB" ] || {
  bad "$KEEP_SUM_LIB missing (make builds it; carry build/)"
  finish
}
if [ ! -x "$B/vmmctl" ] || [ ! -f "$B/libvmmshim.so" ]; then
  bad "$B/vmmctl or libvmmshim.so missing (build on the development machine, carry build/)"
  finish
fi

# name framework die environment...
if [ "$DRY" = 1 ]; then
  VARIANTS="stub-kill:stub:kill: stub-segv:stub:segv:"
else
  VARIANTS="torch-kill:torch:kill: torch-segv:torch:segv: torch-expandable:torch:kill:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
  VARIANTS="$VARIANTS torch-async:torch:kill:PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"
  VARIANTS="$VARIANTS jax:jax:kill:XLA_PYTHON_CLIENT_MEM_FRACTION=.05"
fi
ONLY=",${KEEP_ONLY:-all},"

# dump_rate NAME DIR: the keeper's dump rate against what the dump's directory takes from dd, the
# same bytes (at most 4 GiB) written the same way (through the page cache, no sync): the dump may
# not be slower than 0.9x that bound (pinned device-to-host copies are far faster: tests/gpu/dump.sh).
# Judged from 1 GiB up; a smaller dump's rate is reported only.
dump_rate() {
  local name=$1 d=$2 bytes="" secs="" rate ref t0 t1 mib
  read -r bytes secs < <(grep -m1 '^dumped ' "$d/keeper.out" 2>/dev/null |
    sed -nE 's/.*: ([0-9]+) bytes .* in ([0-9.]+) s, .*/\1 \2/p')
  [ -n "$bytes" ] && [ -n "$secs" ] || return 0
  mib=$(((bytes >> 20) + 1))
  [ "$mib" -gt 4096 ] && mib=4096
  t0=$(date +%s.%N)
  dd if=/dev/zero of="$d/dumps/dd-ref.bin" bs=1M count="$mib" status=none 2>/dev/null
  t1=$(date +%s.%N)
  rm -f "$d/dumps/dd-ref.bin"
  read -r rate ref < <(awk -v b="$bytes" -v s="$secs" -v m="$mib" -v a="$t0" -v z="$t1" \
    'BEGIN { printf "%.2f %.2f\n", b / s / 1e9, m * 1048576 / (z - a) / 1e9 }')
  echo "$name: the keeper's dump: $rate GB/s; dd into the same directory: $ref GB/s"
  if [ "$bytes" -lt $((1 << 30)) ] || [ "$DRY" = 1 ]; then return 0; fi
  if awk -v r="$rate" -v f="$ref" 'BEGIN { exit !(r >= 0.9 * f) }'; then
    ok "$name: the keeper's dump at $rate GB/s, >= 0.9x what its directory takes ($ref GB/s)"
  else bad "$name: the keeper's dump at $rate GB/s, under 0.9x what its directory takes ($ref GB/s)"; fi
}

run_variant() {
  local name=$1 fw=$2 die=$3 envs=$4 d=$W/$1 l pid="" kp kept_mib before after
  mkdir -p "$d"
  echo "== $name"
  case $fw in
    torch) python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || {
      echo "SKIP $name: no PyTorch with CUDA"
      return
    } ;;
    jax) python3 -c "import jax; assert jax.devices()[0].platform == 'gpu'" 2>/dev/null || {
      echo "SKIP $name: no JAX on a GPU"
      return
    } ;;
  esac
  # The trainer's parent reaps it only once $d/reap exists, so that the keeper reads how it died
  # from its zombie (a shell would reap it at once; torchrun polls its workers, and loses the race
  # less often): the keeper's "unknown: vanished" is the fallback, not what is tested here.
  rm -f "$d/reap"
  # shellcheck disable=SC2086 # envs is empty or one NAME=VALUE
  coproc TR { env $envs LD_PRELOAD="$B/libvmmshim.so" timeout -k 5 500 python3 -c '
import os, subprocess, sys, time
p = subprocess.Popen(sys.argv[2:])
while not os.path.exists(sys.argv[1]) and p.poll() is None:
    time.sleep(0.05)
while p.poll() is None:
    time.sleep(0.05)  # wait4 only now
sys.exit(p.returncode if p.returncode >= 0 else 128 - p.returncode)' "$d/reap" python3 -u tests/gpu/keep_train.py "$fw" "$STEPS" "$die" 2>"$d/trainer.err"; }
  local in=${TR[0]} out=${TR[1]}
  if read -r -t 120 l <&"$in" && [[ $l == ready* ]]; then pid=${l#ready }; fi
  if [ -z "$pid" ]; then
    bad "$name: the trainer did not start"
    tail -5 "$d/trainer.err"
    return
  fi
  "$B/vmmctl" keep "$pid" --on-exit dump "$d/dumps" >"$d/keeper.out" 2>&1 &
  kp=$!
  if ! wait_for "$d/keeper.out" "keeping (" 20; then
    bad "$name: the keeper did not start"
    cat "$d/keeper.out"
    kill -9 "$pid" "$kp" 2>/dev/null
    return
  fi
  echo go >&"$out"
  : >"$d/trainer.out"
  while read -r -t 400 l <&"$in"; do
    echo "$l" >>"$d/trainer.out"
    [[ $l == final* ]] && break
  done
  if ! grep -q '^final' "$d/trainer.out"; then
    bad "$name: the trainer did not finish its steps"
    tail -5 "$d/trainer.err"
    kill -9 "$pid" "$kp" 2>/dev/null
    return
  fi
  echo "trainer pid $pid: $(grep -c '^fnv' "$d/trainer.out") parameter checksums, $(grep -c '^alloc' "$d/trainer.out") allocations"
  # what a failed name or record check below is read against: the living trainer's records and names
  { "$B/vmmctl" list --pid "$pid"; "$B/vmmctl" list --names --pid "$pid"; } >"$d/alive-list.txt" 2>&1
  local want="killed by signal 9 (SIGKILL)"
  if [ "$die" = kill ]; then
    sleep 1.5 # the trainer sleeps: all of it older than the keeper's settle time
    kill -9 "$pid"
  else
    want="killed by signal 11 (SIGSEGV)"
  fi
  if wait_for "$d/keeper.out" "$want: keeping" 60; then ok "$name: the keeper keeps the trainer's allocations ($want)"
  else
    bad "$name: the keeper did not keep them as '$want'"
    cat "$d/keeper.out"
  fi
  touch "$d/reap"
  if [ -n "${TR_PID:-}" ]; then wait "$TR_PID" 2>/dev/null; fi
  if wait_for "$d/keeper.out" "dump written to" 300; then ok "$name: the keeper wrote the dump itself"
  else bad "$name: no dump from the keeper"; fi
  dump_rate "$name" "$d"
  if python3 - "$d/dumps/$pid/manifest.json" "$d/trainer.out" "$want" >"$d/manifest-check.txt" 2>&1 <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
allocs = [l.split()[1:] for l in open(sys.argv[2]) if l.startswith("alloc ")]
by = {a["address"]: a for a in m["allocations"]}
bad = [f"{a} {s} {f} -> {by.get(int(a, 16), {}).get('xxh3_64')} ({by.get(int(a, 16), {}).get('status')})"
       for a, s, f in allocs
       if by.get(int(a, 16), {}).get("xxh3_64") != f or by[int(a, 16)]["size"] != int(s)]
print("allocations", len(allocs), "mismatches", len(bad))
for b in bad: print("  ", b)
print("owner_ended", m.get("owner_ended"), "kept_by", m.get("kept_by"))
sys.exit(0 if allocs and not bad and m.get("owner_ended") == sys.argv[3] and m.get("kept_by") else 1)
PY
  then ok "$name: every allocation's dumped checksum is the trainer's last ($(head -1 "$d/manifest-check.txt"))"
  else
    bad "$name: the dump differs from the trainer's last checksums"
    cat "$d/manifest-check.txt"
  fi
  "$B/vmmctl" list --all --pid "$pid" >"$d/list.txt" 2>&1
  if grep -q " kept " "$d/list.txt" && grep -q "kept by keeper pid $kp" "$d/list.txt"; then ok "$name: vmmctl list --all shows them kept by $kp"
  else
    bad "$name: vmmctl list --all"
    cat "$d/list.txt"
  fi
  timeout -k 5 300 python3 tests/gpu/keep_check.py "$fw" "$pid" "$d/trainer.out" >"$d/check.txt" 2>&1
  local crc=$?
  if [ "$crc" != 0 ] && ! grep -q '^FAIL' "$d/check.txt"; then
    bad "$name: the companion exited with $crc"
    tail -5 "$d/check.txt"
  fi
  sed -E "s/^(PASS|FAIL) /\1 $name: /" "$d/check.txt" | grep -E '^(PASS|FAIL)'
  pass=$((pass + $(grep -c '^PASS' "$d/check.txt")))
  fail=$((fail + $(grep -c '^FAIL' "$d/check.txt")))
  grep -qE '^(PASS|FAIL)' "$d/check.txt" || {
    bad "$name: the companion printed nothing"
    tail -5 "$d/check.txt"
  }
  kept_mib=$(python3 - "$pid" <<'PY'
import sys, vmmshim
with vmmshim.Registry() as reg:  # the device memory the keeper holds: its chunks' places in the owner,
    # overlaps once (two multi-handle records can share a handle)
    spans = sorted((a.address - a.chunk_offset, a.address - a.chunk_offset + a.mapped_size)
                   for a in reg.allocations(int(sys.argv[1])) if a.flags & vmmshim.ALLOC_KEPT)
total = end = 0
for lo, hi in spans:
    total += max(0, hi - max(lo, end))
    end = max(end, hi)
print(total >> 20)
PY
)
  before=$(used_mib)
  if "$B/vmmctl" release "$pid" >"$d/release.txt" 2>&1; then ok "$name: vmmctl release ($(cat "$d/release.txt"))"
  else bad "$name: release: $(cat "$d/release.txt")"; fi
  if wait "$kp"; then ok "$name: the keeper stopped, nothing left to keep"
  else bad "$name: the keeper's exit status $?"; fi
  sleep 1
  after=$(used_mib)
  if [ -n "$before" ] && [ -n "$after" ]; then
    echo "NVML used: $before MiB kept, $after MiB after release; the keeper held $kept_mib MiB"
    if [ $((before - after)) -ge $((kept_mib * 9 / 10)) ]; then ok "$name: the memory is back after release ($((before - after)) MiB of $kept_mib)"
    else bad "$name: only $((before - after)) MiB of the $kept_mib MiB held came back"; fi
  else
    echo "note: $name: no NVML reading (dry run or no nvidia-smi): memory not checked"
  fi
  "$B/vmmctl" gc >"$d/gc.txt" 2>&1
  if grep -q "reclaimed [1-9][0-9]* records\? from 1 dead process" "$d/gc.txt"; then ok "$name: gc reclaimed the records ($(cat "$d/gc.txt"))"
  else bad "$name: gc: $(cat "$d/gc.txt")"; fi
}

for v in $VARIANTS; do
  IFS=: read -r name fw die envs <<<"$v"
  case $ONLY in *",all,"* | *",$name,"*) run_variant "$name" "$fw" "$die" "$envs" ;; esac
done
finish
