#!/usr/bin/env bash
# Two-GPU check: PyTorch DistributedDataParallel over NCCL (tests/gpu/ddp.py, mp.spawn of two
# ranks, a file:// store), natively and under the shim, under PyTorch's default caching allocator
# and under PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (each shim run compared with a native
# run of the same setting).  Needs a machine with two GPUs, python3 with torch, and build/
# carried from a development machine.  Checks, per setting:
#   - both runs finish and print 30 step losses per rank;
#   - "same losses": the result lines are identical (or, failing that, equal within a relative
#     1e-5, and the line says it was not bitwise);
#   - "NCCL buffers published": while the shim run is paused mid-training (rank 0 prints
#     "# pause PID0 PID1", every rank waits for a file this script creates), `vmmctl list
#     --json` has records with api "cuMemMap" (NCCL's cuMemCreate + cuMemMap buffers,
#     NCCL_CUMEM_ENABLE being on by default) for both ranks' pids; how many and their bytes;
#   - "NCCL buffers exportable": every such record has the broker handle kind;
#   - "PyTorch's memory published and exportable": both ranks have records of the api the
#     allocator calls (cudaMalloc, or cudaMallocAsync), all with the broker kind.
# NCCL_DEBUG=WARN, NCCL_NVLS_ENABLE=0 (no NVLink multicast), TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NCCL_P2P_DISABLE unset.  Every step is under `timeout`; about 2 minutes in all, at most about 7.
# Logs in ${OUT:-/tmp}/vmmshim-ddp/.
# Ends with "ddp: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
G=$PWD/tests/gpu
W=${OUT:-/tmp}/vmmshim-ddp
STEPS=30
export VMMSHIM_REGISTRY=/vmmshim-ddp-$$
export PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset NCCL_P2P_DISABLE
rm -rf "$W"
mkdir -p "$W"
pass=0 fail=0 bg=""
ok() { pass=$((pass + 1)); echo "PASS $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }
finish() {
  echo "ddp: $pass passed, $fail failed"
  [ "$fail" = 0 ]
  exit
}
# shellcheck disable=SC2317 # called by the trap
cleanup() {
  [ -n "$bg" ] && kill -0 "$bg" 2>/dev/null && kill -- "$bg" 2>/dev/null
  timeout 30 "$B/vmmctl" gc >/dev/null 2>&1
  rm -f "/dev/shm$VMMSHIM_REGISTRY" "$W/go"
}
trap cleanup EXIT

if [ ! -f "$B/libvmmshim.so" ] || [ ! -x "$B/vmmctl" ]; then
  bad "$B/libvmmshim.so or $B/vmmctl missing (build on the development machine, carry build/)"
  finish
fi
ngpu=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "== $ngpu GPUs"
timeout 30 nvidia-smi -L 2>&1 | head -4
if [ "${ngpu:-0}" -lt 2 ]; then
  bad "needs two GPUs, found ${ngpu:-0}"
  finish
fi

# One allocator setting: a native run, then the shim run paused for vmmctl, then the checks.
run_conf() { # TAG CONF API: CONF for PYTORCH_CUDA_ALLOC_CONF, API the records PyTorch's tensors make
  local tag=$1 conf=$2 api=$3 what nrc src nlines slines pids nrec trec cmpline summary n e
  what="${conf:-default allocator}"
  export PYTORCH_CUDA_ALLOC_CONF=$conf
  echo "== $what: native"
  rm -f "$W/store.native-$tag"
  timeout -k 5 80 python3 -u "$G/ddp.py" --init "file://$W/store.native-$tag" --steps $STEPS \
    >"$W/native-$tag.out" 2>"$W/native-$tag.err"
  nrc=$?
  nlines=$(grep -c '^rank [0-9]* step ' "$W/native-$tag.out")
  echo "native: exit $nrc, $nlines loss lines"
  grep -hE '^# torch|NCCL WARN' "$W/native-$tag.out" "$W/native-$tag.err" | head -n 5 | sed 's/^/  /'
  [ "$nrc" = 0 ] || tail -n 12 "$W/native-$tag.err" | sed 's/^/  native stderr: /'
  if [ "$nrc" = 0 ] && [ "$nlines" = $((2 * STEPS)) ]; then ok "$what: native DDP run: $nlines step losses"
  else bad "$what: native DDP run: exit $nrc, $nlines of $((2 * STEPS)) step losses"; fi

  echo "== $what: under the shim (paused at step 15 for vmmctl)"
  rm -f "$W/store.shim-$tag" "$W/go"
  timeout -k 5 120 env LD_PRELOAD="$B/libvmmshim.so" python3 -u "$G/ddp.py" --init "file://$W/store.shim-$tag" \
    --steps $STEPS --go-file "$W/go" >"$W/shim-$tag.out" 2>"$W/shim-$tag.err" &
  bg=$!
  pids=""
  for ((i = 0; i < 450; i++)); do # at most 90 s
    pids=$(sed -n 's/^# pause \([0-9][0-9 ]*\)$/\1/p' "$W/shim-$tag.out" | head -n 1)
    [ -n "$pids" ] && break
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.2
  done
  nrec=1 trec=1
  if [ -n "$pids" ]; then
    echo "paused: rank pids $pids"
    timeout 30 "$B/vmmctl" list --json >"$W/list-$tag.json" 2>"$W/list-$tag.err"
    timeout 30 "$B/vmmctl" list >"$W/list-$tag.txt" 2>&1
    tail -n 3 "$W/list-$tag.txt" | sed 's/^/  vmmctl: /'
    head -n 3 "$W/list-$tag.err" | sed 's/^/  vmmctl error: /'
    # shellcheck disable=SC2086 # the pids are words
    timeout 60 python3 "$G/regcheck.py" pids "$W/list-$tag.json" --api cuMemMap $pids >"$W/nccl-$tag.txt" 2>&1
    nrec=$?
    sed 's/^/  /' "$W/nccl-$tag.txt"
    # shellcheck disable=SC2086
    timeout 60 python3 "$G/regcheck.py" pids "$W/list-$tag.json" --api "$api" $pids >"$W/tensors-$tag.txt" 2>&1
    trec=$?
    sed 's/^/  /' "$W/tensors-$tag.txt"
    # a few NCCL-sized records, for a human
    grep '"api": "cuMemMap"' "$W/list-$tag.json" | head -n 2 | cut -c1-400 | sed 's/^/  record: /'
  else
    echo "no '# pause' line from the shim run"
  fi
  touch "$W/go"
  wait "$bg"
  src=$?
  bg=""
  slines=$(grep -c '^rank [0-9]* step ' "$W/shim-$tag.out")
  echo "shim: exit $src, $slines loss lines"
  grep -m 3 'vmmshim:' "$W/shim-$tag.err" | sed 's/^/  /'
  grep -h 'NCCL WARN' "$W/shim-$tag.out" "$W/shim-$tag.err" | head -n 5 | sed 's/^/  /'
  [ "$src" = 0 ] || tail -n 12 "$W/shim-$tag.err" | sed 's/^/  shim stderr: /'
  if [ "$src" = 0 ] && [ "$slines" = $((2 * STEPS)) ]; then ok "$what: DDP run under the shim: $slines step losses"
  else bad "$what: DDP run under the shim: exit $src, $slines of $((2 * STEPS)) step losses"; fi

  cmpline=$(timeout 60 python3 "$G/ddp.py" --compare "$W/native-$tag.out" "$W/shim-$tag.out" 2>&1 | tail -n 1)
  if [[ $cmpline == "same losses:"* ]] && [ "$nrc" = 0 ] && [ "$src" = 0 ]; then ok "$what: $cmpline"
  else bad "$what: same losses: $cmpline"; fi
  summary=$(tail -n 1 "$W/nccl-$tag.txt" 2>/dev/null)
  if [ "$nrec" = 0 ]; then ok "$what: NCCL buffers published: ${summary#api }"
  else bad "$what: NCCL buffers published: ${summary:-no listing}"; fi
  # "api cuMemMap: N records, B bytes (X MiB), E exportable, in K of P processes"
  n=$(sed -n 's/^api cuMemMap: \([0-9]*\) records.*/\1/p' "$W/nccl-$tag.txt" 2>/dev/null)
  e=$(sed -n 's/.*, \([0-9]*\) exportable, in .*/\1/p' "$W/nccl-$tag.txt" 2>/dev/null)
  if [ -n "$n" ] && [ "$n" -gt 0 ] && [ "$e" = "$n" ]; then ok "$what: NCCL buffers exportable: $e of $n cuMemMap records"
  else bad "$what: NCCL buffers exportable: ${e:-0} of ${n:-0} cuMemMap records"; fi
  summary=$(tail -n 1 "$W/tensors-$tag.txt" 2>/dev/null)
  n=$(sed -n "s/^api $api: \\([0-9]*\\) records.*/\\1/p" "$W/tensors-$tag.txt" 2>/dev/null)
  e=$(sed -n 's/.*, \([0-9]*\) exportable, in .*/\1/p' "$W/tensors-$tag.txt" 2>/dev/null)
  if [ "$trec" = 0 ] && [ -n "$n" ] && [ "$e" = "$n" ]; then ok "$what: PyTorch's memory published and exportable: ${summary#api }"
  else bad "$what: PyTorch's memory published and exportable: ${summary:-no listing}"; fi
}

run_conf default "" cudaMalloc
run_conf async "backend:cudaMallocAsync" cudaMallocAsync
finish
