#!/usr/bin/env bash
# The AWS CLI (v1, the one PyPI ships as `awscli`) for the puller benchmark,
# in a virtualenv under $TOOLS named by its version. Prints the `aws` path.
source "$(dirname "$0")/../scripts/lib.sh"
AWSCLI_VERSION="1.46.3"
venv="$TOOLS/awscli-$AWSCLI_VERSION"
if [ ! -x "$venv/bin/aws" ] || ! "$venv/bin/aws" --version >/dev/null 2>&1; then
  log "pip install awscli==$AWSCLI_VERSION into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "awscli==$AWSCLI_VERSION" >&2
fi
echo "$venv/bin/aws"
