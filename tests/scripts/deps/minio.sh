#!/usr/bin/env bash
# MinIO for the S3 tests: built from source with `go install`, pinned to one
# commit, cached under $TOOLS by that commit's date. Prints the binary path.
# The first build takes several minutes; later runs print the cached path.
source "$(dirname "$0")/../lib.sh"
MINIO_VERSION="v0.0.0-20260212201848-7aac2a2c5b7c"
dest="$TOOLS/minio-20260212201848/minio"
go_install "github.com/minio/minio@$MINIO_VERSION" "$dest" >&2
echo "$dest"
