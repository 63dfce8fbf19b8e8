#!/usr/bin/env bash
# The sleep table of issue 29 on one GPU, one command of at most 8 minutes (about 5 on an H100):
#   BUILD=build tests/gpu/sleep.sh        (build/ and .tms carried from a development machine)
# SLEEP_OUTER (2) outer rounds of SLEEP_SETTINGS (all five below); each runs one process per setting, the order reversed every other
# outer round, each process SLEEP_ROUNDS (3) pause/resume rounds of its own (the trainers and what
# they measure: tests/gpu/sleep_bench.py and sleep_bench_jax.py):
#   shim-default     sleep_bench.py under the shim, PyTorch's default caching allocator
#   shim-expandable  the same with expandable_segments:True and VMMSHIM_SLEEP_ADOPTED=1 (PyTorch maps
#                    that memory itself: the shim releases it through stand-in handles)
#   shim-async       the same with backend:cudaMallocAsync (no MemPool there: the region alone)
#   tms              sleep_bench.py --tms: torch_memory_saver's preload hook, no shim, the default
#                    allocator, its region() with CPU backup (built from its source outside the
#                    repository into ${TMS_DIR:-.tms}/site: the development checkout's .tms/build.sh;
#                    missing: its rows and comparisons SKIP)
#   jax              sleep_bench_jax.py under the shim with VMMSHIM_SLEEP_ADOPTED=1: pause() of it all
# then tests/gpu/sleep_table.py makes the table from every process's "R ..." lines and prints the
# targets' PASS/FAIL lines and "sleep: N passed, N failed"; exit status 1 on any failure.  A process
# that crashes or outlives SLEEP_PROCESS_S (120) gets a FAIL line with its last output and the next
# one starts; none is started once less than 45 s of SLEEP_BUDGET (450) is left, and none runs past it.  Every size is
# an environment knob of the trainers (SLEEP_LAYERS, SLEEP_STEPS, ...: their docstrings).  Every
# process's stdout, stderr and exit status: ${OUT:-/tmp}/vmmshim-sleep/SETTING-oOUTER.{out,err,rc}.
# --dry (or SLEEP_DRY=1): no GPU, no torch: sleep_standin.py in place of the trainers over the
# emulated driver (build/fakecuda), shim-default, shim-async and tms (its hook's CPU backup in mmap
# memory); checks this script and the table, measures nothing real (measured targets print DRY, not
# counted).  SLEEP_DRY_CRASH=1 makes the dry shim-async process die after its first round.
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
B=${BUILD:-build}
case $B in /*) ;; *) B=$ROOT/$B ;; esac
TMS=${TMS_DIR:-.tms}
case $TMS in /*) ;; *) TMS=$ROOT/$TMS ;; esac
TMSO=$TMS/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so
W=${OUT:-/tmp}/vmmshim-sleep
DRY=${SLEEP_DRY:-0}
[ "${1:-}" = --dry ] && DRY=1
OUTER=${SLEEP_OUTER:-2}
BUDGET=${SLEEP_BUDGET:-450}
PER=${SLEEP_PROCESS_S:-120}
START=$SECONDS
# what is preloaded already stays first in every process (the ASan runtime, when tests/run.sh runs
# --dry against the ASan build); the shim or torch_memory_saver's hook goes behind it
BASE_PRELOAD=${LD_PRELOAD:-}
unset PYTORCH_CUDA_ALLOC_CONF LD_PRELOAD VMMSHIM_SLEEP_ADOPTED
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export VMMSHIM_REGISTRY=/vmmshim-sleep-$$ VMMSHIM_BROKER_DIR=$W/brokers VMMSHIM_CLIENT_LIB=$B/libvmmshim-client.so
export PYTHONPATH=$ROOT/tools/python:$ROOT/tests/gpu${PYTHONPATH:+:$PYTHONPATH}
export SLEEP_JAX_CACHE=$W/jax-cache
rm -rf "$W"
mkdir -p "$W"

finish() { # $1: sleep_table.py's exit status, or empty when it never ran
  [ -x "$B/vmmctl" ] && "$B/vmmctl" gc >/dev/null 2>&1
  rm -f "/dev/shm$VMMSHIM_REGISTRY" "/dev/shm$VMMSHIM_REGISTRY".*
  exit "${1:-1}"
}
if [ ! -f "$B/libvmmshim.so" ] || [ ! -f "$B/libvmmshim-client.so" ]; then
  echo "FAIL $B/libvmmshim.so or libvmmshim-client.so missing (build on the development machine, carry build/)"
  echo "sleep: 0 passed, 1 failed"
  finish 1
fi

SETTINGS=${SLEEP_SETTINGS:-shim-default shim-expandable shim-async tms jax}
table_args=()
if [ "$DRY" = 1 ]; then
  if [ ! -f "$B/fakecuda/libcuda.so.1" ]; then
    echo "FAIL --dry needs the emulated driver ($B/fakecuda): run make first"
    echo "sleep: 0 passed, 1 failed"
    finish 1
  fi
  export LD_LIBRARY_PATH=$B/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # a small emulated device, so that the neighbour's fill and the KV tensor stay small
  export FAKECUDA_MEM_BYTES=${FAKECUDA_MEM_BYTES:-268435456} SLEEP_HEADROOM_MB=${SLEEP_HEADROOM_MB:-32}
  export SLEEP_PINNED_MB=${SLEEP_PINNED_MB:-16}
  SETTINGS="shim-default shim-async tms"
  table_args+=(--dry)
  echo "== sleep --dry: stand-in trainers over the emulated driver, no GPU (nothing measured is real)"
else
  echo "== sleep: $(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi

tms_env=()
if [ ! -f "$TMSO" ]; then
  echo "SKIP tms: $TMSO missing (.tms/build.sh builds it; carry .tms)"
  SETTINGS=${SETTINGS/ tms/}
  table_args+=(--tms-missing)
else
  # the hook needs libcudart.so.13 before Python starts; its RUNPATH names the GPU machine's venv and
  # /usr/local/cuda, and this adds where this python3's packages keep it (nvidia/cu13/lib), if anywhere
  rt=$(python3 - <<'PY' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for d in (spec.submodule_search_locations if spec else []):
    if os.path.exists(os.path.join(d, "cu13", "lib", "libcudart.so.13")):
        print(os.path.join(d, "cu13", "lib"))
        break
PY
)
  [ "$DRY" = 1 ] && rt=""
  # ':' between entries: the package looks for its hook by splitting LD_PRELOAD on ':'
  tms_env=(LD_PRELOAD="${BASE_PRELOAD:+$BASE_PRELOAD:}$TMSO" PYTHONPATH="$TMS/site:$PYTHONPATH")
  [ -n "$rt" ] && tms_env+=(LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$rt")
  echo "== tms: $(head -1 "$TMS/site/BUILD_INFO" 2>/dev/null || echo 'no BUILD_INFO')"
fi

# command_of SETTING: sets cmd, the process's command with its environment
command_of() {
  local shim=(LD_PRELOAD="${BASE_PRELOAD:+$BASE_PRELOAD }$B/libvmmshim.so" VMMSHIM_LOG_LEVEL=info VMMSHIM_LOG_FILE="$W/$1.shim.log")
  if [ "$DRY" = 1 ]; then
    case $1 in
      shim-default) cmd=(env "${shim[@]}" python3 -u tests/gpu/sleep_standin.py) ;;
      shim-async) cmd=(env "${shim[@]}" SLEEP_STANDIN_CRASH="${SLEEP_DRY_CRASH:-0}" python3 -u tests/gpu/sleep_standin.py) ;;
      tms) cmd=(env "${tms_env[@]}" TMS_INIT_CPU_BACKUP_BACKEND=mmap python3 -u tests/gpu/sleep_standin.py --tms) ;;
    esac
    return
  fi
  case $1 in
    shim-default) cmd=(env "${shim[@]}" python3 -u tests/gpu/sleep_bench.py) ;;
    shim-expandable) cmd=(env "${shim[@]}" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VMMSHIM_SLEEP_ADOPTED=1
      python3 -u tests/gpu/sleep_bench.py) ;;
    shim-async) cmd=(env "${shim[@]}" PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 -u tests/gpu/sleep_bench.py) ;;
    tms) cmd=(env "${tms_env[@]}" python3 -u tests/gpu/sleep_bench.py --tms) ;;
    jax) cmd=(env "${shim[@]}" VMMSHIM_SLEEP_ADOPTED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
      python3 -u tests/gpu/sleep_bench_jax.py) ;;
  esac
}

run_one() { # SETTING OUTER
  local f=$W/$1-o$2 left lim t0 rc last
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 45 ]; then
    echo skip-budget >"$f.rc"
    : >"$f.out"
    echo "== $1 outer $2: not started, $left s of the budget left"
    return
  fi
  lim=$PER
  [ "$lim" -gt "$left" ] && lim=$left
  command_of "$1"
  t0=$SECONDS
  # timeout signals its whole process group: the trainer's neighbour goes with it
  timeout -k 5 "$lim" "${cmd[@]}" >"$f.out" 2>"$f.err"
  rc=$?
  echo "$rc" >"$f.rc"
  last=$(grep -E '^(R sleep|R losses|R done|SKIP|FAIL)' "$f.out" | tail -n 1 | cut -c1-160)
  echo "== $1 outer $2: exit $rc in $((SECONDS - t0)) s; ${last:-no result line}"
}

for ((o = 1; o <= OUTER; o++)); do
  order=$SETTINGS
  if [ $((o % 2)) = 0 ]; then order=$(echo "$SETTINGS" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for s in $order; do run_one "$s" "$o"; done
done

echo
python3 tests/gpu/sleep_table.py "$W" "${table_args[@]}"
rc=$?
echo "(logs: $W; $((SECONDS - START)) s)"
finish "$rc"
