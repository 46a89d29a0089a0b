#!/usr/bin/env bash
# Helm for the chart test (tests/scripts/helm-chart.sh): built from source
# with `go install`, pinned, cached under $TOOLS by version. Prints the
# binary path.
source "$(dirname "$0")/../lib.sh"
HELM_VERSION="v3.22.0"
dest="$TOOLS/helm-$HELM_VERSION/helm"
go_install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" "$dest" >&2
echo "$dest"
