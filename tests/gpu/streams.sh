#!/usr/bin/env bash
# Issue 38's bench on two GPUs: PyTorch FSDP2 and DDP (tests/gpu/streams.py run), natively and under
# the shim, under the default allocator, expandable_segments:True and backend:cudaMallocAsync.  Each
# of STREAMS_ROUNDS (2) rounds runs every (mode, setting) both ways back to back, the side that goes
# first alternating by round; each shim run has a registry of its own.  Then streams.py table: per
# GPU max_memory_reserved, max_memory_allocated and NVML peak against native, the step, the losses.
# STREAMS_MODES (fsdp ddp), STREAMS_CONFS (default expandable async) pick rows.  STREAMS_DRY=good|
# twice|drift runs nothing on a GPU: streams.py dry's made-up outputs go through the table (CI).
# About 25 s a run, 24 runs.  Logs in ${OUT:-/tmp}/vmmshim-streams/.  Ends with
# "streams: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
G=$PWD/tests/gpu
W=${OUT:-/tmp}/vmmshim-streams
ROUNDS=${STREAMS_ROUNDS:-2}
DRY=${STREAMS_DRY:-}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
unset PYTORCH_CUDA_ALLOC_CONF NCCL_P2P_DISABLE
rm -rf "$W"
mkdir -p "$W"

if [ -n "$DRY" ]; then
  python3 "$G/streams.py" dry "$W" "$DRY" || exit 1
  exec python3 "$G/streams.py" table "$W"
fi
if [ ! -f "$B/libvmmshim.so" ]; then
  echo "FAIL $B/libvmmshim.so missing (build on the development machine, carry build/)"
  echo "streams: 0 passed, 1 failed"
  exit 1
fi
ngpu=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${ngpu:-0}" -lt 2 ]; then
  echo "FAIL needs two GPUs, found ${ngpu:-0}"
  echo "streams: 0 passed, 1 failed"
  exit 1
fi
timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader

conf_of() {
  case $1 in
    default) echo "" ;;
    expandable) echo "expandable_segments:True" ;;
    async) echo "backend:cudaMallocAsync" ;;
  esac
}
one() { # ROUND SIDE CONF MODE
  local f=$W/$1.$2.$3.$4 rc t0=$SECONDS
  if [ "$2" = shim ]; then
    env PYTORCH_CUDA_ALLOC_CONF="$(conf_of "$3")" LD_PRELOAD="$B/libvmmshim.so" \
      VMMSHIM_REGISTRY="/vmmshim-streams-$$-$1$3$4" timeout -k 5 180 python3 "$G/streams.py" run "$4" >"$f.out" 2>"$f.err"
    rc=$?
    rm -f "/dev/shm/vmmshim-streams-$$-$1$3$4"*
  else
    env PYTORCH_CUDA_ALLOC_CONF="$(conf_of "$3")" timeout -k 5 180 python3 "$G/streams.py" run "$4" >"$f.out" 2>"$f.err"
    rc=$?
  fi
  echo "round $1 $2 $3 $4: exit $rc, $((SECONDS - t0)) s $(grep -h '^R streams rank=0' "$f.out" | cut -d' ' -f5-)"
  [ "$rc" = 0 ] || tail -n 5 "$f.err" | sed 's/^/  stderr: /'
  grep -m 2 'vmmshim:' "$f.err" | sed 's/^/  /'
}
for ((r = 1; r <= ROUNDS; r++)); do
  for mode in ${STREAMS_MODES:-fsdp ddp}; do
    for conf in ${STREAMS_CONFS:-default expandable async}; do
      if [ $((r % 2)) = 1 ]; then one $r native "$conf" "$mode"; one $r shim "$conf" "$mode"
      else one $r shim "$conf" "$mode"; one $r native "$conf" "$mode"; fi
    done
  done
done
python3 "$G/streams.py" table "$W"
