#!/usr/bin/env bash
# Python grpcio (gRPC C-core) for tests/any_client.rs, which calls the CSI
# socket the way a Python or C++ client does. Installed from PyPI, pinned,
# into a venv under $TOOLS named by version. Prints the venv's python.
source "$(dirname "$0")/../lib.sh"
GRPCIO_VERSION="1.85.1"
venv="$TOOLS/grpcio-$GRPCIO_VERSION"
if [ ! -f "$venv.complete" ]; then
  log "pip install grpcio==$GRPCIO_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "grpcio==$GRPCIO_VERSION" >&2
  "$venv/bin/python" -c 'import grpc' >&2
  touch "$venv.complete"
fi
echo "$venv/bin/python"
