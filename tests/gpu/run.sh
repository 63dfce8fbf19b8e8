#!/usr/bin/env bash
# `make test-gpu`: the shim on a real GPU.  The shim, client library and vmmctl come from the
# development machine's build (carry build/); test programs are compiled here against NVIDIA's
# libcudart.  Prints one line per check and closes with "N passed, N failed".  PyTorch runs
# under the default caching allocator, backend:cudaMallocAsync and expandable_segments:True (the
# last maps its memory with cuMemCreate + cuMemMap: the records have api cuMemMap).  Then the
# README's colocated RL loop (tests/gpu/colocate.sh, about 2 minutes), one check here.
set -u
cd "$(dirname "$0")/../.."
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-gpu; mkdir -p "$W"
CUDA=${CUDA_HOME:-/usr/local/cuda}
export VMMSHIM_REGISTRY=/vmmshim-gpu-$$
SHIM="LD_PRELOAD=$B/libvmmshim.so"
pass=0; fail=0
ok()   { pass=$((pass+1)); echo "PASS $*"; }
bad()  { fail=$((fail+1)); echo "FAIL $*"; }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

cc_rt() { gcc -O2 -std=c11 -D_GNU_SOURCE -I"$CUDA/include" "$1" -o "$2" -L"$CUDA/lib64" -lcudart -pthread -Wl,-rpath,"$CUDA/lib64"; }
for p in semantics threads owner oom reset capture_free graph_free; do cc_rt tests/progs/$p.c "$W/$p" || bad "build $p"; done
gcc -O2 -std=c11 -D_GNU_SOURCE -I"$CUDA/include" tests/progs/follow_reuse.c -o "$W/follow_reuse" -L"$CUDA/lib64" -lcudart -lcuda \
  -pthread -Wl,-rpath,"$CUDA/lib64" || bad "build follow_reuse"
nvcc -O2 -arch=sm_90 -cudart shared -Itools/include tests/gpu/kernels.cu -o "$W/kernels" -L"$B" -lvmmshim-client -Xlinker -rpath -Xlinker "$B" || bad "build kernels"

echo "== runtime semantics, native vs shim"
"$W/semantics" > "$W/sem.native" 2>&1
env $SHIM "$W/semantics" > "$W/sem.shim" 2>"$W/sem.err"
check "semantics identical to native" "cmp -s '$W/sem.native' '$W/sem.shim'"
diff "$W/sem.native" "$W/sem.shim" | head -20; cat "$W/sem.err" | head -5

echo "== a free reused by another stream through the program's event dependencies, native vs shim"
"$W/follow_reuse" > "$W/follow.native" 2>&1
env $SHIM "$W/follow_reuse" > "$W/follow.shim" 2>"$W/follow.err"
cat "$W/follow.shim"
check "follow_reuse: the same reuse as native (cudaMemPoolReuseFollowEventDependencies)" "cmp -s '$W/follow.native' '$W/follow.shim'"
diff "$W/follow.native" "$W/follow.shim" | head -10; head -5 "$W/follow.err"

echo "== cudaDeviceReset with live and cached memory, native vs shim"
"$W/reset" > "$W/reset.native" 2>&1
env $SHIM "$W/reset" > "$W/reset.shim" 2>"$W/reset.err"
cat "$W/reset.shim"
check "cudaDeviceReset: the program sees what native gives" "cmp -s '$W/reset.native' '$W/reset.shim'"
diff "$W/reset.native" "$W/reset.shim" | head -10; head -5 "$W/reset.err"

echo "== another thread's cudaMalloc/cudaFree while a stream captures (thread-local, relaxed), native vs shim"
for m in 1 2; do
  "$W/capture_free" $m > "$W/cap$m.native" 2>&1
  env $SHIM "$W/capture_free" $m > "$W/cap$m.shim" 2>&1
  cat "$W/cap$m.shim"
  check "capture mode $m survives another thread's cudaMalloc/cudaFree as natively" "cmp -s '$W/cap$m.native' '$W/cap$m.shim' && grep -q 'end cudaSuccess' '$W/cap$m.shim'"
done

echo "== cudaFreeAsync captured into a graph, of memory allocated before the capture, native vs shim"
"$W/graph_free" > "$W/graph.native" 2>&1
env $SHIM "$W/graph_free" > "$W/graph.shim" 2>&1
cat "$W/graph.native"
check "captured cudaFreeAsync: the program sees what native gives" "cmp -s '$W/graph.native' '$W/graph.shim'"
diff "$W/graph.native" "$W/graph.shim" | head -10

echo "== 16 threads x 10000 allocate/free"
env $SHIM "$W/threads" 16 10000 > "$W/thr" 2>&1; cat "$W/thr"
check "threads: no failures" "grep -q 'failures=0' '$W/thr'"

echo "== kernels: async streams with reuse"
env $SHIM "$W/kernels" > "$W/k" 2>&1; cat "$W/k"
check "async streams checked by kernels" "grep -q ', 0 bad words' '$W/k'"

echo "== kernel in owner, kernel in companion"
coproc OWN { env $SHIM "$W/kernels" owner; }
read -r _ opid oaddr osize <&"${OWN[0]}"
"$B/vmmctl" list --pid "$opid"
"$B/vmmctl" show "$opid" "$oaddr"
"$W/kernels" companion "$opid" "$oaddr" > "$W/comp" 2>&1; cat "$W/comp"
check "companion kernel verifies owner's pattern" "grep -q 'pattern: yes' '$W/comp'"
echo go >&"${OWN[1]}"; read -r line <&"${OWN[0]}"; echo "$line"; wait $OWN_PID 2>/dev/null
owner_line=$line; check "owner kernel sees companion's writes" '[[ $owner_line == *yes ]]'

echo "== vmmctl import-test while the owner runs (VMMSHIM_FRAMES=4, VMMSHIM_STATS=1)"
coproc OWN2 { env $SHIM VMMSHIM_FRAMES=4 VMMSHIM_STATS=1 "$W/owner" 3 1a 2>"$W/owner2.err"; }
read -r _ opid oaddr _ _ osum <&"${OWN2[0]}"; read -r _ <&"${OWN2[0]}"
"$B/vmmctl" import-test "$opid" "$oaddr" | tee "$W/it"
check "import-test reads the owner's bytes (fnv $osum)" "grep -q 'fnv $osum' '$W/it'"
"$B/vmmctl" show "$opid" "$oaddr" | grep frame | tee "$W/frames"
check "vmmctl show names the call site (owner+0x...)" "grep -q 'owner+0x' '$W/frames'"
"$B/vmmctl" ps | tee "$W/ps"
check "vmmctl ps counts the owner's allocations (2 made, 2 backed)" "grep -E '^ *$opid .* 2 +2 +0 +0 +0 ' '$W/ps' >/dev/null"
echo quit >&"${OWN2[1]}"; wait $OWN2_PID 2>/dev/null
grep stats "$W/owner2.err"
check "VMMSHIM_STATS=1 prints one line at exit" "grep -q 'vmmshim: stats: pid $opid: 2 allocations, 2 backed' '$W/owner2.err'"

echo "== a companion reads a packed small allocation (three 4 KiB buffers in one chunk)"
coproc OWN3 { env $SHIM "$W/owner" 0.00390625 0.00390625 0.00390625; }
for i in 0 1 2; do read -r _ opid oaddr _ _ osum <&"${OWN3[0]}"; done   # the third buffer
"$B/vmmctl" show "$opid" "$oaddr" | tee "$W/show3"
"$B/vmmctl" import-test "$opid" "$oaddr" | tee "$W/it3"
check "the small buffers share one chunk" "grep -q 'shares its chunk with 2 other' '$W/show3'"
check "import-test reads the packed buffer's bytes (fnv $osum)" "grep -q 'fnv $osum' '$W/it3'"
echo quit >&"${OWN3[1]}"; wait $OWN3_PID 2>/dev/null

echo "== out of memory: 64 MiB blocks until failure"
"$W/oom" > "$W/oom.native" 2>&1; env $SHIM "$W/oom" > "$W/oom.shim" 2>&1; rc=$?
if [ $rc -ge 128 ] && command -v cuda-gdb >/dev/null; then   # a crash: show where
  cuda-gdb -q -batch -ex "set environment LD_PRELOAD $B/libvmmshim.so" -ex run -ex bt "$W/oom" 2>&1 | tail -25
fi
cat "$W/oom.native" "$W/oom.shim"
n1=$(sed -n 's/^oom: \([0-9]*\) blocks.*/\1/p' "$W/oom.native"); n2=$(sed -n 's/^oom: \([0-9]*\) blocks.*/\1/p' "$W/oom.shim")
echo "shim reached $n2 of native $n1 blocks"
check "shim reaches >= 99% of native" "[ -n '$n2' ] && [ \$(( $n2 * 100 )) -ge \$(( $n1 * 99 )) ]"
check "shim recovers after freeing" "grep -q 'recovered: $n2 of $n2' '$W/oom.shim'"

echo "== PyTorch training loop"
# expandable_segments:True maps its segments itself (cuMemCreate + cuMemMap, 2 MiB pages for
# small blocks): the parameter must lie in a published cuMemMap record, and since it may straddle
# two pages, import-test is given its length (a range import across records).  Every step is
# bounded: a run that hangs costs at most its timeout.
for conf in "" "backend:cudaMallocAsync" "expandable_segments:True"; do
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout -k 5 180 python3 tests/gpu/torch_train.py > "$W/t.native" 2>&1
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout -k 5 180 env $SHIM python3 tests/gpu/torch_train.py > "$W/t.shim" 2>&1
  tail -1 "$W/t.shim"
  check "torch ${conf:-default allocator}: same losses" "cmp -s '$W/t.native' '$W/t.shim'"
  coproc TR { PYTORCH_CUDA_ALLOC_CONF=$conf PAUSE_FOR_COMPANION=1 timeout -k 5 240 env $SHIM python3 -u tests/gpu/torch_train.py 2>&1; }
  l=""
  while read -r -t 180 l <&"${TR[0]:-}"; do [[ $l == param* ]] && break; done
  [[ $l == param* ]] || { echo "no 'param' line from the trainer (last line: $l)"; l=""; }
  tpid="" tptr="" tlen="" tsum="none"
  read -r _ tpid tptr tlen _ tsum <<<"$l"
  tsum=${tsum:-none}
  if [ -n "$tpid" ]; then
    timeout 30 "$B/vmmctl" list --pid "$tpid" | tail -3
    timeout 30 "$B/vmmctl" show "$tpid" "$tptr" > "$W/tshow" 2>&1
    grep -E '^(address|size|made by|export|vmmctl)' "$W/tshow"
    timeout 60 "$B/vmmctl" import-test "$tpid" "$tptr" "$tlen" 2>&1 | tee "$W/tit"
  else
    : > "$W/tit"; : > "$W/tshow"
  fi
  if [ "$conf" = expandable_segments:True ]; then
    check "torch $conf: the parameter lies in a cuMemMap record" "grep -q '^made by *cuMemMap' '$W/tshow'"
  fi
  check "torch ${conf:-default}: companion imports a parameter (fnv $tsum)" "grep -q 'fnv $tsum' '$W/tit'"
  if [ -n "${TR[1]:-}" ]; then echo "done" >&"${TR[1]}"; fi
  if [ -n "${TR_PID:-}" ]; then wait "$TR_PID" 2>/dev/null; fi
done

echo "== the colocated RL loop (issue 29, README use 4): trainer and rollout taking turns, against TMS and a run that never sleeps"
# its own lines (table, PASS/FAIL) indented: they are colocate.sh's checks, counted here as one
BUILD=$B timeout -k 10 600 tests/gpu/colocate.sh > "$W/colocate.txt" 2>&1; rc=$?
grep -E '^(\||PASS|FAIL|SKIP|  \||colocate:)' "$W/colocate.txt" | sed 's/^/  /'
colo=$(grep -E '^colocate: [0-9]+ passed, [0-9]+ failed' "$W/colocate.txt" | tail -n 1)
check "colocated RL loop: ${colo:-no summary} (exit $rc; logs in ${OUT:-/tmp}/vmmshim-colocate)" "[ $rc = 0 ]"

"$B/vmmctl" gc >/dev/null 2>&1; rm -f /dev/shm$VMMSHIM_REGISTRY
echo "gpu: $pass passed, $fail failed"
[ $fail = 0 ]
