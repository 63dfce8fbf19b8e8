#!/usr/bin/env bash
# A companion reads a PyTorch tensor whose bytes span several pages of an expandable segment
# (each page its own cuMemCreate handle, one cuMemMap record each) with one range import
# (`vmmctl import-test PID ADDR LEN`, vmm_import_range), and gets the checksum the trainer
# computed.  Run by tests/gpu/run.sh; prints PASS/FAIL lines and "range: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-range; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-range-$$ PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
pass=0; fail=0
ok() { pass=$((pass+1)); echo "PASS $*"; }
bad() { fail=$((fail+1)); echo "FAIL $*"; }
cat > "$W/fnv.c" <<'C'
#include <stdio.h>
int main(void) { unsigned long long h = 0xcbf29ce484222325ull; /* FNV-1a 64, as vmmctl */ int c;
  while ((c = getchar()) != EOF) h = (h ^ (unsigned char)c) * 1099511628211ull;
  printf("%016llx\n", h); return 0; }
C
gcc -O2 -o "$W/fnv" "$W/fnv.c" || { bad "fnv helper does not build"; echo "range: $pass passed, $fail failed"; exit 1; }
cat > "$W/trainer.py" <<'PY'
import os, sys, subprocess, torch
small = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")  # so the tensor below starts mid-page
x = (torch.arange(24 << 20, device="cuda", dtype=torch.int64) * 7 % 251).to(torch.uint8)
torch.cuda.synchronize()
with open(sys.argv[1], "wb") as f: f.write(x.cpu().numpy().tobytes())
fnv = subprocess.run([sys.argv[2]], stdin=open(sys.argv[1], "rb"), capture_output=True, text=True).stdout.strip()
print("tensor", os.getpid(), hex(x.data_ptr()), x.numel(), fnv, flush=True)
sys.stdin.readline()
PY
coproc TR { LD_PRELOAD="$B/libvmmshim.so" timeout 120 python3 "$W/trainer.py" "$W/x.bin" "$W/fnv" 2>"$W/trainer.err"; }
read -r _ pid addr len sum <&"${TR[0]}"
if [ -z "${sum:-}" ]; then bad "trainer did not start"; cat "$W/trainer.err"; echo "range: $pass passed, $fail failed"; exit 1; fi
echo "trainer pid $pid: tensor at $addr, $len bytes, fnv $sum"
"$B/vmmctl" list --pid "$pid" --json > "$W/list.json"
python3 - "$W/list.json" "$addr" "$len" <<'PY' | tee "$W/pages.txt"
import json, sys
recs = json.load(open(sys.argv[1])); a = int(sys.argv[2], 16); n = int(sys.argv[3])
hit = [r for r in recs if r["api"] == "cuMemMap" and r["address"] < a + n and a < r["address"] + r["requested_size"]]
print("records under the tensor:", len(hit), "chunks:", len({r["chunk_id"] for r in hit}))
PY
"$B/vmmctl" import-test "$pid" "$addr" "$len" | tee "$W/it.txt"
if grep -q "chunks: [2-9]" "$W/pages.txt"; then ok "the tensor spans several handles' pages"; else bad "the tensor lies in one page: nothing proven"; fi
if grep -q "fnv $sum" "$W/it.txt"; then ok "a range import reads the tensor's bytes (fnv $sum)"; else bad "range import checksum differs from the trainer's ($sum)"; fi
echo done >&"${TR[1]}"; wait "$TR_PID" 2>/dev/null
rm -f "/dev/shm$VMMSHIM_REGISTRY" "$W/x.bin"
echo "range: $pass passed, $fail failed"
[ "$fail" = 0 ]
