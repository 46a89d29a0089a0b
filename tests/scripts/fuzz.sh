#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ (libFuzzer through libfuzzer-sys) and
# runs each for a bounded time (MODELCACHE_FUZZ_SECONDS each, 30 by
# default: 3 minutes for the six), starting from the committed seeds in
# fuzz/corpus/<target>/. New inputs go to $TARGET/fuzz/corpus/<target>/
# (not committed), crashes to fuzz/artifacts/<target>/. Prints a line per
# target and, last, `fuzz: N passed, M failed`, which test.sh counts;
# exits non-zero when a target crashed, hung or did not build.
# docs/testing.md says how to run them longer.
#
#   fuzz.sh          build (a no-op when built), then run every target,
#                    two at a time (each libFuzzer run is one thread)
#   fuzz.sh build    only build
source "$(dirname "$0")/lib.sh"
SECS="${MODELCACHE_FUZZ_SECONDS:-30}"
TARGETS=(uri allowed_sources storage_class_params volume_id registration_frames signature_bundle)
FUZZ="$ROOT/fuzz"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
LOG="$TARGET/fuzz"
mkdir -p "$LOG"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The fuzz crate is a member of the driver's workspace and builds in its
# target dir: fuzz-rustc.sh instruments only the targets and the driver's
# library built with its `fuzz` feature, so every dependency is the test
# build's, already compiled. No sanitizer (AddressSanitizer needs nightly;
# safe Rust's memory errors are panics anyway); debug assertions, so
# arithmetic overflow panics. The workspace wrapper (clippy, in test.sh)
# is left out: the targets are linted with the rest by `cargo clippy`.
unset RUSTC_WORKSPACE_WRAPPER
export RUSTC_WRAPPER="$ROOT/tests/scripts/fuzz-rustc.sh"

passed=0 failed=0
log "fuzz build (log: $LOG/build.log)"
: > "$LOG/build.log"
if ! cargo build --locked -p modelcache-csi-fuzz --bins >>"$LOG/build.log" 2>&1; then
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
  mkdir -p "$LOG/corpus/$t" "$FUZZ/artifacts/$t"
  "$TARGET/debug/$t" "$LOG/corpus/$t" "$FUZZ/corpus/$t" -artifact_prefix="$FUZZ/artifacts/$t/" \
    -max_total_time="$SECS" -timeout=10 -print_final_stats=1 >"$LOG/$t.log" 2>&1 || rc=$?
  # A target that ran blind (its coverage missing) finds little: fail it.
  if [ "$rc" -eq 0 ] && ! grep -q 'INFO: Loaded [0-9]* modules *([1-9][0-9]* inline 8-bit counters)' "$LOG/$t.log"; then
    echo "no coverage counters loaded: the build did not instrument the target" >>"$LOG/$t.log"
    rc=2
  fi
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
