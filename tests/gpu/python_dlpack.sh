#!/usr/bin/env bash
# The Python companion on a GPU: a PyTorch trainer under the shim (tests/gpu/torch_train.py, which
# prints its parameter's address and the FNV-1a of its bytes, computed on the host) pauses; a
# companion with PYTHONPATH=tools/python opens the parameter and takes it with torch.from_dlpack,
# zero-copy (and cupy.from_dlpack when CuPy imports): same FNV-1a (tests/gpu/dlpack_companion.py).
# Under the default caching allocator and backend:cudaMallocAsync (expandable segments may split a
# tensor across records: Registry.open(pid, address, size) joins them, not exercised here).  Prints
# PASS/FAIL lines and
# "python_dlpack: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}; W=${OUT:-/tmp}/vmmshim-pydlpack; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-pydlpack-$$ PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
pass=0; fail=0
bad() { fail=$((fail+1)); echo "FAIL $*"; }
for conf in "" "backend:cudaMallocAsync"; do
  name="torch ${conf:-default allocator}"
  echo "== $name"
  coproc TR { PYTORCH_CUDA_ALLOC_CONF=$conf PAUSE_FOR_COMPANION=1 LD_PRELOAD="$B/libvmmshim.so" \
              timeout -k 5 240 python3 -u tests/gpu/torch_train.py 2>"$W/trainer.err"; }
  l=""
  while read -r -t 180 l <&"${TR[0]:-}"; do [[ $l == param* ]] && break; done
  if [[ $l == param* ]]; then
    read -r _ pid ptr len _ sum <<<"$l"
    echo "trainer pid $pid: parameter at $ptr, $len bytes, fnv $sum"
    VMMSHIM_CLIENT_LIB="$B/libvmmshim-client.so" PYTHONPATH="$PWD/tools/python" \
      timeout -k 5 120 python3 tests/gpu/dlpack_companion.py "$pid" "$ptr" "$len" "$sum" > "$W/companion.out" 2>&1
    rc=$?
    sed -E "s/^(PASS|FAIL) /\1 $name: /" "$W/companion.out"
    p=$(grep -c '^PASS' "$W/companion.out"); f=$(grep -c '^FAIL' "$W/companion.out")
    pass=$((pass + p)); fail=$((fail + f))
    [ "$rc" = 0 ] || bad "$name: the companion exited with $rc"
  else
    bad "$name: the trainer printed no param line"; tail -5 "$W/trainer.err"
  fi
  if [ -n "${TR[1]:-}" ]; then echo done >&"${TR[1]}"; fi
  if [ -n "${TR_PID:-}" ]; then wait "$TR_PID" 2>/dev/null; fi
done
rm -f "/dev/shm$VMMSHIM_REGISTRY"
echo "python_dlpack: $pass passed, $fail failed"
[ "$fail" = 0 ] && [ "$pass" -gt 0 ]
