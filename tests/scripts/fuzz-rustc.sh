#!/usr/bin/env bash
# rustc wrapper (RUSTC_WRAPPER) for the fuzz targets' build in
# tests/scripts/fuzz.sh: adds libFuzzer's coverage instrumentation (what
# cargo-fuzz puts in RUSTFLAGS) to the fuzz targets and to the driver's
# library built with its `fuzz` feature, and passes every other crate
# through untouched. The ~400 dependencies then compile exactly as in the
# test build, so the fuzz build reuses them from the same target dir
# instead of compiling them a second time with RUSTFLAGS of their own.
# Coverage guides the fuzzer through our parsers; a dependency's branches
# are not fed back (they were with cargo-fuzz).
rustc=$1
shift
instrument=0
case "${CARGO_PKG_NAME:-}" in
  modelcache-csi-fuzz) instrument=1 ;;
  modelcache-csi)
    # The library, not its build script, and only the `fuzz` variant: the
    # test build's library (no feature) must stay uninstrumented.
    lib=0 feature=0 prev=""
    for a in "$@"; do
      [ "$prev" = --crate-name ] && [ "$a" = modelcache_csi ] && lib=1
      [ "$prev" = --cfg ] && [ "$a" = 'feature="fuzz"' ] && feature=1
      prev=$a
    done
    [ "$lib" = 1 ] && [ "$feature" = 1 ] && instrument=1
    ;;
esac
if [ "$instrument" = 1 ]; then
  set -- "$@" --cfg fuzzing --check-cfg 'cfg(fuzzing)' \
    -Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    -Cdebug-assertions -Coverflow-checks
fi
exec "$rustc" "$@"
