#!/usr/bin/env bash
# The OCI registry for the oci:// source tests: Debian's docker-registry
# (CNCF distribution 2.8). tests/it/support/registry.rs runs it on loopback at
# a free port with its own config and storage, so a system instance, if the
# package started one, is left alone. Installs the package when missing;
# prints the binary's path (and nothing else) on stdout.
source "$(dirname "$0")/../lib.sh"
bin=/usr/bin/docker-registry
if [ ! -x "$bin" ]; then
  apt_install docker-registry >&2
fi
[ -x "$bin" ] || { echo "docker-registry was not installed at $bin" >&2; exit 1; }
echo "$bin"
