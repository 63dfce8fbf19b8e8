#!/usr/bin/env bash
# Issue 27 part 1's workload on the GPU: records its allocation trace natively (alloc_trace.c),
# then runs it natively and under the shim in PROBE_ROUNDS alternated rounds, NVML sampled from
# another process (nvml_sampler.py), under backend:cudaMallocAsync.  Lines "P side round ..." and
# the programs' R lines; the trace goes to $OUT/gpt-async.trace.gz.
set -u
B=${BUILD:-build}
OUT=${OUT:-/tmp}
R=${PROBE_ROUNDS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PROBE_CONF:-backend:cudaMallocAsync}
export PYTHONUNBUFFERED=1
if [ "${PROBE_TRACE:-1}" = 1 ]; then
  ALLOC_TRACE=/tmp/gpt.trace LD_PRELOAD=$B/tests/liballoc_trace.so python3 tests/gpu/bench_mem_torch.py gpt traced | grep '^R'
  wc -l /tmp/gpt.trace; gzip -c /tmp/gpt.trace >"$OUT/gpt-async.trace.gz"; ls -la "$OUT/gpt-async.trace.gz"
fi
for r in $(seq 1 "$R"); do
  sides="native shim"; [ $((r % 2)) = 0 ] && sides="shim native"
  for side in $sides; do
    if [ "$side" = shim ]; then
      o=$(VMMSHIM_REGISTRY=/probe-$r LD_PRELOAD=$PWD/$B/libvmmshim.so python3 tests/gpu/nvml_sampler.py -- python3 tests/gpu/bench_mem_torch.py gpt "$side" 2>&1)
    else
      o=$(python3 tests/gpu/nvml_sampler.py -- python3 tests/gpu/bench_mem_torch.py gpt "$side" 2>&1)
    fi
    echo "P $side $r $(echo "$o" | grep -E '^(NVML|R )' | tr '\n' ' ')"
  done
done
