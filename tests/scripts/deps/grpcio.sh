#!/usr/bin/env bash
# Python grpcio (gRPC C-core) for tests/it/any_client.rs, which calls the CSI
# socket the way a Python or C++ client does. Installed from PyPI, pinned,
# into a venv under $TOOLS named by version. Prints the venv's python.
source "$(dirname "$0")/../lib.sh"
pip_venv grpcio 1.85.1 grpc
