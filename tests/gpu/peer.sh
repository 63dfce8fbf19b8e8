#!/usr/bin/env bash
# Two-GPU peer-access check: tests/gpu/peer.cu natively and under the shim; outputs must match
# and show no bad words.  Needs a machine with two GPUs and build/ carried from a development machine.
set -u
cd "$(dirname "$0")/../.."
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-peer; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-peer-$$
nvcc -O2 -arch=sm_90 tests/gpu/peer.cu -o "$W/peer" || { echo "peer: 0 passed, 1 failed"; exit 1; }
timeout 120 "$W/peer" > "$W/native.out" 2>&1; echo "native rc=$?"; cat "$W/native.out"
timeout 120 env LD_PRELOAD="$B/libvmmshim.so" "$W/peer" > "$W/shim.out" 2>&1; echo "shim rc=$?"; cat "$W/shim.out"
pass=0; fail=0
if cmp -s "$W/native.out" "$W/shim.out"; then pass=$((pass+1)); echo "PASS same output"; else fail=$((fail+1)); echo "FAIL outputs differ"; fi
if grep -q ', 0 bad words' "$W/shim.out" && ! grep -qE '[1-9][0-9]* bad words' "$W/shim.out"; then pass=$((pass+1)); echo "PASS no bad words under the shim"; else fail=$((fail+1)); echo "FAIL bad words under the shim"; fi
rm -f /dev/shm$VMMSHIM_REGISTRY
echo "peer: $pass passed, $fail failed"
[ $fail = 0 ]
