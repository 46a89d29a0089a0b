#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ and runs each for a bounded time
# (MODELCACHE_FUZZ_SECONDS each, 30 by default: 3 minutes for the six),
# starting from the committed seeds in fuzz/corpus/<target>/. New inputs go
# to fuzz/target/corpus/<target>/ (not committed), crashes to
# fuzz/artifacts/<target>/. Prints a line per target and, last,
# `fuzz: N passed, M failed`, which test.sh counts; exits non-zero when a
# target crashed, hung or did not build. docs/testing.md says how to run
# them longer.
#
#   fuzz.sh          build (a no-op when built), then run every target,
#                    two at a time (each libFuzzer run is one thread)
#   fuzz.sh build    only build: test.sh starts this in the background
#                    beside `cargo test`, so the run finds the build done
source "$(dirname "$0")/lib.sh"
SECS="${MODELCACHE_FUZZ_SECONDS:-30}"
TARGETS=(uri allowed_sources storage_class_params volume_id registration_frames signature_bundle)
FUZZ="$ROOT/fuzz"
LOG="${CARGO_TARGET_DIR:-$ROOT/target}/fuzz"
mkdir -p "$LOG"
export PATH="$("$ROOT/tests/scripts/deps/cargo-fuzz.sh"):$PATH"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# -s none: the other sanitizers need nightly rustc; panics and overflow
# (debug assertions, so overflow checks) are what we look for.
# --dev: unoptimised. The instrumented build is a second full compile of the
# driver and its ~400 dependencies; optimised it was the longest step of a
# cold run (35 min under load), while 30 s of fuzzing per target gains
# little from the speed. The build is kept beside the tool cache, so a
# clean checkout (CI's) rebuilds only the driver itself.
FUZZ_TARGET="${MODELCACHE_FUZZ_TARGET_DIR:-$(dirname "$TOOLS")/fuzz-target}"
FLAGS=(--fuzz-dir "$FUZZ" --target-dir "$FUZZ_TARGET" --sanitizer none --dev)

passed=0 failed=0
log "cargo fuzz build (log: $LOG/build.log)"
[ "${1:-}" = build ] && : > "$LOG/build.log"
if ! cargo fuzz build "${FLAGS[@]}" >>"$LOG/build.log" 2>&1; then
  tail -n 40 "$LOG/build.log" >&2
  echo "fuzz: the targets did not build"
  echo "fuzz: 0 passed, ${#TARGETS[@]} failed"
  exit 1
fi
[ "${1:-}" = build ] && exit 0
# run_target T: fuzz T for SECS; its exit status in $LOG/T.rc.
# -timeout: one input running 10 s is a hang; a crash writes
# fuzz/artifacts/T/crash-*.
run_target() {
  local t=$1 rc=0
  mkdir -p "$FUZZ/target/corpus/$t"
  cargo fuzz run "${FLAGS[@]}" "$t" "$FUZZ/target/corpus/$t" "$FUZZ/corpus/$t" -- \
    -max_total_time="$SECS" -timeout=10 -print_final_stats=1 >"$LOG/$t.log" 2>&1 || rc=$?
  echo "$rc" > "$LOG/$t.rc"
}
for ((i = 0; i < ${#TARGETS[@]}; i += 2)); do
  run_target "${TARGETS[i]}" &
  [ -z "${TARGETS[i + 1]:-}" ] || run_target "${TARGETS[i + 1]}"
  wait
done
for t in "${TARGETS[@]}"; do
  rc=$(cat "$LOG/$t.rc" 2>/dev/null || echo 1)
  runs=$(awk '/^stat::number_of_executed_units:/ { print $2 }' "$LOG/$t.log")
  rate=$(awk '/^stat::average_exec_per_sec:/ { print $2 }' "$LOG/$t.log")
  cov=$(grep -o 'cov: [0-9]*' "$LOG/$t.log" | tail -n1 | cut -d' ' -f2 || true)
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    echo "fuzz $t: ok, ${runs:-?} runs in ${SECS} s (${rate:-?}/s), coverage ${cov:-?}"
  else
    failed=$((failed + 1))
    echo "fuzz $t: FAILED (exit $rc) after ${runs:-?} runs; log $LOG/$t.log"
    grep -E "panicked at|SUMMARY|Failing input|artifact" "$LOG/$t.log" | head -n 8 | sed 's/^/    /' || true
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
