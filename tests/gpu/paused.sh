#!/usr/bin/env bash
# Work while paused (issue 37) on a GPU machine, with build/ carried from a development machine:
#   tests/gpu/paused.sh            [PAUSED_PARTS="work jax fsdp hybrid"]
# work    tests/gpu/paused_work.py under the shim, one process per setting: default,
#         expandable-adopted (expandable_segments:True and VMMSHIM_SLEEP_ADOPTED=1; without the
#         latter a pause releases none of that memory), async (backend:cudaMallocAsync); each of
#         its 9 rows must print ok=1; then default with
#         VMMSHIM_PAUSE_GUARD=1 and --guard (a kernel on paused memory on purpose), whose pause times
#         against the unguarded default's are the guard's cost
# jax     tests/gpu/paused_jax.py, XLA's default allocator and XLA_PYTHON_CLIENT_ALLOCATOR=platform:
#         reported, not judged (what works under JAX)
# fsdp    (2 GPUs) tests/gpu/fsdp_sleep.py fsdp natively, then under the shim with --sleep, per
#         setting default, expandable-adopted, async: collectives ok while paused, losses equal
# hybrid  (2 GPUs) tests/gpu/fsdp_sleep.py hybrid natively, then under the shim with --sleep, default
#         and async: tokens and losses equal
# Every process's output: ${OUT:-/tmp}/vmmshim-paused/NAME.{out,err}; the "R " lines, the comparisons'
# PASS/FAIL lines, and "paused: N passed, N failed" at the end.
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
B=${BUILD:-build}
case $B in /*) ;; *) B=$ROOT/$B ;; esac
W=${OUT:-/tmp}/vmmshim-paused
PARTS=${PAUSED_PARTS:-work jax fsdp hybrid}
mkdir -p "$W"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 VMMSHIM_CLIENT_LIB=$B/libvmmshim-client.so
export VMMSHIM_REGISTRY=/vmmshim-paused-$$ VMMSHIM_BROKER_DIR=$W/brokers
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset LD_PRELOAD PYTORCH_CUDA_ALLOC_CONF VMMSHIM_SLEEP_ADOPTED
pass=0 fail=0
ok() { echo "PASS $*"; pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
conf() { # the PYTORCH_CUDA_ALLOC_CONF and shim settings of a setting's name
  case $1 in
    default) echo "" ;;
    expandable) echo "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" ;;
    expandable-adopted) echo "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VMMSHIM_SLEEP_ADOPTED=1" ;;
    async) echo "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" ;;
  esac
}
run() { # NAME TIMEOUT ENV... -- CMD...: its output in $W/NAME.out, stderr in .err; the R lines shown
  local name=$1 t=$2
  shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  timeout "$t" env "${envs[@]}" "$@" >"$W/$name.out" 2>"$W/$name.err"
  local rc=$?
  grep -h '^R \|^rank ' "$W/$name.out" | grep '^R ' | sed "s/^/[$name] /"
  return $rc
}
SHIM=LD_PRELOAD=$B/libvmmshim.so

for part in $PARTS; do
  case $part in
  work)
    for s in default expandable-adopted async; do
      run "work-$s" 150 $SHIM PAUSED_SETTING=$s CUDA_LAUNCH_BLOCKING=1 $(conf "$s") -- python3 tests/gpu/paused_work.py
      rc=$?
      rows=$(grep -c '^R work .* ok=1' "$W/work-$s.out")
      [ $rc = 0 ] && [ "$rows" -ge 9 ] && ok "work while paused, $s: $rows rows ok" ||
        bad "work while paused, $s: rc $rc, $(grep '^R work .* ok=0' "$W/work-$s.out" | head -3 | tr '\n' ' ') $(tail -2 "$W/work-$s.err" | tr '\n' ' ')"
    done
    run work-guard 150 $SHIM PAUSED_SETTING=default-guard VMMSHIM_PAUSE_GUARD=1 CUDA_LAUNCH_BLOCKING=1 -- \
      python3 tests/gpu/paused_work.py --guard
    rc=$?
    grep -q "kernels wrote .* bytes into paused memory" "$W/work-guard.err" && g=1 || g=0
    [ $rc = 0 ] && [ $g = 1 ] && ok "guard: a kernel on paused memory neither faults nor corrupts, and the resume says so" ||
      bad "guard: rc $rc, warning $g: $(grep 'ok=0' "$W/work-guard.out" | head -2 | tr '\n' ' ') $(tail -2 "$W/work-guard.err" | tr '\n' ' ')"
    ;;
  jax)
    for a in default platform; do
      e=()
      [ $a = platform ] && e=(XLA_PYTHON_CLIENT_ALLOCATOR=platform)
      run "jax-$a" 120 $SHIM VMMSHIM_SLEEP_ADOPTED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false "${e[@]}" -- python3 tests/gpu/paused_jax.py
      echo "NOTE jax $a: rc $?"
    done
    ;;
  fsdp)
    for s in default expandable-adopted async; do
      run "fsdp-native-$s" 200 $(conf "$s") -- python3 tests/gpu/fsdp_sleep.py fsdp | grep fsdp_done
      run "fsdp-$s" 200 $SHIM $(conf "$s") -- python3 tests/gpu/fsdp_sleep.py fsdp --sleep
      rc=$?
      grep '^rank .* loss ' "$W/fsdp-native-$s.out" >"$W/fsdp-native.losses"
      grep '^rank .* loss ' "$W/fsdp-$s.out" >"$W/fsdp-$s.losses"
      n=$(grep -c 'collectives_ok=1' "$W/fsdp-$s.out")
      [ $rc = 0 ] && [ "$n" = 4 ] && ok "fsdp $s: barrier and all_reduce over NCCL while paused, 2 cycles x 2 ranks" ||
        bad "fsdp $s: rc $rc, $n of 4 cycles ok: $(tail -3 "$W/fsdp-$s.err" | tr '\n' ' ')"
      if [ -s "$W/fsdp-$s.losses" ] && cmp -s "$W/fsdp-native.losses" "$W/fsdp-$s.losses"; then
        ok "fsdp $s: losses bit-identical to native ($(wc -l <"$W/fsdp-$s.losses") lines)"
      else bad "fsdp $s: losses differ from native: $(diff "$W/fsdp-native.losses" "$W/fsdp-$s.losses" | head -4 | tr '\n' ' ')"; fi
    done
    # the first pause with its buffers pinned ahead in the background (prepare_pause) against a later one
    run fsdp-prepared 200 $SHIM FSDP_PREPARE=1 -- python3 tests/gpu/fsdp_sleep.py fsdp --sleep
    rc=$?
    grep '^rank .* loss ' "$W/fsdp-prepared.out" >"$W/fsdp-prepared.losses"
    grep '^rank .* loss ' "$W/fsdp-native-default.out" >"$W/fsdp-native.losses"
    first=$(grep 'cycle=0' "$W/fsdp-prepared.out" | sed 's/.*pause_s=\([0-9.]*\).*/\1/' | sort -n | tail -1)
    later=$(grep 'cycle=1' "$W/fsdp-prepared.out" | sed 's/.*pause_s=\([0-9.]*\).*/\1/' | sort -n | tail -1)
    if [ $rc = 0 ] && cmp -s "$W/fsdp-native.losses" "$W/fsdp-prepared.losses" &&
       awk -v f="$first" -v l="$later" 'BEGIN { exit !(f > 0 && f <= 2 * l) }'; then
      ok "fsdp prepared: first pause ${first} s within 2x of a later one (${later} s), losses bit-identical"
    else bad "fsdp prepared: rc $rc, first pause ${first} s, later ${later} s"; fi
    ;;
  hybrid)
    for s in default async; do
      run "hybrid-native-$s" 240 $(conf "$s") -- python3 tests/gpu/fsdp_sleep.py hybrid
      run "hybrid-$s" 240 $SHIM $(conf "$s") -- python3 tests/gpu/fsdp_sleep.py hybrid --sleep
      rc=$?
      grep '^rank ' "$W/hybrid-native-$s.out" >"$W/hybrid-native-$s.lines"
      grep '^rank ' "$W/hybrid-$s.out" >"$W/hybrid-$s.lines"
      n=$(grep -c ' tokens ' "$W/hybrid-$s.lines")
      if [ $rc = 0 ] && [ "$n" -gt 0 ] && cmp -s "$W/hybrid-native-$s.lines" "$W/hybrid-$s.lines"; then
        ok "hybrid $s: the rollout generated while the trainer slept, tokens and losses bit-exact against native ($n token lines)"
      else bad "hybrid $s: rc $rc, $(diff "$W/hybrid-native-$s.lines" "$W/hybrid-$s.lines" | head -4 | tr '\n' ' ') $(tail -3 "$W/hybrid-$s.err" | tr '\n' ' ')"; fi
    done
    ;;
  esac
done
[ -x "$B/vmmctl" ] && "$B/vmmctl" gc >/dev/null 2>&1
rm -f "/dev/shm$VMMSHIM_REGISTRY"
echo "paused: $pass passed, $fail failed"
[ $fail = 0 ]
