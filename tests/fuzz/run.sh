#!/usr/bin/env bash
# `make fuzz`: runs each libFuzzer target named on the command line for FUZZ_SECONDS, seeded from
# tests/fuzz/corpus/<target>/, then prints one row per target and `fuzz: N passed, N failed`.
# A target passes when libFuzzer ends without a crash, leak, timeout or out-of-memory.  What a run
# writes (corpus growth, crash inputs, logs) stays in $FUZZ_BUILD/work, outside the repository, until
# the next run: each starts from the seeds alone, so 20 s in CI buys the same search every time.
set -u
cd "$(dirname "$0")/../.."
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
secs=${FUZZ_SECONDS:-60}
work=$FUZZ_BUILD/work

# Inputs larger than the seeds need buy nothing: a registry or name table seed is a few KiB of
# patches, an IPC handle 64 bytes and two control bytes.
max_len() {
  case $1 in
    registry|names) echo 16384 ;;
    ipc) echo 80 ;;
    broker) echo 2048 ;;
    *) echo 4096 ;;
  esac
}

stat_of() { sed -n "s/^stat::$2: *//p" "$1" | tail -n 1; }
# cov: and ft: of libFuzzer's last status line (its DONE line when it ran to the end).
field_of() { grep -E '^#[0-9]+.*cov: ' "$1" | tail -n 1 | sed -nE "s/.* $2: ([0-9]+).*/\\1/p"; }

passed=0; failed=0
table=$(printf '%-10s %-6s %12s %9s %7s %7s %7s' target result execs "exec/s" cov ft corpus)
for t in "$@"; do
  bin=$FUZZ_BUILD/fuzz_$t
  rm -rf "$work/corpus/$t" "$work/artifacts/$t"
  mkdir -p "$work/corpus/$t" "$work/artifacts/$t"
  log=$work/$t.log
  # The seeds directory comes second: libFuzzer writes new entries into the first one only.
  # -timeout: one input may take 10 s (a registry lookup on a crafted index is the slowest).
  "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len="$(max_len "$t")" \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/$t/" \
    "$work/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1 &
  pid=$!
  wait "$pid"; rc=$?
  rm -f "/dev/shm/vmmshim-fuzz-$pid" # the registry target's segment, left only by a crash in vmm_open
  result=pass
  if [ "$rc" = 0 ]; then passed=$((passed + 1)); else result=FAIL; failed=$((failed + 1)); fi
  corpus=$(find "$work/corpus/$t" -type f | wc -l)
  table+=$(printf '\n%-10s %-6s %12s %9s %7s %7s %7s' "$t" "$result" "$(stat_of "$log" number_of_executed_units)" \
    "$(stat_of "$log" average_exec_per_sec)" "$(field_of "$log" cov)" "$(field_of "$log" ft)" "$corpus")
  if [ "$result" = FAIL ]; then
    echo "fuzz_$t: FAIL (rc=$rc, log $log)"
    grep -E 'ERROR: |SUMMARY: |Test unit written to|^artifact_prefix' "$log" | sed 's/^/    /' | head -n 20
    grep -A 12 -E '^==[0-9]+==ERROR' "$log" | sed 's/^/    /' | head -n 30
  fi
done
printf '%s\n' "$table"
echo "fuzz: ${passed} passed, ${failed} failed"
[ "$failed" = 0 ]
