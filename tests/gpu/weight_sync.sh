#!/usr/bin/env bash
# `make bench-gpu BENCH_ONLY=weightsync` (issue 16): a second process takes every parameter of a
# trainer, zero-copy, by reduce_tensor (legacy CUDA IPC, the baseline), Registry.open_many and
# open_tensors (tests/gpu/weight_sync.py says how).  Parts (WS_PARTS, comma-separated, default all):
#   gpt2  GPT-2 from config (148 parameters, 777 MiB) under the default allocator,
#         backend:cudaMallocAsync and expandable_segments:True: per way the first take and the
#         median of ROUNDS (5) takes, the spread, the ratio to reduce_tensor's rebuild round by
#         round, logits against the trainer's (also after an in-place optimizer step, not imported
#         again), each tensor opened alone (0 may fail), VMMSHIM_IMPORT_THREADS 1,2,4,8;
#   7b    a 7B-class layout (291 bf16 tensors, 13.5 GB): time, and the share of each step;
#   load  8 companions take the model after every trainer step: none may fail, the step time with
#         them against without (<= 1.02), the broker's latency under that load;
#   first a Llama-shaped 1B-class layout (18 layers, width 2048, GQA, 165 bf16 tensors, 1.76 GiB),
#         fresh trainers every round: the first take from a freshly started owner and a later
#         cold companion's take (steady), each against reduce_tensor's in the same rounds (<= 1.0x),
#         and the first take with VMMSHIM_PREEXPORT_MS=-1 (reported), under each allocator setting
#         of WS_FIRST_CONFS (default all three; reduce_tensor's trainer under the default one where
#         the setting is backend:cudaMallocAsync), WS_FIRST_ROUNDS (9) rounds each: with 5, one
#         row's median ratio moved 0.78-1.09x between runs (reduce_tensor's own take 7.0-10.1 ms).
#         It does not fit the 570 s with the others: run it alone, WS_PARTS=first (about 6 minutes,
#         WS_FIRST_S 420).
# About 4-6 minutes on an H100, each part capped (WS_GPT2_S 240, WS_7B_S 150, WS_LOAD_S 180 s) and
# skipped when it would not fit what is left of WS_BUDGET (570 s): one 10-minute command.  Prints
# each part's PASS/FAIL lines and tables, then "weight-sync: N passed, N failed".  Raw results and
# every process's stderr: ${OUT:-/tmp}/vmmshim-weightsync/.
# --dry (or BENCH_DRY=1): no GPU, no torch: the same orchestration over the emulated driver
# (build/fakecuda), trainers under the shim holding buffers of the same names and scaled shapes;
# checks the script, measures nothing real (speed targets are reported, not counted).
set -u
cd "$(dirname "$0")/../.." || exit 1
B=${BUILD:-build}
case $B in /*) ;; *) B=$PWD/$B ;; esac
W=${OUT:-/tmp}/vmmshim-weightsync
DRY=${BENCH_DRY:-0}
[ "${1:-}" = --dry ] && DRY=1
PARTS=${WS_PARTS:-gpt2,7b,load,first}
BUDGET=${WS_BUDGET:-570}
ROUNDS=${ROUNDS:-5}
START=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset PYTORCH_CUDA_ALLOC_CONF
rm -rf "$W"
mkdir -p "$W"
pass=0
fail=0

if [ ! -f "$B/libvmmshim.so" ] || [ ! -f "$B/libvmmshim-client.so" ]; then
  echo "weight-sync: $B/libvmmshim.so or libvmmshim-client.so missing (build on the development machine, carry build/)"
  echo "weight-sync: 0 passed, 1 failed"
  exit 1
fi
extra=()
if [ "$DRY" = 1 ]; then
  if [ ! -f "$B/fakecuda/libcuda.so.1" ]; then
    echo "weight-sync: --dry needs the emulated driver ($B/fakecuda): run make first"
    echo "weight-sync: 0 passed, 1 failed"
    exit 1
  fi
  export LD_LIBRARY_PATH="$B/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export VMMSHIM_BROKER_DIR=${VMMSHIM_BROKER_DIR:-/tmp/vmmshim-wsdry-$$}
  extra=(--standin)
  echo "== weight-sync --dry: the orchestration over the emulated driver, no GPU (nothing measured is real)"
else
  if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>"$W/torch.err"; then
    echo "weight-sync: skipped: torch with CUDA is not importable here ($(tail -n 1 "$W/torch.err"))"
    echo "weight-sync: 0 passed, 0 failed (skipped)"
    exit 0
  fi
  dev=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  echo "== weight-sync on ${dev:-an unknown GPU}; torch $(python3 -c 'import torch; print(torch.__version__)')"
fi

# part NAME CAP ARGS...: one part under `timeout`, if it fits what is left of the budget
part() {
  local name=$1 cap=$2 left
  shift 2
  case ",$PARTS," in *",$name,"*) ;; *) return ;; esac
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s of the ${BUDGET} s budget left"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo
  echo "== part $name (at most $cap s)"
  timeout -k 10 "$cap" python3 tests/gpu/weight_sync.py run --part "$name" --build "$B" --out "$W" \
    --rounds "$ROUNDS" --budget $((cap - 15)) "${extra[@]}" "$@" 2>&1 | tee "$W/part-$name.txt"
  local rc=${PIPESTATUS[0]} line p f
  line=$(grep -E "^weight-sync $name: [0-9]+ passed, [0-9]+ failed" "$W/part-$name.txt" | tail -n 1)
  p=$(echo "$line" | awk '{print $3}')
  f=$(echo "$line" | awk '{print $5}')
  if [ -z "$p" ]; then
    echo "FAIL part $name ended without its summary (exit $rc)"
    p=0
    f=1
  elif [ "$rc" != 0 ] && [ "$f" = 0 ]; then
    f=1
  fi
  pass=$((pass + p))
  fail=$((fail + f))
}

if [ "$DRY" = 1 ]; then
  part gpt2 120 --scale 8 --rounds 2 --threads 1,2
  part 7b 120 --scale 16 --rounds 2 --threads 1,2
  part load 120 --scale 8 --steps 12 --load-alone 3 --load-blocks 1
  part first 120 --scale 16 --rounds 2
  rm -rf "$VMMSHIM_BROKER_DIR"
else
  part gpt2 "${WS_GPT2_S:-240}"
  part 7b "${WS_7B_S:-150}"
  part load "${WS_LOAD_S:-180}"
  part first "${WS_FIRST_S:-420}" --confs "${WS_FIRST_CONFS:-default,backend:cudaMallocAsync,expandable_segments:True}" \
    --rounds "${WS_FIRST_ROUNDS:-9}"
fi
echo
echo "weight-sync: $pass passed, $fail failed$([ "$DRY" = 1 ] && echo ' (--dry: the emulated driver)') in $((SECONDS - START)) s"
[ "$fail" = 0 ]
