#!/usr/bin/env bash
# Imports across devices (issue 18), on two GPUs: an owner under the shim (tests/gpu/xdev_owner.cu)
# holds X0 (64 MiB) and M0 (60 MiB across two of the pool's segments: a MULTI-HANDLE record) and
# W0 (16 MiB of zeros) on GPU 0, Y1 (32 MiB, cudaMalloc) and A1 (48 MiB, cudaMallocAsync) on GPU 1,
# each announced with the FNV-1a of its bytes.  Then, each a process of its own:
#   - a companion on GPU 1 (tests/gpu/xdev_companion.cu: cudaSetDevice(1), then vmm_import)
#     imports all of them: the record's device, the handle count, the devices the mapping is
#     granted to (cuMemGetAccess: the memory's GPU and the companion's, when it can access that
#     one as a peer; nothing else), vmm_import_device, and the owner's FNV read back by a
#     cudaMemcpy to the host and by a kernel on every granted GPU (GPU 1 reading GPU 0's memory
#     over the peer mapping); it fills W0 from a kernel on GPU 1 and the owner counts the words
#     with a kernel on GPU 0;
#   - the same companion on GPU 0 (GPU 1's allocations over the peer mapping), one that makes no
#     CUDA call before its import (the library makes device 0's primary context current; the
#     import is reported for the memory's own GPU), and one with CUDA_VISIBLE_DEVICES=1 (GPU 1 is
#     its device 0: found by the record's UUID, not the owner's ordinal);
#   - a Python companion (tests/gpu/xdev_open_many.py, PYTHONPATH=tools/python) on GPU 1: one
#     Registry.open_many over X0, M0, Y1, A1 and a piece of X0, each buffer taken with
#     torch.from_dlpack, copied to the host and cloned on its device: the owner's FNV.
# Needs two GPUs, nvcc, gcc, python3 with torch, and build/ carried from a development machine.
# About 30 s.  Prints PASS/FAIL lines and "xdev: N passed, N failed"; logs in ${OUT:-/tmp}/vmmshim-xdev/.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}; G=$PWD/tests/gpu; W=${OUT:-/tmp}/vmmshim-xdev
rm -rf "$W"; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-xdev-$$ PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1
pass=0; fail=0
ok() { pass=$((pass+1)); echo "PASS $*"; }
bad() { fail=$((fail+1)); echo "FAIL $*"; }
finish() { echo "xdev: $pass passed, $fail failed"; [ "$fail" = 0 ]; exit; }
tails() { [ -s "$1" ] && tail -n 12 "$1" | sed "s/^/  $2: /"; return 0; }
# shellcheck disable=SC2317 # called by the trap
cleanup() {
  if [ -n "${OW_PID:-}" ]; then kill "$OW_PID" 2>/dev/null; fi
  rm -f "/dev/shm$VMMSHIM_REGISTRY"
}
trap cleanup EXIT

if [ ! -f "$B/libvmmshim.so" ] || [ ! -f "$B/libvmmshim-client.so" ] || [ ! -x "$B/vmmctl" ]; then
  bad "$B/libvmmshim.so, libvmmshim-client.so or vmmctl missing"; finish
fi
ngpu=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${ngpu:-0}" -lt 2 ]; then bad "needs two GPUs, found ${ngpu:-0}"; finish; fi
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
cat >"$W/fnv.c" <<'C'
#include <stddef.h>
unsigned long long fnv1a(const unsigned char *p, size_t n) { /* FNV-1a 64, as the owner and vmmctl */
  unsigned long long h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h; }
C
if ! timeout 300 "$NVCC" -O2 -arch=sm_90 "$G/xdev_owner.cu" -o "$W/owner" 2>"$W/build.err" ||
   ! timeout 300 "$NVCC" -O2 -arch=sm_90 "$G/xdev_companion.cu" -Itools/include -L"$B" -lvmmshim-client \
       -Xlinker -rpath -Xlinker "$B" -o "$W/companion" 2>>"$W/build.err" ||
   ! gcc -O2 -shared -fPIC -o "$W/libfnv.so" "$W/fnv.c" 2>>"$W/build.err"; then
  bad "the owner, the companion or libfnv.so does not build"; tails "$W/build.err" build; finish
fi

echo "== the owner, under the shim"
coproc OW { LD_PRELOAD="$B/libvmmshim.so" VMMSHIM_GIVE_BACK_MS=5000 timeout -k 5 300 "$W/owner" 2>"$W/owner.err"; }
pid=""
while read -r -t 120 l <&"${OW[0]:-}"; do
  echo "$l" >>"$W/allocs.txt"
  case $l in ready*) pid=${l#ready }; break ;; error*) break ;; esac
done
if [ -z "$pid" ]; then
  bad "the owner did not come up"; sed 's/^/  owner: /' "$W/allocs.txt" 2>/dev/null; tails "$W/owner.err" "owner stderr"; finish
fi
sed 's/^/  /' "$W/allocs.txt"
timeout 30 "$B/vmmctl" list --pid "$pid" 2>&1 | sed 's/^/  vmmctl: /'
# "alloc NAME DEV 0xADDR BYTES FNV" -> the companion's "NAME DEV 0xADDR BYTES FNV"
line_of() { awk -v n="$1" '$1 == "alloc" && $2 == n { print $2, $3, $4, $5, $6 }' "$W/allocs.txt"; }
w0=$(awk '$1 == "alloc" && $2 == "W0" { print $4, $5 }' "$W/allocs.txt")

# A companion run: MODE, a label, then its input lines.  Its PASS/FAIL lines count here.
companion() {
  local mode=$1 label=$2 rc p f; shift 2
  printf '%s\n' "$@" | timeout -k 5 120 env ${VISIBLE:+CUDA_VISIBLE_DEVICES=$VISIBLE} "$W/companion" "$mode" "$pid" \
    >"$W/companion-$label.out" 2>"$W/companion-$label.err"
  rc=$?
  sed -E "s/^(PASS|FAIL) /\1 $label: /; t; s/^/  /" "$W/companion-$label.out"
  p=$(grep -c '^PASS' "$W/companion-$label.out"); f=$(grep -c '^FAIL' "$W/companion-$label.out")
  pass=$((pass + p)); fail=$((fail + f))
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then bad "$label: the companion exited with $rc"; tails "$W/companion-$label.err" stderr; fi
  [ "$p" -gt 0 ] || { bad "$label: no check ran"; tails "$W/companion-$label.err" stderr; }
}
owner_check() { # SEED LABEL: the owner counts W0's words against SEED's pattern on GPU 0
  local ans=""
  if [ -n "${OW[1]:-}" ]; then echo "check W0 $1" >&"${OW[1]}"; read -r -t 60 ans <&"${OW[0]}"; fi
  if [ "$ans" = "checked W0 0" ]; then ok "$2: the owner's GPU 0 kernel sees every word the companion wrote into W0"
  else bad "$2: the owner answered '${ans:-nothing}' (checked W0 BAD_WORDS)"; fi
}

echo "== a companion on GPU 1"
companion 1 "GPU 1 companion" "$(line_of X0)" "$(line_of M0)" "$(line_of Y1)" "$(line_of A1)" "write W0 $w0 77"
owner_check 77 "GPU 1 companion"
echo "== a companion on GPU 0"
companion 0 "GPU 0 companion" "$(line_of Y1)" "$(line_of A1)" "$(line_of X0)" "$(line_of M0)" "write W0 $w0 78"
owner_check 78 "GPU 0 companion"
echo "== a companion with no context before its import, taking GPU 1's Y1"
companion none "no-context companion" "$(line_of Y1)"
echo "== a companion with CUDA_VISIBLE_DEVICES=1 (GPU 1 is its device 0)"
VISIBLE=1 companion 0 "GPU-1-only companion" "$(line_of Y1)" "$(line_of A1)"

echo "== a Python companion on GPU 1: Registry.open_many over both GPUs' allocations"
VMMSHIM_CLIENT_LIB="$B/libvmmshim-client.so" PYTHONPATH="$PWD/tools/python" \
  timeout -k 5 180 python3 "$G/xdev_open_many.py" "$pid" "$W/libfnv.so" "$W/allocs.txt" >"$W/open_many.out" 2>"$W/open_many.err"
rc=$?
sed -E "s/^(PASS|FAIL) /\1 open_many: /; t; s/^/  /" "$W/open_many.out"
p=$(grep -c '^PASS' "$W/open_many.out"); f=$(grep -c '^FAIL' "$W/open_many.out")
pass=$((pass + p)); fail=$((fail + f))
if [ "$rc" != 0 ] && [ "$f" = 0 ]; then bad "open_many: the Python companion exited with $rc"; tails "$W/open_many.err" stderr; fi
[ "$p" -gt 0 ] || bad "open_many: no check ran"

if [ -n "${OW[1]:-}" ]; then echo quit >&"${OW[1]}"; fi
wait "$OW_PID"; orc=$?
OW_PID=""
errs=$(grep -c 'vmmshim: error' "$W/owner.err")
if [ "$orc" = 0 ] && [ "$errs" = 0 ]; then ok "the owner freed everything and exited 0, no shim error lines"
else bad "the owner: exit $orc, $errs shim error lines"; tails "$W/owner.err" "owner stderr"; fi
finish
