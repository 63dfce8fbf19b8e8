#!/usr/bin/env bash
# Issue 29's colocated RL loop on one GPU (tests/gpu/colocate.py says how): a trainer and a rollout
# process taking turns, both under the shim (the trainer's optimizer state and gradients paused and
# kept, the rollout's KV cache paused and discarded, the weights taken zero-copy by name), the same
# loop today's way (torch_memory_saver's preload mode, reduce_tensor, the weights copied every
# iteration), and a run that never sleeps.  Prints R lines, a table (iteration time, peak NVML of
# the pair, time in pause and resume, bit-exact losses, weights and rollout outputs), PASS/FAIL
# lines and "colocate: N passed, N failed"; about 2 minutes on an H100, at most COLO_TIMEOUT (540) s.
# TMS comes from .tms/ (ignored; .tms/site on PYTHONPATH, its preload library found there, or
# TMS_SITE and TMS_PRELOAD; COLO_TMS_ENV="NAME=VALUE ..." adds what .tms/README asks for); without
# it that run says SKIP and the others still run.  Knobs: COLO_LAYERS (12: 0.68 B parameters),
# COLO_ITERS (6), COLO_STEPS (4), COLO_KV_GIB (16), COLO_TMS_WEIGHTS (resident|sleep), COLO_MODES
# (ref,vmm,tms); arguments go to colocate.py (--dry: the orchestration on the CPU, a tiny model).
# Every process's stderr, raw.jsonl and table.md: ${OUT:-/tmp}/vmmshim-colocate/.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=${BUILD:-build}
case $B in /*) ;; *) B=$PWD/$B ;; esac
W=${OUT:-/tmp}/vmmshim-colocate
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset PYTORCH_CUDA_ALLOC_CONF
rm -rf "$W"
mkdir -p "$W"
dev=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
echo "== colocate on ${dev:-no GPU nvidia-smi could name}"
timeout -k 10 "${COLO_TIMEOUT:-540}" "${PYTHON:-python3}" tests/gpu/colocate.py run --build "$B" --out "$W" "$@" 2>&1 |
  tee "$W/colocate.txt"
rc=${PIPESTATUS[0]}
if ! grep -qE '^colocate: [0-9]+ passed, [0-9]+ failed' "$W/colocate.txt"; then
  echo "FAIL colocate.py ended without its summary (exit $rc; 124: past COLO_TIMEOUT)"
  echo "colocate: 0 passed, 1 failed"
  exit 1
fi
exit "$rc"
