#!/usr/bin/env bash
# Issue 39 on one GPU: vmmshim's stand-in for torch_memory_saver (TMS) against TMS's own test suite
# and against the real TMS.
#   TMS_SRC=DIR BUILD=build tests/gpu/tms.sh [suite] [bench]      (both by default)
# TMS_SRC: a checkout of torch_memory_saver whose hooks are built in place
# (TMS_CUDA_MAJOR=13 python3 setup.py build_ext --inplace); without it every row SKIPs.
#   suite  TMS's test/test_examples.py with pytest, under `vmmshim run --torch-memory-saver`, with the
#          default allocator and again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (TMS
#          refuses that one); pytest's outcome line per test, then "suite SETTING: N passed, N
#          failed, N skipped".  Tests of TMS's internals fail by design (tools/python/README.md: the
#          stand-in for torch_memory_saver); tms_equivalents.py shows each one's check instead.
#   bench  tms_bench.py, TMS_OUTER (2) times each of: tms (the real hook), standin (default allocator),
#          standin-expandable; then tms_table.py: the table, its PASS/FAIL lines, "tms: N passed, N failed".
# Every process's output: ${OUT:-/tmp}/vmmshim-tms/NAME.{out,err,rc}.
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
B=${BUILD:-build}
case $B in /*) ;; *) B=$ROOT/$B ;; esac
SRC=${TMS_SRC:-}
W=${OUT:-/tmp}/vmmshim-tms
PARTS=${*:-suite bench}
rm -rf "$W" && mkdir -p "$W"
unset PYTORCH_CUDA_ALLOC_CONF LD_PRELOAD VMMSHIM_SLEEP_ADOPTED
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 VMMSHIM_SHIM_LIB=$B/libvmmshim.so
export VMMSHIM_REGISTRY=/vmmshim-tms-$$ VMMSHIM_BROKER_DIR=$W/brokers VMMSHIM_CLIENT_LIB=$B/libvmmshim-client.so
VMMSHIM=(python3 -m vmmshim)
export PYTHONPATH=$ROOT/tools/python
if [ -z "$SRC" ] || ! ls "$SRC"/torch_memory_saver_hook_mode_preload_cu*.so >/dev/null 2>&1; then
  echo "SKIP TMS_SRC (${SRC:-unset}) holds no built torch_memory_saver"
  exit 0
fi
HOOK=$(ls "$SRC"/torch_memory_saver_hook_mode_preload_cu*.so | head -1)
# the hook links libcudart.so.13: PyTorch's wheel brings one
CUDART=$(python3 -c "import glob, os, torch; d = os.path.dirname(torch.__file__); print(':'.join(sorted({os.path.dirname(p) for p in glob.glob(d + '/../nvidia/**/libcudart.so.1*', recursive=True)})))" 2>/dev/null)
export LD_LIBRARY_PATH=${CUDART:+$CUDART:}${LD_LIBRARY_PATH:-}

for part in $PARTS; do
  case $part in
  suite)
    for setting in default expandable; do
      conf=""; [ "$setting" = expandable ] && conf=expandable_segments:True
      # its test/ alone: from the checkout's root, its own torch_memory_saver package would come first
      rm -rf "$W/test-$setting" && cp -r "$SRC/test" "$W/test-$setting"
      (cd "$W/test-$setting" && "${VMMSHIM[@]}" run --torch-memory-saver -- python3 -c \
        "import torch_memory_saver as t; print('suite $setting: torch_memory_saver is', t.__file__)")
      (cd "$W/test-$setting" && PYTORCH_CUDA_ALLOC_CONF=$conf timeout 900 "${VMMSHIM[@]}" run --torch-memory-saver -- \
        python3 -m pytest -q -rA -p no:cacheprovider test_examples.py >"$W/suite-$setting.out" 2>"$W/suite-$setting.err")
      echo $? >"$W/suite-$setting.rc"
      grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$W/suite-$setting.out" | sed "s/^/suite $setting: /"
      p=$(grep -c "^PASSED " "$W/suite-$setting.out"); f=$(grep -cE "^(FAILED|ERROR) " "$W/suite-$setting.out")
      s=$(grep -c "^SKIPPED " "$W/suite-$setting.out")
      echo "suite $setting: $p passed, $f failed, $s skipped"
    done
    (cd "$W" && timeout 300 "${VMMSHIM[@]}" run --torch-memory-saver -- python3 "$ROOT/tests/gpu/tms_equivalents.py" \
      >"$W/equivalents.out" 2>"$W/equivalents.err"); echo $? >"$W/equivalents.rc"
    cat "$W/equivalents.out"
    ;;
  bench)
    for o in $(seq 1 "${TMS_OUTER:-2}"); do
      for setting in tms standin standin-expandable; do
        name=$setting-o$o
        case $setting in
        tms) env LD_PRELOAD="$HOOK" PYTHONPATH="$SRC:$PYTHONPATH" TMS_BENCH_MODE=tms \
               timeout 600 python3 "$ROOT/tests/gpu/tms_bench.py" >"$W/$name.out" 2>"$W/$name.err" ;;
        standin) env TMS_BENCH_MODE=standin timeout 600 "${VMMSHIM[@]}" run --torch-memory-saver -- \
               python3 "$ROOT/tests/gpu/tms_bench.py" >"$W/$name.out" 2>"$W/$name.err" ;;
        standin-expandable) env TMS_BENCH_MODE=standin-expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
               timeout 600 "${VMMSHIM[@]}" run --torch-memory-saver -- \
               python3 "$ROOT/tests/gpu/tms_bench.py" >"$W/$name.out" 2>"$W/$name.err" ;;
        esac
        echo $? >"$W/$name.rc"
      done
    done
    python3 "$ROOT/tests/gpu/tms_table.py" "$W"
    ;;
  esac
done
rm -f "/dev/shm$VMMSHIM_REGISTRY" "/dev/shm$VMMSHIM_REGISTRY".*
