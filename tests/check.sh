#!/usr/bin/env bash
# `make check`: build and test the plain, ASan, UBSan and TSan variants, then fuzz each target for 20 s
# (`make fuzz`); the last line is the total.
set -u
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
tp=0; tf=0
# Adds the last "<what>: N passed, N failed" line of $1 to the totals (a missing one is a failure).
count() {
  local line p f
  line=$(printf '%s\n' "$1" | grep -E ': [0-9]+ passed, [0-9]+ failed' | tail -n 1)
  p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\1/')
  f=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\2/')
  [ -n "$line" ] || { p=0; f=1; }
  tp=$((tp + p)); tf=$((tf + f))
}
for san in "" asan ubsan tsan; do
  echo "== variant: ${san:-plain}"
  if ! make -s -j"$jobs" all SAN="$san"; then echo "build failed: ${san:-plain}"; tf=$((tf + 1)); continue; fi
  out=$(make -s test SAN="$san" 2>&1); echo "$out"
  count "$out"
done
# No circle of files (tests/scripts/circles.py, over the plain build's objects; known ones are
# listed in tests/scripts/circles.allow).
echo "== circles"
out=$(python3 tests/scripts/circles.py --build build 2>&1); echo "$out"
count "$out"
# Nothing in shim/ includes a header of tools/, and the header as installed stands alone
# (tests/scripts/includes.sh, over the plain build).
echo "== includes"
out=$(tests/scripts/includes.sh build 2>&1); echo "$out"
count "$out"
echo "== fuzz"
out=$(make -s -j"$jobs" fuzz FUZZ_SECONDS=20 2>&1); echo "$out"
count "$out"
echo "$tp passed, $tf failed"
[ "$tf" = 0 ]
