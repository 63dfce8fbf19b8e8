#!/usr/bin/env bash
# One detached GPU session's runs, one after another, each with its log under $OUT: for a lease
# whose single commands may run 10 minutes while the whole session runs longer.
#   tests/gpu/campaign.sh start PART...   starts them (setsid) and returns at once
#   tests/gpu/campaign.sh wait SECONDS    waits up to SECONDS for the end, then prints the tables
# PARTs: mem, speed, jaxstep, weightsync, wsfirst (its first-take part), testgpu, matrix, wheel (issue 30),
# sleep and colocate (issue 29), extra (the script $CAMPAIGN_EXTRA names: a lease's one-off probe),
# or any BENCH_ONLY list (e.g. gpt,giveback).
set -u
OUT=${OUT:-/tmp}
D=/tmp/vmmshim-campaign
case ${1:-} in
  start)
    shift
    rm -rf "$D"; mkdir -p "$D/out"
    # the benches' own folders live outside $OUT, which the next call of the lease empties
    OUT=$D/out setsid bash -c '
      for part in "$@"; do
        echo "=== $part $(date +%T)" >>'"$D"'/progress
        case $part in
          testgpu) make -s test-gpu >'"$D"'/$part.log 2>&1 ;;
          matrix) make -s test-matrix >'"$D"'/$part.log 2>&1 ;;
          wsfirst) WS_PARTS=first ROUNDS=5 BUILD=build tests/gpu/weight_sync.sh >'"$D"'/$part.log 2>&1 ;;
          weightsync) BUILD=build tests/gpu/weight_sync.sh >'"$D"'/$part.log 2>&1 ;;
          wheel) BUILD=build tests/gpu/wheel.sh >'"$D"'/$part.log 2>&1 ;;
          sleep) BUILD=build tests/gpu/sleep.sh >'"$D"'/$part.log 2>&1 ;;
          colocate) BUILD=build tests/gpu/colocate.sh >'"$D"'/$part.log 2>&1 ;;
          extra) bash "$CAMPAIGN_EXTRA" >'"$D"'/$part.log 2>&1 ;;
          *) BENCH_ONLY=$part BUILD=build tests/gpu/bench.sh >'"$D"'/$part.log 2>&1 ;;
        esac
        echo "=== $part rc=$? $(date +%T)" >>'"$D"'/progress
      done
      echo done >>'"$D"'/progress' _ "$@" </dev/null >/dev/null 2>&1 &
    echo "started: $*"
    ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt "$end" ] && ! grep -qx done "$D/progress" 2>/dev/null; do sleep 5; done
    cat "$D/progress"
    mkdir -p "$OUT/c"; cp "$D"/*.log "$OUT/c/" 2>/dev/null; cp "$D"/out/vmmshim-bench/*table* "$OUT/c/" 2>/dev/null
    for f in "$D"/*.log; do echo "##### $f"; grep -E '^\||^R |^###|passed, [0-9]+ failed|PASS|FAIL|median|interleaved|no fd|Traceback|Error' "$f" | tail -60; done
    ;;
  *) echo "usage: campaign.sh start PART... | wait SECONDS"; exit 2 ;;
esac
