#!/usr/bin/env bash
# A program built against CUDA 11.8's runtime under the shim on a real GPU (build/ carried from a
# development machine after `make cuda11`: build/cuda11/cuda11_prog, NVIDIA's libcudart.so.11.0
# from Debian beside it; the machine's driver runs it, CUDA drivers being backward compatible).
#   - natively: it prints runtime 11080 and its driver's version, and its bytes come back;
#   - under the shim (LD_PRELOAD): the same, and while its allocation lives `vmmctl list --json`
#     shows it (api cudaMalloc, exportable through the broker), and `vmmctl import-test` imports it
#     from another process with the FNV-1a of the bytes the program wrote;
#   - the same through `vmmshim run` when the wheel is installed (a `vmmshim` on PATH).
# CUDA11_DRY=1: no GPU: build/progs11/cuda11_prog (the emulated runtime as libcudart.so.11.0, which
# `make` builds) over the emulated driver, a check of this script.
# Prints PASS/FAIL lines and "cuda11: N passed, N failed"; files in ${OUT:-/tmp}/vmmshim-cuda11.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-cuda11
rm -rf "$W"
mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-cuda11-$$ VMMSHIM_BROKER_DIR=$W/brokers
PROG=$B/cuda11/cuda11_prog
if [ "${CUDA11_DRY:-0}" = 1 ]; then
  PROG=$B/progs11/cuda11_prog
  export LD_LIBRARY_PATH=$B/fakecuda11:$B/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "PASS $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }
finish() {
  rm -f "/dev/shm$VMMSHIM_REGISTRY"
  echo "cuda11: $pass passed, $fail failed"
  [ "$fail" = 0 ]
  exit
}
[ -x "$PROG" ] || { bad "$PROG is missing: run make cuda11 on the development machine and carry build/"; finish; }
# the FNV-1a of the first 4096 bytes the program writes ((i * 7 + 3) & 0xff)
want=$(python3 -c 'h=0xcbf29ce484222325
for i in range(4096): h=((h^((i*7+3)&0xff))*0x100000001b3)&0xffffffffffffffff
print(f"{h:016x}")')

out=$(echo | "$PROG" $((8 << 20)) 2>&1)
if [[ "$out" == *"ok" ]]; then ok "natively: $(echo "$out" | head -1)"; else bad "natively: $out"; fi
if [ "${CUDA11_DRY:-0}" != 1 ]; then
  case "$out" in "runtime 11080 "*) ok "the runtime is CUDA 11.8's" ;; *) bad "the runtime is not 11.8's: $out" ;; esac
fi

under() { # $1: how (a label); the rest: the launcher words before the program
  local how=$1; shift
  local fifo=$W/in.$how
  mkfifo "$fifo"
  "$@" "$PROG" $((8 << 20)) < "$fifo" > "$W/out.$how" 2> "$W/err.$how" &
  local pid=$!
  exec 7> "$fifo"
  local line="" i
  for i in $(seq 1 300); do
    line=$(grep '^ready ' "$W/out.$how" || true)
    [ -n "$line" ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$line" ]; then
    bad "$how: no ready line: $(cat "$W/out.$how" "$W/err.$how")"
    exec 7>&-
    wait $pid
    return
  fi
  local p a
  read -r _ p a _ <<< "$line"
  ok "$how: $(head -1 "$W/out.$how"); allocated $a"
  "$B/vmmctl" list --pid "$p" --json > "$W/list.$how" 2>&1
  if grep -q "\"address_hex\": \"$a\"" "$W/list.$how" && grep -q '"api": "cudaMalloc"' "$W/list.$how" &&
     grep -q '"handle_kinds": \["broker"' "$W/list.$how"; then
    ok "$how: vmmctl list shows pid $p's cudaMalloc at $a, exportable"
  else
    bad "$how: vmmctl list lacks pid $p's allocation $a: $(cat "$W/list.$how")"
  fi
  "$B/vmmctl" import-test "$p" "$a" 4096 > "$W/import.$how" 2>&1
  if grep -qi "$want" "$W/import.$how"; then ok "$how: imported by another process, FNV-1a $want"
  else bad "$how: import-test: $(cat "$W/import.$how") (want FNV-1a $want)"; fi
  echo >&7
  exec 7>&-
  wait $pid
  local rc=$?
  if [ $rc = 0 ] && tail -1 "$W/out.$how" | grep -qx ok; then ok "$how: freed, exit 0"
  else bad "$how: exit $rc: $(cat "$W/out.$how" "$W/err.$how")"; fi
}
under preload env LD_PRELOAD="$B/libvmmshim.so"
if command -v vmmshim > /dev/null; then
  under vmmshim-run vmmshim run --
else
  echo "note: no vmmshim on PATH (the wheel is not installed): vmmshim run not tried"
fi
finish
