#!/usr/bin/env bash
# A companion imports one allocation that spans several of the pool's segments (a MULTI-HANDLE
# record: two cudaMalloc'd neighbours freed, then one request as big as both takes their mapped
# space) with one vmm_import (`vmmctl import-test PID ADDR`), and gets the checksum the owner
# computed.  Prints PASS/FAIL lines and "multi: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-multi; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-multi-$$ PYTHONUNBUFFERED=1 VMMSHIM_GIVE_BACK_MS=5000
pass=0; fail=0
ok() { pass=$((pass+1)); echo "PASS $*"; }
bad() { fail=$((fail+1)); echo "FAIL $*"; }
cat > "$W/fnv.c" <<'C'
#include <stdio.h>
int main(void) { unsigned long long h = 0xcbf29ce484222325ull; /* FNV-1a 64, as vmmctl */ int c;
  while ((c = getchar()) != EOF) h = (h ^ (unsigned char)c) * 1099511628211ull;
  printf("%016llx\n", h); return 0; }
C
gcc -O2 -o "$W/fnv" "$W/fnv.c" || { bad "fnv helper does not build"; echo "multi: $pass passed, $fail failed"; exit 1; }
cat > "$W/owner.py" <<'PY'
import os, subprocess, sys, torch
MiB = 1 << 20
a = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
b = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
del a, b
torch.cuda.empty_cache()          # cudaFree both: two empty neighbouring segments, kept for the delay
pattern = (torch.arange(60 * MiB, dtype=torch.int64) * 13 % 251).to(torch.uint8)  # on the host:
x = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")  # no other device allocation in between
x.copy_(pattern)
torch.cuda.synchronize()
with open(sys.argv[1], "wb") as f: f.write(x.cpu().numpy().tobytes())
fnv = subprocess.run([sys.argv[2]], stdin=open(sys.argv[1], "rb"), capture_output=True, text=True).stdout.strip()
print("tensor", os.getpid(), hex(x.data_ptr()), x.numel(), fnv, flush=True)
sys.stdin.readline()
PY
coproc OW { LD_PRELOAD="$B/libvmmshim.so" timeout 300 python3 "$W/owner.py" "$W/x.bin" "$W/fnv" 2>"$W/owner.err"; }
read -r _ pid addr len sum <&"${OW[0]}"
if [ -z "${sum:-}" ]; then bad "owner did not start"; cat "$W/owner.err"; echo "multi: $pass passed, $fail failed"; exit 1; fi
echo "owner pid $pid: tensor at $addr, $len bytes, fnv $sum"
"$B/vmmctl" show "$pid" "$addr" | tee "$W/show.txt"
"$B/vmmctl" list --pid "$pid" --json > "$W/list.json"
python3 - "$W/list.json" "$addr" <<'PY' | tee "$W/rec.txt"
import json, sys
a = int(sys.argv[2], 16)
r = [r for r in json.load(open(sys.argv[1])) if r["address"] <= a < r["address"] + r["requested_size"]]
print("handles:", r[0].get("n_handles", "?") if r else "no record", "mapped:", r[0]["mapped_size"] if r else 0)
PY
"$B/vmmctl" import-test "$pid" "$addr" | tee "$W/it.txt"
if grep -q "handles: [2-9]" "$W/rec.txt"; then ok "the allocation spans several handles"; else bad "one handle: nothing proven"; fi
if grep -q "fnv $sum" "$W/it.txt"; then ok "one vmm_import of a multi-handle allocation reads its bytes (fnv $sum)"; else bad "import checksum differs from the owner's ($sum)"; fi
echo done >&"${OW[1]}"; wait "$OW_PID" 2>/dev/null
rm -f "/dev/shm$VMMSHIM_REGISTRY" "$W/x.bin"
echo "multi: $pass passed, $fail failed"
[ "$fail" = 0 ]
