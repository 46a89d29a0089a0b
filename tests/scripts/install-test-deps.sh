#!/usr/bin/env bash
# Installs what the tests need, each cached by version so a warm run is quick:
# xfsprogs and docker-registry from Debian, csi-sanity and MinIO from the Go
# module proxy (pinned), from PyPI the real all-MiniLM-L6-v2 model and
# grpcio (a C-core gRPC client for tests/it/any_client.rs) and the
# model-signing CLI (tests/it/signatures.rs).
source "$(dirname "$0")/lib.sh"
need_root
apt_install xfsprogs util-linux e2fsprogs openssl curl g++
go_install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_SANITY_VERSION" "$CSI_SANITY"
"$ROOT/tests/scripts/deps/registry.sh" >/dev/null
"$ROOT/tests/scripts/deps/minio.sh" >/dev/null
"$ROOT/tests/scripts/deps/model.sh" >/dev/null
"$ROOT/tests/scripts/deps/grpcio.sh" >/dev/null
"$ROOT/tests/scripts/deps/model-signing.sh" >/dev/null
# etcd, kube-apiserver and kubectl for the tests against a real API server.
bash "$ROOT/e2e/k8s/build.sh" etcd kube-apiserver kubectl >/dev/null
