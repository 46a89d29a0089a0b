#!/usr/bin/env bash
# The MinIO client `mc` for the puller benchmark: built from source with
# `go install`, pinned to one commit, cached under $TOOLS by that commit's
# date. Prints the binary path. The first build takes a few minutes.
source "$(dirname "$0")/../scripts/lib.sh"
MC_VERSION="v0.0.0-20250313080218-cf909e1063a9"
dest="$TOOLS/mc-20250313080218/mc"
go_install "github.com/minio/mc@$MC_VERSION" "$dest" >&2
echo "$dest"
