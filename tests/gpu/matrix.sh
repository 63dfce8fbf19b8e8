#!/usr/bin/env bash
# `make test-matrix`: real programs and frameworks, each run natively and under the shim on a
# GPU machine, with build/ (shim, vmmctl, client library) carried from a development machine.
# Per program: "same output" = stdout and exit code identical after dropping lines that start
# with '#' (the programs print pointers and pids only there); "published" = while it runs under
# the shim it stops once ("# pause PID", then waits for a line on stdin) and `vmmctl list --pid
# PID --json` counts its allocations (any api: cudaMalloc, cuMemAlloc, ..., and cuMemMap for
# memory the program maps itself with cuMemCreate + cuMemMap; "exportable" = handle kind
# "broker").  Row f also checks that every model parameter lies in exportable cuMemMap records;
# row h2 compares the records' bytes with JAX's preallocated arena and is "report" only (not
# counted) when they fall short.  Every log goes to ${OUT:-/tmp}/vmmshim-matrix/.  Ends with one
# table and "matrix: N passed, N failed".
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
M=$PWD/tests/gpu/matrix
REGCHECK=$PWD/tests/gpu/regcheck.py
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
R_PROG=() R_NAT=() R_SHIM=() R_SAME=() R_PUB=() R_OK=() # R_OK: 1 pass, 0 fail, 2 report only
ROW_ENV=()

# Summary of an allocation listing: "N" and "api xCOUNT, ...; E exportable".  Every api name
# counts alike (cuMemMap, for memory the program maps itself, as much as cudaMalloc).
count_records() { grep -c '"api"' "$1" 2>/dev/null || true; }
api_summary() {
  grep -o '"api": "[^"]*"' "$1" 2>/dev/null | cut -d'"' -f4 | sort | uniq -c |
    awk '{printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1}'
}
exportable() { grep '"api"' "$1" 2>/dev/null | grep -c '"broker"' || true; }

result_text() { # R_OK as the table shows it
  case $1 in
    1) echo PASS ;;
    2) echo "report (not counted)" ;;
    *) echo FAIL ;;
  esac
}

rc_text() { # exit code as the table shows it
  case $1 in
    0) echo ok ;;
    124 | 137) echo "timeout ($1)" ;;
    *) echo "exit $1" ;;
  esac
}

# row ID MODE LABEL COMMAND...: MODE is "publish" (allocations must appear in the registry),
# "passthrough" (the shim leaves them alone: the record count is only reported), "params" (as
# publish, and every "# param NAME 0xADDR NBYTES" line the program prints before its pause must
# lie in exportable cuMemMap records: `vmmctl show` of each during the pause, regcheck.py cover
# on the listing) or "prealloc" (as publish, and the records must hold >= 90% of the bytes of
# JAX's "# memory_stats" line; short of that the row is "report", counted neither way).
# ROW_ENV holds extra words for `env` in both runs (VAR=value, or -u VAR).
row() {
  local id=$1 mode=$2 label=$3
  shift 3
  local nout=$W/$id.native.out nerr=$W/$id.native.err sout=$W/$id.shim.out serr=$W/$id.shim.err
  local list=$W/$id.list.json fifo=$W/$id.stdin.fifo
  local nrc src pid="" n=0 apis="" exp=0 same=no pub ok=0 pubok=0 bg wfd i t=$T left crc
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
    if [ "$mode" = params ]; then # each parameter's record, while it lives
      : >"$W/$id.show.txt"
      sed -n 's/^# param [^ ]* \(0x[0-9a-fA-F]*\) .*/\1/p' "$sout" | while read -r addr; do
        echo "-- vmmctl show $pid $addr"
        timeout 30 "$B/vmmctl" show "$pid" "$addr" 2>&1
      done >>"$W/$id.show.txt"
      grep -E '^(-- vmmctl|address|size|made by|export|vmmctl: error)' "$W/$id.show.txt" | head -n 10 |
        sed 's/^/  show: /'
    fi
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
    case $mode in
      passthrough)
        pub="pass-through ($n records${apis:+: $apis})"
        pubok=1
        ;;
      params)
        timeout 60 python3 "$REGCHECK" cover "$list" "$sout" --api cuMemMap >"$W/$id.cover.txt" 2>&1
        crc=$?
        sed 's/^/  cover: /' "$W/$id.cover.txt"
        if [ "$n" -eq 0 ]; then
          pub="NO (0 records)"
        elif ! grep -q '"api": "cuMemMap"' "$list"; then
          pub="NO cuMemMap records ($n: $apis; ${exp:-0} exportable)"
        else
          pub="yes: $n ($apis; ${exp:-0} exportable; $(tail -n 1 "$W/$id.cover.txt") in exportable cuMemMap records)"
          [ "$crc" = 0 ] && pubok=1
        fi
        ;;
      prealloc)
        timeout 60 python3 "$REGCHECK" prealloc "$list" "$sout" >"$W/$id.prealloc.txt" 2>"$W/$id.prealloc.err"
        crc=$?
        pub=$(tail -n 1 "$W/$id.prealloc.txt")
        [ -n "$pub" ] || pub="regcheck failed: $(tail -n 1 "$W/$id.prealloc.err")"
        case $crc in
          0) pubok=1 ;;
          3) pubok=2 ;;
        esac
        ;;
      *)
        if [ "$n" -gt 0 ]; then
          pub="yes: $n ($apis; ${exp:-0} exportable)"
          pubok=1
        else
          pub="NO (0 records)"
        fi
        ;;
    esac
  fi
  # a native run that fails or prints nothing is a broken row, not a pass
  if [ "$nrc" = 0 ] && [ "$(wc -l <"$W/$id.native.cmp")" -gt 1 ] && [ "$same" = yes ] && [ -n "$pid" ]; then
    ok=$pubok
  fi
  echo "result: same output $same, published $pub => $(result_text "$ok")"
  R_PROG+=("$label") R_NAT+=("$(rc_text $nrc)") R_SHIM+=("$(rc_text $src)") R_SAME+=("$same") R_PUB+=("$pub") R_OK+=("$ok")
}

# For a human: which driver route JAX's default arena takes under the shim.  One more run of
# row h2's program (same environment) with the shim's debug log, then how often a few words
# occur in it and its first 40 lines.  Informative only: no pass or fail.  Runs after the last
# row, so that it never takes a counted row's time.
JAX_DEFAULT_ENV=(-u XLA_PYTHON_CLIENT_ALLOCATOR -u XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION=0.5)
jax_debug() {
  local log=$W/jax-debug.log rc w c t=$T left=$((BUDGET - (SECONDS - START)))
  echo
  echo "== JAX default allocator under the shim, VMMSHIM_LOG_LEVEL=debug (informative)"
  if [ "$left" -lt 40 ]; then
    echo "skipped: ${MATRIX_BUDGET:-540} s budget spent"
    return
  fi
  [ "$left" -lt "$t" ] && t=$left
  rm -f "$log"
  timeout -k 5 "$t" env "${JAX_DEFAULT_ENV[@]}" VMMSHIM_LOG_LEVEL=debug VMMSHIM_LOG_FILE="$log" \
    LD_PRELOAD="$B/libvmmshim.so" "${PY[@]}" "$M/jax_matrix.py" default </dev/null >"$W/jax-debug.out" 2>"$W/jax-debug.err"
  rc=$?
  [ -f "$log" ] || : >"$log"
  echo "run: $(rc_text $rc); log $log, $(wc -l <"$log") lines"
  [ "$rc" = 0 ] || tail -n 8 "$W/jax-debug.err" | sed 's/^/  stderr: /'
  grep '^# memory_stats' "$W/jax-debug.out" | cut -c1-400 | sed 's/^/  /'
  for w in cuMemCreate cuMemMap cuMemAllocAsync cuMemAlloc pool; do # cuMemAlloc also counts cuMemAllocAsync lines
    c=$(grep -c -- "$w" "$log")
    printf '  grep -c %-16s %s\n' "$w" "${c:-0}"
  done
  echo "  first 40 lines of the log:"
  head -n 40 "$log" 2>/dev/null | sed 's/^/  | /'
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
row f params "f. PyTorch, expandable_segments:True (cuMemCreate + cuMemMap)" "${PY[@]}" "$M/torch_matrix.py"
ROW_ENV=()
row g publish "g. torch.multiprocessing: CUDA tensor shared with a spawned process" "${PY[@]}" "$M/torch_mp.py"
ROW_ENV=(XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false)
row h publish "h. JAX, XLA_PYTHON_CLIENT_ALLOCATOR=platform" "${PY[@]}" "$M/jax_matrix.py"
ROW_ENV=("${JAX_DEFAULT_ENV[@]}")
row h2 prealloc "h2. JAX, default allocator (BFC arena, preallocating half the GPU)" "${PY[@]}" "$M/jax_matrix.py" default
ROW_ENV=()
row i publish "i. CuPy, default memory pool" "${PY[@]}" "$M/cupy_matrix.py" default
row j publish "j. CuPy, MemoryAsyncPool" "${PY[@]}" "$M/cupy_matrix.py" async
row k publish "k. cuBLAS sgemm (nvcc -lcublas)" "$X/cublas"
jax_debug

timeout 30 "$B/vmmctl" gc >/dev/null 2>&1

# ---- the table ----
pass=0
fail=0
reported=()
for i in "${!R_OK[@]}"; do
  case ${R_OK[$i]} in
    1) pass=$((pass + 1)) ;;
    2) reported+=("${R_PROG[$i]%%.*}") ;;
    *) fail=$((fail + 1)) ;;
  esac
done
{
  echo
  echo "matrix: $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START)) s, logs in $W"
  echo
  echo "| program | native | under shim | same output | allocations published | result |"
  echo "|---|---|---|---|---|---|"
  for i in "${!R_PROG[@]}"; do
    echo "| ${R_PROG[$i]} | ${R_NAT[$i]} | ${R_SHIM[$i]} | ${R_SAME[$i]} | ${R_PUB[$i]} | $(result_text "${R_OK[$i]}") |"
  done
  echo
  [ ${#reported[@]} = 0 ] || echo "matrix: report only, counted neither way: ${reported[*]}"
  echo "matrix: $pass passed, $fail failed"
} | tee "$W/summary.md"
[ "$fail" = 0 ]
