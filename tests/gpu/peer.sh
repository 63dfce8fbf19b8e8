#!/usr/bin/env bash
# Two-GPU peer-access checks, natively and under the shim; outputs must match and show no bad
# words: tests/gpu/peer.cu (cudaDeviceEnablePeerAccess) and tests/gpu/mempool_peer.cu
# (cudaMemPoolSetAccess on GPU 0's default pool).  Needs a machine with two GPUs and build/
# carried from a development machine.
set -u
cd "$(dirname "$0")/../.."
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-peer; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-peer-$$
pass=0; fail=0
ok() { pass=$((pass+1)); echo "PASS $*"; }
bad() { fail=$((fail+1)); echo "FAIL $*"; }
for prog in peer mempool_peer; do
  if ! nvcc -O2 -arch=sm_90 "tests/gpu/$prog.cu" -o "$W/$prog"; then bad "$prog: does not build"; continue; fi
  timeout 120 "$W/$prog" > "$W/$prog.native.out" 2>&1; echo "$prog native rc=$?"; cat "$W/$prog.native.out"
  timeout 120 env LD_PRELOAD="$B/libvmmshim.so" "$W/$prog" > "$W/$prog.shim.out" 2>&1; rc=$?
  echo "$prog shim rc=$rc"; cat "$W/$prog.shim.out"
  if cmp -s "$W/$prog.native.out" "$W/$prog.shim.out"; then ok "$prog: same output"; else bad "$prog: outputs differ"; fi
  case $prog in
  peer)
    if grep -q ', 0 bad words' "$W/$prog.shim.out" && ! grep -qE '[1-9][0-9]* bad words' "$W/$prog.shim.out"; then
      ok "$prog: no bad words under the shim"; else bad "$prog: bad words under the shim"; fi ;;
  mempool_peer) # it exits 0 only when the grant, both kernels and every word were right
    if [ "$rc" = 0 ]; then ok "$prog: every word right under the shim"; else bad "$prog: rc=$rc under the shim"; fi ;;
  esac
done
rm -f /dev/shm$VMMSHIM_REGISTRY
echo "peer: $pass passed, $fail failed"
[ $fail = 0 ]
