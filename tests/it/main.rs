//! The integration tests, one binary: each module drives the real
//! `modelcache-csi` (its binary over the CSI socket, or its library
//! in-process) against real services from `support/` (kube-apiserver, MinIO,
//! an OCI registry, fixtures that misbehave on purpose).
//!
//! Run as root in a private mount namespace (tests/scripts/test.sh does):
//! `unshare -m --propagation private cargo test --test it`.

mod support;

mod admin_cli;
mod any_client;
mod concurrency;
mod crash_resume;
mod deploy;
mod expansion;
mod fanout_links;
mod fleet;
mod gated_pulls;
mod hostile;
mod idempotency;
mod informers;
mod kube_sources;
mod metrics;
mod node_scale;
mod node_trust;
mod peer_fill;
mod placement;
mod prefetch;
mod progressive;
mod progressive_volumes;
mod pull_s3;
mod pull_sources;
mod puller_engine;
mod puller_http;
mod puller_oci;
mod puller_s3;
mod read_only;
mod read_paths;
mod registration;
mod rescheduler;
mod restart;
mod seal_bounds;
mod shared_fs;
mod signatures;
mod source_lifecycle;
mod sub_path;
mod tenant;
mod warm_labels;
mod xfs;
