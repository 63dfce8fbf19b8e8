#!/usr/bin/env bash
# Two-GPU peer-access checks, natively and under the shim: tests/gpu/peer.cu
# (cudaDeviceEnablePeerAccess) and tests/gpu/mempool_peer.cu (cudaMemPoolSetAccess on GPU 0's
# default pool), each with kernels on GPU 1 reading and writing GPU 0's memory allocated before
# and after the grant, plainly and across two of the shim's segments (MULTI-HANDLE records).
# Per program: the native run must succeed, both outputs must match line by line (they print
# error names and bad-word counts only), the shim run must exit 0 (every word right), and while
# the shim run waits before its frees (PEER_PAUSE_DIR) `vmmctl list --json` must show the
# allocations meant to span two segments as records with n_handles >= 2, so the test cannot pass
# without them.  Needs two GPUs, nvcc, python3, and build/ carried from a development machine.
# About 30 s.  Prints PASS/FAIL lines and "peer: N passed, N failed"; logs in ${OUT:-/tmp}/vmmshim-peer/.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-peer
rm -rf "$W"; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-peer-$$ NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
pass=0; fail=0
ok() { pass=$((pass+1)); echo "PASS $*"; }
bad() { fail=$((fail+1)); echo "FAIL $*"; }
finish() { rm -f "/dev/shm$VMMSHIM_REGISTRY"; echo "peer: $pass passed, $fail failed"; [ "$fail" = 0 ]; exit; }
tails() { # FILE LABEL: the last lines of a log, when it has any
  [ -s "$1" ] && tail -n 12 "$1" | sed "s/^/  $2: /"
  return 0
}
if [ ! -f "$B/libvmmshim.so" ] || [ ! -x "$B/vmmctl" ]; then bad "$B/libvmmshim.so or $B/vmmctl missing"; finish; fi
ngpu=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${ngpu:-0}" -lt 2 ]; then bad "needs two GPUs, found ${ngpu:-0}"; finish; fi
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")

for prog in peer mempool_peer; do
  echo "== $prog"
  if ! timeout 300 "$NVCC" -O2 -arch=sm_90 "tests/gpu/$prog.cu" -o "$W/$prog" 2>"$W/$prog.build.err"; then
    bad "$prog: does not build"; tails "$W/$prog.build.err" nvcc; continue
  fi
  timeout -k 5 120 "$W/$prog" >"$W/$prog.native.out" 2>"$W/$prog.native.err"; nrc=$?
  echo "native: exit $nrc"; sed 's/^/  /' "$W/$prog.native.out"
  if [ "$nrc" = 0 ]; then ok "$prog: native run succeeds"; else bad "$prog: native run exit $nrc"; tails "$W/$prog.native.err" "native stderr"; fi

  P=$W/$prog.pause; mkdir -p "$P"
  timeout -k 5 180 env LD_PRELOAD="$B/libvmmshim.so" VMMSHIM_GIVE_BACK_MS=5000 PEER_PAUSE_DIR="$P" \
    "$W/$prog" >"$W/$prog.shim.out" 2>"$W/$prog.shim.err" &
  bg=$!
  for ((i = 0; i < 600; i++)); do # at most 120 s
    [ -f "$P/ready" ] && break
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.2
  done
  if [ -f "$P/ready" ]; then
    pid=$(awk 'NR == 1 { print $2 }' "$P/allocs")
    timeout 30 "$B/vmmctl" list --pid "$pid" --json >"$W/$prog.list.json" 2>"$W/$prog.list.err"
    timeout 30 python3 - "$P/allocs" "$W/$prog.list.json" >"$W/$prog.handles.txt" 2>&1 <<'PY'
import json, sys
recs = json.load(open(sys.argv[2]))
good = True
for line in open(sys.argv[1]):
    name, pid, addr = line.split()
    pid, addr = int(pid), int(addr, 16)
    r = [r for r in recs if r["pid"] == pid and r["address"] <= addr < r["address"] + max(r["requested_size"], 1)]
    if not r:
        print(f"{name}: no record holds 0x{addr:x}")
        good = False
        continue
    r = r[0]
    print(f"{name}: api {r['api']}, device {r['device']}, {r['requested_size']} B, {r['n_handles']} handles, "
          f"kinds {','.join(r['handle_kinds']) or 'none'}")
    if name.startswith("multi") and r["n_handles"] < 2:
        good = False
    if "broker" not in r["handle_kinds"]:
        good = False
sys.exit(0 if good else 1)
PY
    hrc=$?
    sed 's/^/  registry: /' "$W/$prog.handles.txt"
    if [ "$hrc" = 0 ]; then
      ok "$prog: published, exportable, and the two-segment ones are multi-handle records ($(grep -c '^multi' "$W/$prog.handles.txt") of them)"
    else
      bad "$prog: the registry does not show the allocations as meant (a two-segment one with 1 handle proves nothing)"
      tails "$W/$prog.list.err" vmmctl
    fi
  else
    bad "$prog: the shim run never paused for the registry check"
  fi
  touch "$P/go"
  wait "$bg"; rc=$?
  echo "shim: exit $rc"; sed 's/^/  /' "$W/$prog.shim.out"
  grep -m 5 'vmmshim' "$W/$prog.shim.err" | sed 's/^/  shim stderr: /'
  if cmp -s "$W/$prog.native.out" "$W/$prog.shim.out"; then
    ok "$prog: same output natively and under the shim"
  else
    bad "$prog: outputs differ"; diff "$W/$prog.native.out" "$W/$prog.shim.out" | head -n 20 | sed 's/^/  /'
  fi
  if [ "$rc" = 0 ]; then ok "$prog: every call succeeded and every word was right under the shim"
  else bad "$prog: exit $rc under the shim"; tails "$W/$prog.shim.err" "shim stderr"; fi
done
finish
