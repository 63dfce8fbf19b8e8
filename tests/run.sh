#!/usr/bin/env bash
# Runs every unit test binary of one build, then the Python tests (tests/python/test_*.py) against
# the same build, and sums their closing "N passed, N failed" lines.
# Test binaries named prog_* are helpers that tests start themselves; they are not run here.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export VMMSHIM_TEST_BUILD="$PWD/$BUILD"
export LD_LIBRARY_PATH="$PWD/$BUILD/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Each test gets a private registry and broker directory so parallel runs never meet.
export VMMSHIM_REGISTRY="/vmmshim-test-$$"
export VMMSHIM_BROKER_DIR="/tmp/vmmshim-test-$$"
[ "${SAN:-}" = asan ] && export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0"
# Python loads this build's client library with ctypes.  An ASan-built library needs the ASan
# runtime first in the process, so python runs with it preloaded (the owners the tests start keep
# it first too), and without leak checks: the interpreter itself leaves memory to exit.
py=(python3)
[ "${SAN:-}" = asan ] && py=(env LD_PRELOAD="$(${CC:-cc} -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 python3)
# The tests fork owners from processes where ThreadSanitizer already runs a thread of its own,
# and those children start brokers: TSan allows that only when told to.
[ "${SAN:-}" = tsan ] && export TSAN_OPTIONS="die_after_fork=0"
total_p=0; total_f=0; bad=""
run_one() {
  local name=$1; shift
  local out rc line p f
  out=$(timeout 300 "$@" 2>&1); rc=$?
  line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)
  p=$(echo "$line" | awk '{print $1}'); f=$(echo "$line" | awk '{print $3}')
  [ -n "$p" ] || { p=0; f=1; }
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then f=1; fi
  total_p=$((total_p + p)); total_f=$((total_f + f))
  if [ "$f" != 0 ]; then
    bad="$bad $name"; printf '%-28s FAIL (rc=%s)\n' "$name" "$rc"; printf '%s\n' "$out" | sed 's/^/    /' | tail -n 40
  else
    printf '%-28s %s\n' "$name" "$line"; printf '%s\n' "$out" | grep -E '^(figure|stat|note):' | sed 's/^/    /'
  fi
  rm -f "/dev/shm${VMMSHIM_REGISTRY}"
}
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  run_one "$(basename "$t")" "$t"
done
for t in tests/python/test_*.py; do
  # python is no TSan program: it crashes with the TSan runtime preloaded, and cannot load a
  # TSan-built library without it (the plain, ASan and UBSan runs cover the Python companion)
  if [ "${SAN:-}" = tsan ]; then printf '%-28s skipped under TSan\n' "python/$(basename "$t")"; continue; fi
  run_one "python/$(basename "$t")" "${py[@]}" "$t"
done
rm -rf "$VMMSHIM_BROKER_DIR"
echo "${BUILD}: ${total_p} passed, ${total_f} failed${bad:+ (failing:$bad)}"
[ "$total_f" = 0 ]
