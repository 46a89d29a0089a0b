#!/usr/bin/env bash
# Hugging Face's safetensors with numpy, for the read-path benchmark's
# loader job (tests/it/read_paths.rs): a sharded model read the way a
# serving engine's loader reads it. Installed from PyPI, pinned, into a
# venv under $TOOLS named by version. Prints the venv's python.
source "$(dirname "$0")/../lib.sh"
pip_venv safetensors 0.8.0 safetensors numpy==2.4.6
