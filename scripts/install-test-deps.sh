#!/usr/bin/env bash
# Installs what the tests need: xfsprogs from Debian, csi-sanity from the Go
# module proxy (pinned), cached under $TOOLS by version.
source "$(dirname "$0")/lib.sh"
need_root
apt_install xfsprogs util-linux
go_install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_SANITY_VERSION" "$CSI_SANITY"
