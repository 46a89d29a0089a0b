#!/usr/bin/env bash
# cargo-fuzz for tests/scripts/fuzz.sh, from crates.io (pinned, --locked),
# installed under its own version-named root so a warm run skips it. It
# runs on stable Rust with `--sanitizer none`: every flag it then passes to
# rustc (sancov passes, coverage llvm-args, --cfg fuzzing) is stable.
# libfuzzer-sys compiles libFuzzer itself with the C++ compiler (g++).
# Prints the directory holding the binary (and nothing else) on stdout.
source "$(dirname "$0")/../lib.sh"
bin="$TOOLS/cargo-fuzz-$CARGO_FUZZ_VERSION/bin"
if [ ! -x "$bin/cargo-fuzz" ]; then
  log "cargo install cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION" \
    --root "$TOOLS/cargo-fuzz-$CARGO_FUZZ_VERSION" >&2
fi
[ -x "$bin/cargo-fuzz" ] || { echo "cargo-fuzz was not installed in $bin" >&2; exit 1; }
echo "$bin"
