#!/usr/bin/env bash
# The OpenSSF model-signing CLI (sigstore's model-transparency, PyPI
# model-signing), which signs the models tests/it/signatures.rs verifies:
# pinned, in a venv under $TOOLS named by version. pyOpenSSL is what its
# certificate commands import. Prints the path of the `model_signing` CLI.
source "$(dirname "$0")/../lib.sh"
python=$(pip_venv model-signing 1.1.1 model_signing pyopenssl==26.4.0)
echo "$(dirname "$python")/model_signing"
