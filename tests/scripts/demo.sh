#!/usr/bin/env bash
# `make demo`: a sample CUDA program allocates under the shim; vmmctl lists its allocations and
# imports one as a companion would.  Uses the real GPU when there is one, else the emulated
# driver and runtime, and says so.
set -u
cd "$(dirname "$0")/../.."
B=$PWD/${BUILD:-build}
CUDA=${CUDA_HOME:-/usr/local/cuda}
export VMMSHIM_REGISTRY=${VMMSHIM_REGISTRY:-/vmmshim-demo-$(id -u)}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "vmmshim demo: using the real GPU ($(nvidia-smi -L | head -n 1))"
  prog=$(mktemp -d)/owner
  gcc -O2 -std=c11 -D_GNU_SOURCE -I"$CUDA/include" tests/progs/owner.c -o "$prog" -L"$CUDA/lib64" -lcudart -Wl,-rpath,"$CUDA/lib64" || exit 1
else
  echo "vmmshim demo: NO GPU found: running over the EMULATED CUDA driver and runtime (test equipment, host memory)"
  export LD_LIBRARY_PATH=$B/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  prog=$B/progs/owner
fi
echo "\$ LD_PRELOAD=$B/libvmmshim.so $prog 3 64 1a    # cudaMalloc 3 MiB, 64 MiB; cudaMallocAsync 1 MiB"
coproc OWNER { LD_PRELOAD=$B/libvmmshim.so "$prog" 3 64 1a; }
addrs=(); sums=()
for i in 1 2 3; do read -r _ pid addr size _ sum <&"${OWNER[0]}" || { echo "demo: the sample program failed"; exit 1; }; addrs+=("$addr"); sums+=("$sum"); done
echo "\$ vmmctl list --pid $pid"; "$B/vmmctl" list --pid "$pid"
echo "\$ vmmctl import-test $pid ${addrs[1]}"; out=$("$B/vmmctl" import-test "$pid" "${addrs[1]}"); rc=$?; echo "$out"
if [ $rc = 0 ] && [[ $out == *"fnv ${sums[1]}"* ]]; then echo "demo: the companion read the same bytes the program wrote (fnv ${sums[1]})"
else echo "demo: FAILED: the program wrote fnv ${sums[1]}"; rc=1; fi
echo quit >&"${OWNER[1]}"; wait "$OWNER_PID" 2>/dev/null
exit $rc
