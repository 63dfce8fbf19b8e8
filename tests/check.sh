#!/usr/bin/env bash
# `make check`: build and test the plain, ASan, UBSan and TSan variants; the last line is the total.
set -u
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
tp=0; tf=0
for san in "" asan ubsan tsan; do
  echo "== variant: ${san:-plain}"
  if ! make -s -j"$jobs" all SAN="$san"; then echo "build failed: ${san:-plain}"; tf=$((tf + 1)); continue; fi
  out=$(make -s test SAN="$san" 2>&1); echo "$out"
  line=$(printf '%s\n' "$out" | grep -E ': [0-9]+ passed, [0-9]+ failed' | tail -n 1)
  p=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\1/')
  f=$(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed.*/\2/')
  [ -n "$line" ] || { p=0; f=1; }
  tp=$((tp + p)); tf=$((tf + f))
done
echo "$tp passed, $tf failed"
[ "$tf" = 0 ]
