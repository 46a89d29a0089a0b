#!/usr/bin/env bash
# The project's one test command: installs what it needs, checks formatting
# and lints, runs unit and integration tests (real mounts, in a private mount
# namespace), then csi-sanity against every backend.
source "$(dirname "$0")/lib.sh"
need_root
cd "$ROOT"

"$ROOT/tests/scripts/install-test-deps.sh"
command -v rustfmt >/dev/null && command -v cargo-clippy >/dev/null || rustup component add rustfmt clippy

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --all-targets --locked -- -D warnings
log "cargo build"
cargo build --locked --all-targets

# A private mount namespace: whatever a failing test leaves mounted dies with it.
log "cargo test"
set +e
unshare -m --propagation private cargo test --locked --no-fail-fast 2>&1 | tee target/cargo-test.log
cargo_rc=${PIPESTATUS[0]}
log "csi-sanity"
"$ROOT/tests/scripts/csi-sanity.sh" 2>&1 | tee target/csi-sanity.log
sanity_rc=${PIPESTATUS[0]}
set -e

read -r passed failed < <(awk '
  /^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
  /Passed \| .* Failed/ { for (i = 1; i <= NF; i++) { if ($(i+1) == "Passed") p += $i; if ($(i+1) == "Failed") f += $i } }
  END { print p + 0, f + 0 }' target/cargo-test.log target/csi-sanity.log)
leaks=$(losetup -a | grep -c -E '/tmp/(\.tmp|mc-)' || true)
if [ "$leaks" -gt 0 ]; then
  echo "leaked loop devices:" >&2; losetup -a >&2
fi
echo
echo "summary: $passed passed, $failed failed"
[ "$cargo_rc" -eq 0 ] && [ "$sanity_rc" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$leaks" -eq 0 ]
