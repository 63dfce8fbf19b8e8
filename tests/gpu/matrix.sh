#!/usr/bin/env bash
# `make test-matrix`: real programs and frameworks, each run natively and under the shim on a
# GPU machine, with build/ (shim, vmmctl, client library) carried from a development machine.
# Per program: "same output" = stdout and exit code identical after dropping lines that start
# with '#' (the programs print pointers and pids only there); "published" = while it runs under
# the shim it stops once ("# pause PID", then waits for a line on stdin) and `vmmctl list --pid
# PID --json` counts its allocations.  Every log goes to ${OUT:-/tmp}/vmmshim-matrix/.  Ends
# with one table and "matrix: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
M=$PWD/tests/gpu/matrix
W=${OUT:-/tmp}/vmmshim-matrix
CUDA=${CUDA_HOME:-/usr/local/cuda}
T=${MATRIX_TIMEOUT:-120}  # seconds, for every step
BUDGET=${MATRIX_BUDGET:-540} # seconds for the whole run: rows that would not fit are skipped
export PATH="$CUDA/bin:$PATH"
export PYTHONUNBUFFERED=1
export VMMSHIM_REGISTRY=/vmmshim-matrix-$$
X=$W/bin # the programs built here
rm -rf "$W"
mkdir -p "$W" "$X"
START=$SECONDS

cleanup() {
  rm -f "/dev/shm$VMMSHIM_REGISTRY"
  rm -f "$W"/*.fifo
}
trap cleanup EXIT

if [ ! -f "$B/libvmmshim.so" ] || [ ! -x "$B/vmmctl" ]; then
  echo "matrix: $B/libvmmshim.so or $B/vmmctl missing (build on the development machine, carry build/)"
  echo "matrix: 0 passed, 1 failed"
  exit 1
fi
echo "== machine"
timeout 30 nvidia-smi -L 2>&1 | head -8
timeout 30 nvcc --version 2>&1 | tail -1

# ---- build the compiled programs, all at once ----
build() { # NAME COMMAND...: the log is build-NAME.log; a failure leaves no binary
  local name=$1
  shift
  if ! timeout "$T" "$@" >"$W/build-$name.log" 2>&1; then
    echo "build $name FAILED:"
    tail -n 15 "$W/build-$name.log"
  fi
}
echo "== building"
NV=(nvcc -O2 -arch=sm_90 -I"$M" -Xlinker -rpath -Xlinker "$CUDA/lib64")
build runtime_static "${NV[@]}" -o "$X/runtime_static" "$M/runtime.cu" &
build runtime_shared "${NV[@]}" -cudart shared -o "$X/runtime_shared" "$M/runtime.cu" &
build scale_ptx nvcc -ptx -arch=sm_90 -o "$X/scale.ptx" "$M/scale_ptx.cu" &
build driver "${NV[@]}" -cudart none -x c -o "$X/driver" "$M/driver.c" -lcuda &
build ipc "${NV[@]}" -o "$X/ipc" "$M/ipc.cu" &
build cublas "${NV[@]}" -o "$X/cublas" "$M/cublas.cu" -lcublas &
wait
echo "built in $((SECONDS - START)) s"

# ---- one row ----
R_PROG=() R_NAT=() R_SHIM=() R_SAME=() R_PUB=() R_OK=()
ROW_ENV=()

# Summary of an allocation listing: "N" and "api xCOUNT, ...; E exportable".
count_records() { grep -c '"api"' "$1" 2>/dev/null || true; }
api_summary() {
  grep -o '"api": "[^"]*"' "$1" 2>/dev/null | cut -d'"' -f4 | sort | uniq -c |
    awk '{printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1}'
}
exportable() { grep '"api"' "$1" 2>/dev/null | grep -c '"broker"' || true; }

rc_text() { # exit code as the table shows it
  case $1 in
    0) echo ok ;;
    124 | 137) echo "timeout ($1)" ;;
    *) echo "exit $1" ;;
  esac
}

# row ID MODE LABEL COMMAND...: MODE is "publish" (allocations must appear in the registry) or
# "passthrough" (the shim leaves them alone: the record count is only reported).  ROW_ENV holds
# extra VAR=value words for both runs.
row() {
  local id=$1 mode=$2 label=$3
  shift 3
  local nout=$W/$id.native.out nerr=$W/$id.native.err sout=$W/$id.shim.out serr=$W/$id.shim.err
  local list=$W/$id.list.json fifo=$W/$id.stdin.fifo
  local nrc src pid="" n=0 apis="" exp=0 same=no pub ok=0 bg wfd i t=$T left
  echo
  echo "== $label"
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then
    R_PROG+=("$label") R_NAT+=("skipped: time budget") R_SHIM+=("-") R_SAME+=("-") R_PUB+=("-") R_OK+=(0)
    echo "skipped: ${MATRIX_BUDGET:-540} s budget spent"
    return
  fi
  [ $((left / 2)) -lt "$t" ] && t=$((left / 2)) # both runs fit in what is left
  for i in "$@"; do # the programs and files this row needs from the build step
    if [[ $i == "$X"/* ]] && [ ! -e "$i" ]; then
      R_PROG+=("$label") R_NAT+=("not built") R_SHIM+=("-") R_SAME+=("-") R_PUB+=("-") R_OK+=(0)
      echo "not built: $i"
      return
    fi
  done
  # native
  timeout -k 5 "$t" env ${ROW_ENV[@]+"${ROW_ENV[@]}"} "$@" </dev/null >"$nout" 2>"$nerr"
  nrc=$?
  echo "native: $(rc_text $nrc) in $nout"
  [ "$nrc" = 0 ] || tail -n 8 "$nerr" | sed 's/^/  native stderr: /'
  # under the shim: stdin is a fifo we hold open, stdout a file we watch for "# pause PID"
  rm -f "$fifo"
  mkfifo "$fifo"
  exec {wfd}<>"$fifo"
  timeout -k 5 "$t" env ${ROW_ENV[@]+"${ROW_ENV[@]}"} LD_PRELOAD="$B/libvmmshim.so" "$@" <"$fifo" >"$sout" 2>"$serr" {wfd}>&- &
  bg=$!
  for ((i = 0; i < t * 5; i++)); do
    pid=$(sed -n 's/^# pause \([0-9][0-9]*\).*/\1/p' "$sout" | head -n 1)
    [ -n "$pid" ] && break
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.2
  done
  if [ -n "$pid" ]; then
    timeout 30 "$B/vmmctl" list --pid "$pid" --json >"$list" 2>"$W/$id.list.err"
    timeout 30 "$B/vmmctl" list --pid "$pid" >"$W/$id.list.txt" 2>&1
    tail -n 4 "$W/$id.list.txt" | sed 's/^/  vmmctl: /'
    head -n 3 "$W/$id.list.err" | sed 's/^/  vmmctl error: /'
  fi
  echo go >&"$wfd"
  exec {wfd}>&-
  wait "$bg"
  src=$?
  rm -f "$fifo"
  echo "shim:   $(rc_text $src) in $sout"
  [ "$src" = 0 ] || tail -n 8 "$serr" | sed 's/^/  shim stderr: /'
  grep -m 3 'vmmshim:' "$serr" | sed 's/^/  /'
  # same output?
  { grep -v '^#' "$nout"; echo "exit $nrc"; } >"$W/$id.native.cmp"
  { grep -v '^#' "$sout"; echo "exit $src"; } >"$W/$id.shim.cmp"
  if cmp -s "$W/$id.native.cmp" "$W/$id.shim.cmp"; then
    same=yes
  else
    same=no
    diff "$W/$id.native.cmp" "$W/$id.shim.cmp" | head -n 20 | sed 's/^/  diff: /'
  fi
  # published?
  if [ -z "$pid" ]; then
    pub="no pause seen"
  else
    n=$(count_records "$list")
    n=${n:-0}
    apis=$(api_summary "$list")
    exp=$(exportable "$list")
    if [ "$mode" = passthrough ]; then
      pub="pass-through ($n records${apis:+: $apis})"
    elif [ "$n" -gt 0 ]; then
      pub="yes: $n ($apis; ${exp:-0} exportable)"
    else
      pub="NO (0 records)"
    fi
  fi
  # a native run that fails or prints nothing is a broken row, not a pass
  if [ "$nrc" = 0 ] && [ "$(wc -l <"$W/$id.native.cmp")" -gt 1 ] && [ "$same" = yes ] && [ -n "$pid" ] &&
    { [ "$mode" = passthrough ] || [ "$n" -gt 0 ]; }; then
    ok=1
  fi
  echo "result: same output $same, published $pub => $([ $ok = 1 ] && echo PASS || echo FAIL)"
  R_PROG+=("$label") R_NAT+=("$(rc_text $nrc)") R_SHIM+=("$(rc_text $src)") R_SAME+=("$same") R_PUB+=("$pub") R_OK+=("$ok")
}

# ---- the rows ----
PY=(python3 -u)
ROW_ENV=()
row a publish "a. nvcc static runtime: cudaMalloc/cudaMallocAsync + kernels" "$X/runtime_static"
row a2 publish "a2. same source, -cudart shared" "$X/runtime_shared"
row b publish "b. driver API: cuMemAlloc/cuMemAllocAsync/cuMemAllocPitch + PTX kernel" "$X/driver" "$X/scale.ptx"
row c publish "c. cudaIpcGetMemHandle/cudaIpcOpenMemHandle, two processes" "$X/ipc"
row d publish "d. PyTorch, default caching allocator" "${PY[@]}" "$M/torch_matrix.py"
ROW_ENV=(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
row e publish "e. PyTorch, backend:cudaMallocAsync" "${PY[@]}" "$M/torch_matrix.py"
ROW_ENV=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
row f passthrough "f. PyTorch, expandable_segments:True" "${PY[@]}" "$M/torch_matrix.py"
ROW_ENV=()
row g publish "g. torch.multiprocessing: CUDA tensor shared with a spawned process" "${PY[@]}" "$M/torch_mp.py"
ROW_ENV=(XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false)
row h publish "h. JAX, XLA_PYTHON_CLIENT_ALLOCATOR=platform" "${PY[@]}" "$M/jax_matrix.py"
ROW_ENV=()
row i publish "i. CuPy, default memory pool" "${PY[@]}" "$M/cupy_matrix.py" default
row j publish "j. CuPy, MemoryAsyncPool" "${PY[@]}" "$M/cupy_matrix.py" async
row k publish "k. cuBLAS sgemm (nvcc -lcublas)" "$X/cublas"

timeout 30 "$B/vmmctl" gc >/dev/null 2>&1

# ---- the table ----
pass=0
fail=0
for i in "${!R_OK[@]}"; do
  if [ "${R_OK[$i]}" = 1 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done
{
  echo
  echo "matrix: $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START)) s, logs in $W"
  echo
  echo "| program | native | under shim | same output | allocations published |"
  echo "|---|---|---|---|---|"
  for i in "${!R_PROG[@]}"; do
    echo "| ${R_PROG[$i]} | ${R_NAT[$i]} | ${R_SHIM[$i]} | ${R_SAME[$i]} | ${R_PUB[$i]} |"
  done
  echo
  echo "matrix: $pass passed, $fail failed"
} | tee "$W/summary.md"
[ "$fail" = 0 ]
